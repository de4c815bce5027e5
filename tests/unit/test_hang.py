"""The head's hang rule (``launch.supervise.hang.HangWatch``) and the supervisor's hang path on a
fake clock: stacks collected once, then the job ended as a hang; a node cut off is lost, never a
hang."""

from __future__ import annotations

import pytest

from ptcluster.cluster import parse_cluster_text
from ptcluster.launch.options import RunOptions
from ptcluster.launch.plan import Target, plan_launch
from ptcluster.launch.supervise import events as ev
from ptcluster.launch.supervise.actions import CollectStacks, Send, SignalChannel
from ptcluster.launch.supervise.hang import HangWatch
from ptcluster.launch.supervise.supervisor import Supervisor
from ptcluster.node import wire


@pytest.mark.parametrize("reports, quiet, expect", [
    ({"a": ({0: 9.0, 1: 7.0}, 10.0), "b": ({2: 8.0}, 10.0)}, {}, 7.0),
    ({"a": ({0: 9.0, 1: 7.0}, 10.0)}, {}, None),  # node b never reported
    ({"a": ({0: 9.0}, 10.0), "b": ({2: 8.0}, 10.0)}, {}, None),  # rank 1 not reported
    ({"a": ({0: 9.0, 1: 7.0}, 10.0), "b": ({2: 8.0}, 6.0)}, {}, None),  # b's report is stale
    ({"a": ({0: 9.0, 1: 7.0}, 10.0), "b": ({2: 8.0}, 10.0)}, {"b": 4.0}, None),  # b silent
])
def test_hang_watch_needs_a_fresh_report_of_every_running_rank(reports, quiet, expect):
    watch = HangWatch(timeout=5.0, fresh=3.0)
    for host, (idle, at) in reports.items():
        watch.heartbeat(host, idle, at)
    assert watch.idle_for({0: "a", 1: "a", 2: "b"}, 10.5, quiet) == expect


CLUSTER = "nodes:\n  - {host: a, slots: 2}\n  - {host: b, slots: 1}\n"
WALL = 1_000_000.0


def running_supervisor(hang: float = 5.0) -> Supervisor:
    spec = parse_cluster_text(CLUSTER, "c.yaml")
    plan = plan_launch(spec, Target(script="t.py"), port=29500, job_id="J")
    sup = Supervisor(plan, RunOptions(hang_timeout=hang), now=0.0, wall_offset=WALL)
    for host in ("a", "b"):
        sup.on_event(ev.Hello(host, wire.VERSION, 10, WALL + 1.0), 1.0)
        sup.on_event(ev.Ready(host, {}), 1.0)
    for rank, host in ((0, "a"), (1, "a"), (2, "b")):
        sup.on_event(ev.RankStart(host, rank, 50 + rank, WALL + 1.5), 1.5)
    return sup


def beat(sup: Supervisor, t: float, idle: dict[str, dict[int, float]]) -> list:
    actions = []
    for host, ranks in idle.items():
        actions += sup.on_event(ev.Heartbeat(host, WALL + t, ranks), t)
    return actions + sup.on_tick(t, {h: 0.5 for h in ("a", "b") if h in idle})


def test_supervisor_collects_stacks_once_then_ends_the_job_as_a_hang() -> None:
    sup = running_supervisor()
    assert not [a for a in beat(sup, 5.0, {"a": {0: 3.0, 1: 4.0}, "b": {2: 3.0}})
                if isinstance(a, CollectStacks)]
    actions = beat(sup, 8.0, {"a": {0: 6.0, 1: 7.0}, "b": {2: 5.0}})
    assert [a for a in actions if isinstance(a, CollectStacks)] == [CollectStacks("hang")]
    assert not [a for a in beat(sup, 9.0, {"a": {0: 7.0, 1: 8.0}, "b": {2: 6.0}})
                if isinstance(a, CollectStacks)]  # once
    stop = sup.hang_reported("straggler rank 2 on b: in load_batch at data.py:40", 2, "b", 10.0,
                             named=(2,))
    assert sorted(a.host for a in stop if isinstance(a, Send) and a.kind == "stop") == ["a", "b"]
    (failure,) = sup.failures
    assert failure.kind == "hang" and failure.rank == 2 and failure.host == "b"
    assert failure.at == pytest.approx(WALL + 8.0 - 5.0)  # when the last progress was
    assert failure.code == "run.hung" and failure.problem.fields == {
        "timeout": "5", "headline": "straggler rank 2 on b: in load_batch at data.py:40"}
    # the teardown stops every rank; the closing table still says which one hung
    for rank, host in ((0, "a"), (1, "a"), (2, "b")):
        sup.on_event(ev.RankExit(host, rank, -15, WALL + 10.5, 9.0), 10.5)
    assert [r.status for r in sup.ranks] == ["stopped (job teardown)"] * 2 + \
        ["hung (named by the hang report)"]


def test_a_node_cut_off_is_lost_never_a_hang() -> None:
    """Node b's link is cut at t=5: its last report showed progress; node a's ranks then wait
    forever. No hang verdict; the silence rule makes b a lost node."""
    sup = running_supervisor(hang=2.0)
    beat(sup, 5.0, {"a": {0: 0.0, 1: 0.0}, "b": {2: 0.0}})
    seen = []
    for t in range(6, 30):
        for host, idle in (("a", {0: t - 5.0, 1: t - 5.0}),):
            seen += sup.on_event(ev.Heartbeat(host, WALL + t, idle), float(t))
        seen += sup.on_tick(float(t), {"a": 0.5, "b": t - 5.0})
    assert not [a for a in seen if isinstance(a, CollectStacks)]
    assert SignalChannel("b", 9) in seen
    (failure,) = sup.failures
    assert failure.kind == "lost" and failure.host == "b" and "node lost" in failure.message


def test_decode_heartbeat_progress_and_stacks_frames() -> None:
    hb = ev.decode("a", 'hb {"t": 5.0, "idle": {"0": 1.5, "3": 0.0}}')
    assert hb == ev.Heartbeat("a", 5.0, {0: 1.5, 3: 0.0})
    assert ev.decode("a", 'hb {"t": 5.0}') == ev.Heartbeat("a", 5.0, None)
    reply = ev.decode("a", 'stacks {"id": 2, "ranks": {"1": {"pid": 7, "text": "x"}}}')
    assert reply == ev.StacksReply("a", 2, {1: {"pid": 7, "text": "x"}})


def test_hang_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="hang_timeout"):
        RunOptions(hang_timeout=0)
