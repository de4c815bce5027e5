"""The reference trainer on 3 testbed nodes that each have their own workdir (their own "disk").

The testbed shares one filesystem, so each node gets its own workdir: its checkpoints and its
``./data`` are then its own, as on machines with separate disks. Offline data only
(``--no-download``: MNIST IDX files written by the test, else the bundled digits).
"""

from __future__ import annotations

import itertools
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

from tests.jobs import Head, job_id_when_started, rank_fields
from tests.test_trainer import make_mnist_dir

pytestmark = [pytest.mark.testbed, pytest.mark.slow]
_ports = itertools.count(29710)
SLOTS = (2, 1, 1)  # 4 ranks: node 0 holds ranks 0 and 1
RUN_TIMEOUT = 240.0  # a run takes ~20-40 s here; a hang (mismatched collectives) must fail


def cluster_file(testbed, root: Path) -> tuple[Path, list[Path]]:
    """A cluster file whose nodes each have their own workdir under ``root``."""
    workdirs = [root / f"node{i}" for i in range(len(SLOTS))]
    for w in workdirs:
        w.mkdir(parents=True, exist_ok=True)
    text = testbed.cluster_yaml(list(SLOTS), python=sys.executable, workdir=str(root),
                                port=next(_ports))
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
    return sorted(int(m.group(1)) for p in (workdir / "checkpoints").glob("*")
                  if (m := re.fullmatch(r"checkpoint-(\d+)\.pt", p.name)))


def test_resume_takes_the_newest_epoch_every_node_has(testbed, tmp_path, no_leftovers) -> None:
    cluster, workdirs = cluster_file(testbed, tmp_path)
    lines = train(tmp_path, cluster, no_leftovers, "--epochs", "2")
    assert "dataset=digits" in "\n".join(lines)
    ranks = rank_fields(lines)
    assert {r["start_epoch"] for r in ranks.values()} == {"0"}, ranks

    # Nodes hold different newest epochs: node 1 lost its last one. Every rank resumes after
    # the newest epoch all nodes have (index 0), each from its own node's disk.
    (workdirs[1] / "checkpoints" / "checkpoint-1.pt").unlink(missing_ok=True)
    lines = train(tmp_path, cluster, no_leftovers, "--epochs", "3", "--resume")
    text = "\n".join(lines)
    ranks = rank_fields(lines)
    assert sorted(ranks) == [0, 1, 2, 3], text
    assert {r["start_epoch"] for r in ranks.values()} == {"1"}, ranks
    assert len({r["params_sha256"] for r in ranks.values()}) == 1, ranks
    assert "epoch 1/3" not in text and "epoch 2/3" in text and "epoch 3/3" in text, text
    for w in workdirs:  # every node keeps its own copies, the last two (epoch indices 1, 2)
        assert epochs_on_disk(w) == [1, 2], w
        assert not list((w / "checkpoints").glob("*.tmp*"))

    # Node 0 loses its disk: no epoch is on every node, so every rank starts afresh (and the
    # other nodes' stale, newer checkpoints are pruned as the new run saves).
    shutil.rmtree(workdirs[0] / "checkpoints")
    lines = train(tmp_path, cluster, no_leftovers, "--epochs", "1", "--resume")
    ranks = rank_fields(lines)
    assert sorted(ranks) == [0, 1, 2, 3], "\n".join(lines)
    assert {r["start_epoch"] for r in ranks.values()} == {"0"}, ranks
    assert len({r["params_sha256"] for r in ranks.values()}) == 1, ranks
    assert any("starting fresh" in line for line in lines), "\n".join(lines)
    assert [epochs_on_disk(w) for w in workdirs] == [[0], [0], [0]]


def test_mnist_on_some_nodes_only_means_digits_everywhere(testbed, tmp_path,
                                                          no_leftovers) -> None:
    cluster, workdirs = cluster_file(testbed, tmp_path)
    make_mnist_dir(workdirs[0] / "data")  # nodes 0 and 1 have MNIST files, node 2 has none
    make_mnist_dir(workdirs[1] / "data" / "MNIST" / "raw")
    lines = train(tmp_path, cluster, no_leftovers, "--epochs", "1")
    text = "\n".join(lines)
    assert "dataset=digits" in text and "dataset=mnist" not in text, text
    ranks = rank_fields(lines)
    assert sorted(ranks) == [0, 1, 2, 3], text
    assert len({r["params_sha256"] for r in ranks.values()}) == 1, ranks

    make_mnist_dir(workdirs[2] / "data")  # now every node has them: MNIST everywhere
    lines = train(tmp_path, cluster, no_leftovers, "--epochs", "1")
    assert "dataset=mnist" in "\n".join(lines)
