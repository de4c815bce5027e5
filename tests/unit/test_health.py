"""The health gate (``node.facts.health``), the doctor's view of it, the restart rule that leaves an
unhealthy node out, and the words for a lost node (``launch.lost``): pure parts, on given facts."""

from __future__ import annotations

import time

import pytest

from ptcluster.cluster.model import ClusterSpec, MasterSpec, NodeSpec
from ptcluster.doctor.checks import FAIL, OK
from ptcluster.doctor.health_checks import check_health
from ptcluster.doctor.node_report import NodeReport
from ptcluster.launch.lost import NO_ANSWER, explain, explained, lost_nodes, reword, span
from ptcluster.launch.result import AttemptRecord, Failure, FailureKind, NodeOutcome
from ptcluster.launch.supervise.restart import RestartPolicy, decide
from ptcluster.node.facts.health import (
    GIB,
    check_checkpoint_disk,
    check_disk,
    check_gpu_count,
    check_memory,
    judge,
    unfit,
)
from tests.support.health import MIB, NO_DRIVER, checkpoint, facts


@pytest.mark.parametrize("free, total, ok", [
    (0, 16 * MIB, False),              # a tiny tmpfs, filled up
    (8 * MIB, 16 * MIB, True),          # half of a tiny one: nearly empty, not nearly full
    (900 * MIB, 100 * GIB, False),      # under 1 GiB and under 5 %
    (2 * GIB, 100 * GIB, True),         # 2 %, but 2 GiB
    (200 * GIB, 20_000 * GIB, True),    # 1 % of a large disk is plenty
])
def test_disk_is_nearly_full_below_1_gib_and_5_percent(free, total, ok) -> None:
    found = check_disk(facts(disk=(free, total)))
    assert found["ok"] is ok, found
    if not ok:
        assert found["code"] == "health.workdir-disk-full" and found["fields"]["path"] == "/w"
        assert found["fix"]


def test_memory_needs_256_mib_per_rank() -> None:
    assert check_memory(facts(slots=4, memory=(1 * GIB, 16 * GIB)))["ok"]
    low = check_memory(facts(slots=4, memory=(900 * MIB, 16 * GIB)))
    assert not low["ok"] and low["code"] == "health.memory-low"
    assert low["fields"] == {"available": "900 MiB", "total": "16.0 GiB", "slots": "4",
                             "need": "1.0 GiB", "each": "256 MiB"}
    # one rendering kept: the table's text, filled in
    assert low["what"] == ("too little memory available: 900 MiB of 16.0 GiB memory available, "
                           "4 rank(s) need at least 1.0 GiB (256 MiB each)")


@pytest.mark.parametrize("given, ok", [
    ({"slots": 8, "gpu_count": 7}, False),                     # a GPU fell off the bus
    ({"slots": 8, "gpu_count": 8}, True),
    ({"slots": 2, "gpu_count": 0}, None),                      # a CPU node: not asked
    ({"slots": 2, "gpu_count": 0, "backend": "nccl"}, False),  # NCCL asked, no GPU left
    ({"slots": 8, "gpu_count": 2, "chosen": True}, None),      # gpus: named, or Slurm's
])
def test_gpu_count_against_slots(given, ok) -> None:
    found = check_gpu_count(facts(**given))
    assert (None if found is None else found["ok"]) is ok, found


def test_the_gate_joins_every_failed_check() -> None:
    found = judge(facts(slots=2, gpu_count=1, disk=(0, 16 * MIB), memory=(100 * MIB, GIB),
                        driver=NO_DRIVER))
    assert [f["check"] for f in found] == ["gpus", "disk", "memory", "gpu-driver"]
    refusal = unfit(found)
    assert refusal is not None
    assert refusal["what"].count("; ") == 2 and refusal["fix"].count("; ") == 2
    assert refusal["code"] == "health.gpus-fewer"  # (the first reason's, and its fields)
    assert refusal["fields"] == {"count": "1", "slots": "2", "why": ""}
    assert unfit([f for f in found if f["ok"]]) is None


def spec2() -> ClusterSpec:
    return ClusterSpec(nodes=(NodeSpec(host="a", python="p", workdir="/w"),
                              NodeSpec(host="b", python="p", workdir="/w")),
                       master=MasterSpec(addr="a"))


def test_doctor_shows_the_gate_as_the_guard_would_refuse() -> None:
    bad = judge(facts(disk=(0, 16 * MIB), memory=(GIB, 2 * GIB)))
    good = judge(facts(disk=(8 * GIB, 9 * GIB), memory=(GIB, 2 * GIB)))
    probes = {"a": NodeReport(host="a", facts={"health": good}),
              "b": NodeReport(host="b", facts={"health": bad})}
    a, b = check_health(spec2(), probes)
    assert (a.status, b.status) == (OK, FAIL)
    assert (b.code, b.fields["free"], b.fields["path"]) == ("health.workdir-disk-full", "0 MiB",
                                                            "/w")
    assert b.fix and b.fields["floor"] in b.fix


