"""Whole-job restarts on 3 testbed nodes, each with its own workdir (its own checkpoints):
a node whose link is cut is dropped and the job goes on without it, from the checkpoints of
the nodes that remain — also when the lost node held rank 0 and the rendezvous."""

from __future__ import annotations

import json
import re

import pytest

from tests.support.head import Head, job_id_when_started, only_run, rank_fields
from tests.support.procs import job_processes
from tests.testbed.test_trainer import cluster_file

pytestmark = [pytest.mark.testbed, pytest.mark.slow]
TRAIN = ["-m", "ptcluster.examples.mnist", "--no-download", "--dataset", "digits",
         "--batch-size", "32", "--epochs", "25", "--checkpoint-every-steps", "4"]
"""4 ranks (2+1+1): a global batch of 128, 11 steps per epoch; on 3 ranks 43+43+42 (the
shares of a batch that 3 cannot divide), on 2 ranks 64 each."""


@pytest.mark.parametrize(("victim_index", "own_addr"), [(2, False), (0, False), (0, True)],
                         ids=["a-worker-node", "the-master-node", "the-master-by-its-address"])
def test_a_lost_node_is_dropped_and_the_job_resumes_on_the_others(
        testbed, tmp_path, no_leftovers, victim_index, own_addr) -> None:
    cluster, workdirs = cluster_file(testbed, tmp_path)
    victim = testbed.nodes[victim_index]
    if own_addr:  # the master by its own address (a fabric address, not its host)
        text = re.sub(r"master: \{port: (\d+)\}", rf"master: {{addr: {victim.addr}, port: \1}}",
                      cluster.read_text())
        assert victim.addr in text
        cluster.write_text(text)
    runs = tmp_path / "runs"
    head = Head(["run", "--cluster", str(cluster), "--run-dir", str(runs), "--max-restarts",
                 "2", "--min-nodes", "2", *TRAIN], cwd=tmp_path)
    try:
        job_id = job_id_when_started(runs)
        no_leftovers.append(job_id)
        head.wait_for("epoch 3/25", timeout=120)
        testbed.cut_link(victim)
        code = head.wait(timeout=240)
        left = [p for p, _ in job_processes(job_id, wait=30)]  # the cut-off guard ends itself
    finally:
        testbed.restore_link(victim)
        if head.proc.poll() is None:
            head.kill()
    assert code == 0, head.output()
    assert left == [], left
    _, s = only_run(runs)
    first, second = s["attempts"]
    assert first["cause"]["host"] == victim.name and first["cause"]["kind"] == "lost", first
    assert first["dropped"] == [victim.name]
    assert second["hosts"] == [n.name for n in testbed.nodes if n is not victim]
    # The ranks were renumbered over the two nodes left: 2+1 or 1+1.
    assert second["world_size"] == (2 if victim_index == 0 else 3), second
    assert second["ok"] and second["resumed_from"] >= 2 * 11, second  # after epoch 2 at least
    # the restart's ranks were forked from each remaining node's warm pool of the job
    assert (first["warm"], second["warm"]) == ({n: False for n in first["hosts"]},
                                               {n: True for n in second["hosts"]}), second
    # Nothing saved was lost: it resumed from the newest checkpoint the job reported.
    assert second["resumed_from"] == first["checkpoint"], (first, second)
    ranks = rank_fields(head.lines)
    assert sorted(ranks) == list(range(second["world_size"])), head.output()
    assert len({r["params_sha256"] for r in ranks.values()}) == 1, ranks
    assert {r["start_step"] for r in ranks.values()} == {str(second["resumed_from"])}, ranks
    err = "\n".join(head.err)
    assert f"restart 1 of 2 without {victim.name}" in err, err
    # The next master: at the address its guard reported when the file gave one of its own
    plan = json.loads((runs / job_id / "plan.1.json").read_text())
    assert plan["master_addr"] == (testbed.nodes[1].addr if own_addr else
                                   testbed.nodes[1].name if victim_index == 0 else
                                   testbed.nodes[0].name), plan["master_addr"]
    # Each node resumed from its own disk: the lost node's copies were never needed.
    assert not (workdirs[victim_index] / "checkpoints" / "checkpoint-24.pt").exists()
    for i, w in enumerate(workdirs):
        if i != victim_index:
            assert (w / "checkpoints" / "checkpoint-24.pt").exists(), i
