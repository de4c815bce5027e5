"""The reference trainer on 3 testbed nodes that each have their own workdir (their own "disk").

The testbed shares one filesystem, so each node gets its own workdir: its checkpoints and its
``./data`` are then its own, as on machines with separate disks. Offline data only
(``--no-download``: MNIST IDX files written by the test, else the bundled digits).
"""

from __future__ import annotations

import re
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.local.test_trainer import end_epochs, make_mnist_dir
from tests.support.head import Head, job_id_when_started, rank_fields
from tests.support.testbed import next_port

pytestmark = [pytest.mark.testbed, pytest.mark.slow]
SLOTS = (2, 1, 1)  # 4 ranks: node 0 holds ranks 0 and 1
RUN_TIMEOUT = 240.0  # a run takes ~20-40 s here; a hang (mismatched collectives) must fail


def cluster_file(testbed, root: Path) -> tuple[Path, list[Path]]:
    """A cluster file whose nodes each have their own workdir under ``root``."""
    workdirs = [root / f"node{i}" for i in range(len(SLOTS))]
    for w in workdirs:
        w.mkdir(parents=True, exist_ok=True)
    text = testbed.cluster_yaml(list(SLOTS), python=sys.executable, workdir=str(root),
                                port=next_port())
    nodes = "".join(f"  - {{host: {n.name}, slots: {s}, workdir: {w}}}\n"
                    for n, s, w in zip(testbed.nodes, SLOTS, workdirs, strict=True))
    text = re.sub(r"nodes:\n(  - .*\n)+", lambda _: "nodes:\n" + nodes, text)
    path = root / "cluster.yaml"
    path.write_text(text)
    return path, workdirs


def train(root: Path, cluster: Path, no_leftovers: list[str], *args: str) -> list[str]:
    """One `ptcluster run` of the trainer; its output lines. Fails on a non-zero exit."""
    runs = root / f"runs-{time.monotonic_ns()}"
    head = Head(["run", "--cluster", str(cluster), "--run-dir", str(runs), "-m",
                 "ptcluster.examples.mnist", "--no-download", "--batch-size", "32", *args],
                cwd=root)
    try:
        no_leftovers.append(job_id_when_started(runs))
        code = head.wait(timeout=RUN_TIMEOUT)
    finally:
        if head.proc.poll() is None:
            head.kill()
    assert code == 0, head.output()
    return head.lines


def epochs_on_disk(workdir: Path) -> list[int]:
    return sorted(end_epochs(workdir / "checkpoints"))


def in_step(lines: list[str], world: int = len(SLOTS) + 1) -> dict[int, dict[str, str]]:
    """Every rank's final fields; all ranks ended with one model (checked in every run)."""
    ranks = rank_fields(lines)
    assert sorted(ranks) == list(range(world)), "\n".join(lines)
    assert len({r["params_sha256"] for r in ranks.values()}) == 1, ranks
    return ranks


def test_resume_takes_the_newest_checkpoint_any_node_has(testbed, tmp_path,
                                                         no_leftovers) -> None:
    cluster, workdirs = cluster_file(testbed, tmp_path)
    hosts = [n.name for n in testbed.nodes]
    lines = train(tmp_path, cluster, no_leftovers, "--epochs", "2")
    assert "dataset=digits" in "\n".join(lines)
    ranks = in_step(lines)
    assert {r["start_epoch"] for r in ranks.values()} == {"0"}, ranks

    # Node 1 lost its newest checkpoint, node 2 holds other bytes under its name (a copy that
    # is not the others'): both get node 0's (rank 0's) over the process group and keep it.
    (workdirs[1] / "checkpoints" / "checkpoint-1.pt").unlink()
    other = torch.load(workdirs[2] / "checkpoints" / "checkpoint-1.pt", weights_only=True)
    for t in other["optimizer"]["state"][0].values():
        t.add_(1.0)
    torch.save(other, workdirs[2] / "checkpoints" / "checkpoint-1.pt")
    lines = train(tmp_path, cluster, no_leftovers, "--epochs", "3", "--resume")
    text = "\n".join(lines)
    ranks = in_step(lines)
    assert {r["start_epoch"] for r in ranks.values()} == {"2"}, ranks
    assert "epoch 2/3" not in text and "epoch 3/3" in text, text
    assert (f"resume: checkpoint-1.pt came from {hosts[0]} (rank 0) to {hosts[1]}, {hosts[2]}"
            in text), text
    assert f"the copy of checkpoint-1.pt on {hosts[2]} was not the same" in text, text
    for w in workdirs:  # every node keeps its own copies, the last two (epoch indices 1, 2)
        assert epochs_on_disk(w) == [1, 2], w
        assert not list((w / "checkpoints").glob("*.tmp*"))
    copies = {(w / "checkpoints" / "checkpoint-1.pt").read_bytes() for w in workdirs}
    assert len(copies) == 1

    # Node 0 loses its disk: the newest checkpoint is on nodes 1 and 2, and node 0 gets it
    # from the first rank that holds it (rank 2, node 1). Nothing is lost.
    shutil.rmtree(workdirs[0] / "checkpoints")
    lines = train(tmp_path, cluster, no_leftovers, "--epochs", "4", "--resume")
    text = "\n".join(lines)
    ranks = in_step(lines)
    assert {r["start_epoch"] for r in ranks.values()} == {"3"}, ranks
    assert f"resume: checkpoint-2.pt came from {hosts[1]} (rank 2) to {hosts[0]} (" in text, text
    assert "starting fresh" not in text and "epoch 4/4" in text, text
    assert [epochs_on_disk(w) for w in workdirs] == [[2, 3], [2, 3], [2, 3]]

    # Only when no node has any checkpoint does every rank start afresh.
    for w in workdirs:
        shutil.rmtree(w / "checkpoints")
    lines = train(tmp_path, cluster, no_leftovers, "--epochs", "1", "--resume")
    ranks = in_step(lines)
    assert {r["start_epoch"] for r in ranks.values()} == {"0"}, ranks
    assert any("no node has a checkpoint" in line for line in lines), "\n".join(lines)
    assert [epochs_on_disk(w) for w in workdirs] == [[0], [0], [0]]


def test_mnist_on_some_nodes_only_means_digits_everywhere(testbed, tmp_path,
                                                          no_leftovers) -> None:
    cluster, workdirs = cluster_file(testbed, tmp_path)
    make_mnist_dir(workdirs[0] / "data")  # nodes 0 and 1 have MNIST files, node 2 has none
    make_mnist_dir(workdirs[1] / "data" / "MNIST" / "raw")
    lines = train(tmp_path, cluster, no_leftovers, "--epochs", "1")
    text = "\n".join(lines)
    assert "dataset=digits" in text and "dataset=mnist" not in text, text
    in_step(lines)

    make_mnist_dir(workdirs[2] / "data")  # now every node has them: MNIST everywhere
    lines = train(tmp_path, cluster, no_leftovers, "--epochs", "1")
    assert "dataset=mnist" in "\n".join(lines)
    in_step(lines)