def test_a_restart_leaves_an_unhealthy_node_out_and_says_why() -> None:
    failure = Failure(host="b", rank=None, kind=FailureKind.UNHEALTHY,
                      message="its workdir disk is nearly full: 0 MiB of 16 MiB free")
    last = AttemptRecord(number=1, hosts=["a", "b", "c"], world_size=3, master_port=1,
                         started_at=0.0, cause=failure)
    first = AttemptRecord(number=0, hosts=["a", "b", "c"], world_size=3, master_port=1,
                          started_at=0.0, cause=Failure(host="a", rank=0, message="x"))
    d = decide(RestartPolicy(max_restarts=3, min_nodes=2), [first, last], [failure], False)
    assert d.restart and d.drop == ("b",)
    assert dict(d.why) == {"b": f"unhealthy: {failure.message}"}
    assert d.reason == f"restart 2 of 3 without b (unhealthy: {failure.message})"
    d = decide(RestartPolicy(max_restarts=3, min_nodes=3), [first, last], [failure], False)
    assert not d.restart and d.drop == ("b",) and f"b ({dict(d.why)['b']})" in d.reason


def node(**facts) -> NodeOutcome:
    return NodeOutcome(host="n3", node_rank=2, ready=True, facts=facts)


def test_only_nodes_lost_after_ready_without_a_word_of_their_guard_are_asked() -> None:
    lost, said, rank = node(), node(), node()
    lost.host, said.host, rank.host = "n1", "n2", "n3"
    said.guard_exit = 1
    failures = [Failure(host="n1", rank=None, kind=FailureKind.LOST, message="connection lost"),
                Failure(host="n2", rank=None, kind=FailureKind.LOST, message="its guard ..."),
                Failure(host="n3", rank=1, message="exited with code 1")]
    assert lost_nodes(failures, [lost, said, rank]) == [lost]


def test_a_node_that_does_not_answer() -> None:
    f = Failure(host="n3", rank=None, kind=FailureKind.LOST,
                message="node lost: nothing heard for 20 s (link down or node dead)")
    reword(f, node(boot_id="b1", uptime=10.0, time=100.0, pid=7), None)
    assert f.message == f"{NO_ANSWER} (before: node lost: nothing heard for 20 s (link down " \
                        "or node dead))"
    assert str(f.problem).startswith("n3: does not answer (powered off, or its network is down)")


def test_a_node_that_rebooted_says_when_and_how_long_it_was_up() -> None:
    now = time.time()
    answer = {"boot_id": "b2", "uptime": 60.0, "time": now, "kernel": ["kernel: Oops"]}
    found, lines = explained(node(boot_id="b1", uptime=3 * 3600.0, time=now - 600, pid=7),
                             answer, now - 120, "connection lost")
    booted = time.strftime("%H:%M", time.localtime(now - 60))
    assert found.what == f"rebooted at {booted} (up 3 h before)"  # (the rendering)
    assert (found.code, found.fields) == ("run.lost-rebooted", {
        "at": booted, "was_up": " (up 3 h before)"}) and lines == ["kernel: Oops"]


def test_a_node_up_on_the_same_boot() -> None:
    facts = {"boot_id": "b1", "uptime": 100.0, "time": 1.0, "pid": 4242}
    what, _, _ = explain(node(**facts), {"boot_id": "b1", "guard_alive": False}, 2.0,
                         "connection lost: exit status 137")
    assert what == "is up; its guard ended (connection lost: exit status 137)"
    f = Failure(host="n3", rank=None, kind=FailureKind.LOST, message="connection lost: x")
    reword(f, node(**facts), {"boot_id": "b1", "guard_alive": False})
    assert f.message == "is up; its guard ended (connection lost: x)"  # (the loss said once)
    what, fix, _ = explain(node(**facts), {"boot_id": "b1", "guard_alive": True}, 2.0, "x")
    assert what.startswith("is up and its guard (pid 4242) still runs") and "network" in fix


def test_spans() -> None:
    assert [span(s) for s in (40, 1500, 3 * 3600, 3 * 86400)] == ["40 s", "25 min", "3 h", "3 d"]


def test_a_restart_checks_the_disk_of_the_last_checkpoint() -> None:
    full = check_checkpoint_disk(facts(checkpoints=[checkpoint("/ck/run1", (0, 3 * MIB))]))
    assert full is not None and not full["ok"]
    assert full["code"] == "health.checkpoint-disk-full"
    assert full["fields"] == {"free": "0 MiB", "total": "3.0 MiB", "path": "/ck/run1",
                              "floor": "1.0 GiB", "share": "5%"}
    assert check_checkpoint_disk(facts(checkpoints=[checkpoint("/ck", (2 * GIB, 9 * GIB))]))["ok"]
    # 20 % free, but less than another checkpoint as large as the last needs
    small = check_checkpoint_disk(facts(checkpoints=[
        checkpoint("/ck", (600 << 10, 3 * MIB), largest=1200 << 10)]))
    assert not small["ok"] and small["code"] == "health.checkpoint-no-room"
    assert small["fields"] == {"free": "0.6 MiB", "total": "3.0 MiB", "path": "/ck",
                               "largest": "1.2 MiB"}
    # no checkpoint said (a first attempt, or a job that does not say where): not asked
    assert check_checkpoint_disk(facts()) is None
    # on the workdir's filesystem, nearly full is the workdir's to say
    assert check_checkpoint_disk(facts(checkpoints=[
        checkpoint("/w/ck", (0, 3 * MIB), beside_workdir=True)])) is None
