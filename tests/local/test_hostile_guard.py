"""A hostile guard among real channels (issue 43 item 1): fake nodes (``tests/support/fakenode.py``)
speak the head<->guard protocol to the real runner and supervisor, one of them with a forged
``ready`` frame. The job fails before any rank starts, naming that node and what it sent; the
other nodes are stopped; nothing the bad node said is in ``summary.json``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ptcluster.launch.options import RunOptions
from ptcluster.launch.runner import Runner
from tests.support.fakenode import fake_job


@pytest.mark.parametrize("forged, words", [
    ({"address": "10.0.0.3\nPrologSlurmctld=/tmp/x"}, "ready.address"),
    ({"master_port": 0}, "ready.master_port"),
    ({"interface": "eth0/../../x"}, "ready.interface"),
])
def test_a_guard_that_forges_its_ready_facts_is_that_nodes_failure(
        forged: dict, words: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ready = {"hostname": "f1", "pid": os.getpid(), "python": "/usr/bin/python3", "time": 1.0,
             "workdir": "/tmp", "subreaper": True, **forged}
    (tmp_path / "ready.json").write_text(json.dumps(ready))
    monkeypatch.setenv("FAKE_READY", f"f1:{tmp_path / 'ready.json'}")
    monkeypatch.setenv("FAKE_SECONDS", "30")
    plan, transports = fake_job(3, slots=2)
    notes: list[str] = []
    result = Runner(plan, transports, tmp_path / "run", on_status=notes.append,
                    options=RunOptions(ready_timeout=60.0)).run()
    assert not result.ok
    first = result.failures[0]
    assert (first.host, first.code) == ("f1", "run.malformed-frame"), result.failures
    assert (first.problem.fields["host"], first.problem.fields["kind"]) == ("f1", "ready")
    assert words in first.problem.fields["error"]
    assert all(r.started_at is None for r in result.ranks)  # (stopped before `go`)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    node = next(n for n in summary["nodes"] if n["host"] == "f1")
    assert node["address"] is None and node["interface"] is None, node
