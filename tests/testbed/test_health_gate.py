"""The health gate on testbed nodes: a node whose workdir disk is full is refused before any
rank starts, and a restart (``--max-restarts``, where ``--min-nodes`` allows) leaves it out like
a lost node; the summary says why."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.support.head import run_head
from tests.support.testbed import full_workdir, next_port
from tests.testbed.test_run import RANKS

pytestmark = [pytest.mark.testbed, pytest.mark.slow]


@pytest.fixture
def job_dir(tmp_path):
    (tmp_path / "ranks.py").write_text(RANKS)
    return tmp_path


@pytest.fixture
def full_dir(testbed, tmp_path):
    """Node 2's workdir: full, with the job's script on it (``full_workdir``)."""
    with full_workdir(testbed.nodes[2], tmp_path / "full", RANKS) as mnt:
        yield mnt


def test_a_full_node_is_left_out_and_the_job_goes_on_without_it(testbed, job_dir, full_dir,
                                                                no_leftovers) -> None:
    sick = testbed.nodes[2]
    text = testbed.cluster_yaml([1, 1, 1], python=sys.executable, workdir=str(job_dir),
                                port=next_port())
    text = text.replace(f"{{host: {sick.name}, slots: 1}}",
                        f"{{host: {sick.name}, slots: 1, workdir: {full_dir}}}")
    (job_dir / "cluster.yaml").write_text(text)
    out = job_dir / "out"
    out.mkdir()
    os.chmod(out, 0o777)
    code, head = run_head(["run", "--cluster", "cluster.yaml", "--run-dir", "runs",
                           "--max-restarts", "1", "--min-nodes", "2", "ranks.py", str(out)],
                          cwd=job_dir, timeout=180)
    (run,) = [p for p in (job_dir / "runs").iterdir() if p.is_dir()]
    no_leftovers.append(run.name)
    summary = json.loads((run / "summary.json").read_text())
    err = "\n".join(head.err)
    assert code == 0, head.output()
    first, second = summary["attempts"]
    assert first["cause"]["kind"] == "unhealthy" and first["cause"]["host"] == sick.name
    assert first["cause"]["code"] == "health.workdir-disk-full", first
    assert (first["cause"]["fields"]["free"], first["cause"]["fields"]["total"]) == (
        "0 MiB", "16 MiB"), first
    assert first["dropped"] == [sick.name]
    assert first["dropped_why"][sick.name] == f"unhealthy: {first['cause']['message']}", first
    assert sick.name not in second["hosts"] and second["ok"] and second["world_size"] == 2
    assert f"restart 1 of 1 without {sick.name} (unhealthy: its workdir disk is nearly full" \
        in err, head.output()
    assert sorted(p.name for p in out.iterdir()) == ["rank0.json", "rank1.json"]
