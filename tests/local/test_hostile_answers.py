"""A hostile node's kill and probe answers (issue 43 item 2): a real process answers the
shipped kill/probe protocol with a malformed frame; the head names that node and believes none
of it, and a well-formed answer from another node still counts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ptcluster.cluster import parse_cluster_text
from ptcluster.control import kill
from ptcluster.launch import lost
from ptcluster.launch.plan import Target, plan_launch
from ptcluster.launch.result import NodeOutcome
from ptcluster.remote.transport import LocalTransport, Transport
from tests.support.hostile import HostileTransport

SPEC = parse_cluster_text("nodes: [{host: good}, {host: evil}]\n", "c.yaml")
GOOD_KILL = {"found": True, "pid": 4242, "user": "alice", "signalled": True}
GOOD_BOOT = {"boot_id": "b2", "uptime": 30.0, "time": 1.0e9, "guard_alive": False,
             "kernel": ["kernel: panic"]}


def _nodes(tmp: Path, kind: str, program: str, good: dict[str, Any],
           evil: Any) -> dict[str, Transport]:
    (tmp / "good.json").write_text(json.dumps(good))
    (tmp / "evil.json").write_text(json.dumps(evil))
    return {h: HostileTransport(h, program, kind, tmp / f"{h}.json") for h in ("good", "evil")}


@pytest.mark.parametrize("evil", [
    {"found": True, "signalled": "yes"},
    {"found": True, "signalled": True, "error": "x" * 1_000_000},
    {"found": True, "pid": "1; reboot", "signalled": True},
    {"found": True, "user": "a\x1b[2Jb" * 100, "signalled": False},
    {"found": [1]},
])
def test_a_malformed_kill_answer_is_that_nodes_failure(evil: Any, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    reach = _nodes(tmp_path, "result", "kill", GOOD_KILL, evil)
    monkeypatch.setattr(kill, "transports", lambda spec: reach)
    stop = kill.stop_through_guards(SPEC, "j-1", "TERM", {"user": "me"}, timeout=30)
    assert stop.signalled == ["good"]
    assert list(stop.failed) == ["evil"] and stop.failed["evil"].code == "kill.malformed-answer"
    assert len(str(stop.failed["evil"])) < 400 and not stop.refused


@pytest.mark.parametrize("evil", [
    {"boot_id": "b9", "time": "late", "guard_alive": False},
    {"boot_id": "b9\n" * 5000, "time": 1.0, "uptime": 3.0},
    {"boot_id": "b9", "time": 1.0, "kernel": ["x"] * 100_000},
    {"boot_id": "b9", "time": 1.0, "guard_alive": "maybe"},
])
def test_a_malformed_probe_answer_is_not_believed(evil: Any, tmp_path: Path) -> None:
    plan = plan_launch(SPEC, Target(script="x.py"), port=29500, job_id="j-1")
    nodes = [NodeOutcome(host=h, node_rank=i, ready=True,
                         facts={"boot_id": "b1", "pid": 7, "time": 0.0})
             for i, h in enumerate(("good", "evil"))]
    answers = lost.probe(nodes, plan, "j-1", _nodes(tmp_path, "boot", "probe", GOOD_BOOT, evil))
    assert answers["good"] == GOOD_BOOT
    assert isinstance(answers["evil"], lost.Unbelieved)
    assert lost.after_loss(answers["evil"]) == {"answered": True,
                                                 "malformed": answers["evil"].why}
    found, lines = lost.explained(nodes[1], answers["evil"], 1.0, "lost")
    assert (found.code, found.fields) == ("run.lost-malformed", {"why": answers["evil"].why})
    assert not lines and len(found.what) < 400


def test_the_real_probe_programs_answer_passes_the_check() -> None:
    spec = parse_cluster_text("nodes: [{host: localhost}]\n", "c.yaml")
    plan = plan_launch(spec, Target(script="x.py"), port=29500, job_id="j-1")
    nodes = [NodeOutcome(host="localhost", node_rank=0, ready=True,
                         facts={"boot_id": "another", "pid": 1, "time": 0.0})]
    answer = lost.probe(nodes, plan, "j-1", {"localhost": LocalTransport()})["localhost"]
    assert lost.back(answer) is not None and answer["boot_id"], answer
