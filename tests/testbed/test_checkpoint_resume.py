"""Issue 44 item 3: a job that checkpoints with ``ptcluster.checkpoint`` loses a node with its
disk (rank 0's node, which also hosts the rendezvous: its link cut, its checkpoint directory
wiped); ``--max-restarts`` starts the next attempt on the two nodes left, which loads from the
replicas and ends with the parameters of a run that lost nothing (another world size: 4 ranks,
then 2; equal within 1e-5); then `ptcluster collect` over ssh gathers the last step from the
nodes into one folder that DCP loads in one process. 3 testbed nodes, each with its own workdir
(its own disk)."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.support.ckptjob import PROGRAM
from tests.support.head import Head, job_id_when_started, only_run
from tests.testbed.test_trainer import cluster_file

pytestmark = [pytest.mark.testbed, pytest.mark.slow]
JOB = [str(PROGRAM), "--steps", "36", "--every", "4", "--sleep", "0.25", "--resume"]


def test_a_lost_node_and_its_disk_resume_from_the_replicas_with_the_same_parameters(
        testbed, tmp_path, no_leftovers, cli) -> None:
    # the run that loses nothing
    unbroken = tmp_path / "unbroken"
    unbroken.mkdir()
    cluster, _ = cluster_file(testbed, unbroken)
    head = Head(["run", "--cluster", str(cluster), "--run-dir", str(unbroken / "runs"), *JOB,
                 "--out", str(unbroken / "out.pt")], cwd=unbroken)
    try:
        no_leftovers.append(job_id_when_started(unbroken / "runs"))
        assert head.wait(timeout=240) == 0, head.output()
    finally:
        if head.proc.poll() is None:
            head.kill()
    # the run that loses node 0 (ranks 0 and 1, the rendezvous) and its disk after step 14
    broken = tmp_path / "broken"
    broken.mkdir()
    cluster, workdirs = cluster_file(testbed, broken)
    victim = testbed.nodes[0]
    head = Head(["run", "--cluster", str(cluster), "--run-dir", str(broken / "runs"),
                 "--max-restarts", "2", "--min-nodes", "2", *JOB,
                 "--out", str(broken / "out.pt")], cwd=broken)
    try:
        no_leftovers.append(job_id_when_started(broken / "runs"))
        head.wait_for("step 14 done", timeout=180)
        testbed.cut_link(victim)
        shutil.rmtree(workdirs[0] / "ckpt")
        code = head.wait(timeout=300)
    finally:
        testbed.restore_link(victim)
        if head.proc.poll() is None:
            head.kill()
    assert code == 0, head.output()
    _, s = only_run(broken / "runs")
    first, second = s["attempts"]
    assert first["cause"]["host"] == victim.name, first
    assert second["world_size"] == 2 and second["ok"], second
    assert second["resumed_from"] >= 12, second  # steps 4, 8, 12 were complete before the cut
    assert any(f"loaded {second['resumed_from']}" in line for line in head.lines), head.output()
    want = torch.load(unbroken / "out.pt", weights_only=True)
    got = torch.load(broken / "out.pt", weights_only=True)
    for name, tensor in want["params"].items():
        assert (got["params"][name] - tensor).abs().max() <= 1e-5, name
    assert torch.equal(got["extra"], want["extra"])
    # collect over ssh from the 3 nodes (node 0 back, its disk empty): the last step, whole
    code, out, err = cli("collect", "ckpt", "--to", str(broken / "collected"), "--cluster",
                         str(cluster))
    assert code == 0, err
    assert "step 36:" in out
    state = {"app": {"model": {k: torch.empty_like(v) for k, v in want["params"].items()}},
             "extra": torch.empty(3)}
    dcp.load(state, checkpoint_id=str(broken / "collected"), no_dist=True)
    for name, tensor in got["params"].items():
        assert torch.equal(state["app"]["model"][name], tensor), name
