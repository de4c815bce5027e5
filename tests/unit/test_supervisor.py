"""The runner's decisions without processes: the supervisor state machine on a fake clock,
and the frame decoder on recorded frames."""

from __future__ import annotations

import json
import signal

import pytest

from ptcluster.cluster import parse_cluster_text
from ptcluster.errors import Problem
from ptcluster.launch.options import RunOptions
from ptcluster.launch.plan import Target, plan_launch
from ptcluster.launch.result import Failure, FailureKind
from ptcluster.launch.supervise import events as ev
from ptcluster.launch.supervise.actions import DeliverData, NodeLine, StacksAnswered
from ptcluster.launch.supervise.states import Escalation, NodeState
from ptcluster.launch.supervise.supervisor import Phase, Send, SignalChannel, Status, Supervisor
from ptcluster.launch.supervise.verdict import ready_notes
from ptcluster.node import wire

CLUSTER = "nodes:\n  - {host: a, slots: 2}\n  - {host: b, slots: 1}\n"
WALL = 1_000_000.0  # head wall clock at monotonic 0


def make(**opts: float) -> Supervisor:
    spec = parse_cluster_text(CLUSTER, "c.yaml")
    plan = plan_launch(spec, Target(script="t.py"), port=29500, job_id="J")
    return Supervisor(plan, RunOptions(**opts), now=0.0, wall_offset=WALL)


def start(sup: Supervisor, offsets: dict[str, float] | None = None) -> list:
    """Both guards say hello (node clock = head clock + offset) and ready at t=1."""
    actions = []
    for host in ("a", "b"):
        off = (offsets or {}).get(host, 0.0)
        actions += sup.on_event(ev.Hello(host, wire.VERSION, 10, WALL + 1.0 + off), 1.0)
        actions += sup.on_event(ev.Ready(host, {"interface": "eth0",
                                                "interface_source": "route to the master"}), 1.0)
    return actions


def sends(actions: list, kind: str) -> list[str]:
    return [a.host for a in actions if isinstance(a, Send) and a.kind == kind]


def test_go_only_when_every_node_is_ready() -> None:
    sup = make()
    sup.on_event(ev.Hello("a", wire.VERSION, 1, WALL), 0.5)
    assert sends(sup.on_event(ev.Ready("a", {}), 0.5), "go") == []
    actions = sup.on_event(ev.Ready("b", {}), 0.6)
    assert sorted(sends(actions, "go")) == ["a", "b"] and sup.phase is Phase.RUNNING


def test_root_cause_is_the_earliest_failure_not_the_first_to_arrive() -> None:
    """Rank 2 (node b) failed first; rank 0's "connection reset" reaches the head first. Node
    b's clock runs 5 s ahead: its times are corrected by the offset measured at hello."""
    sup = make()
    start(sup, offsets={"b": 5.0})
    first = sup.on_event(ev.RankExit("a", 0, 1, WALL + 10.2, 9.0), 10.3)
    assert sorted(sends(first, "stop")) == ["a", "b"]  # the first news stops the job
    sup.on_event(ev.RankExit("b", 2, 3, WALL + 10.0 + 5.0, 9.0), 11.0)  # arrives later
    failures = sup.failures
    assert [(f.rank, f.exit_code) for f in failures] == [(2, 3), (0, 1)]
    assert failures[0].at == pytest.approx(WALL + 10.0)


def test_exit_after_the_stop_is_teardown_not_a_failure() -> None:
    sup = make()
    start(sup)
    sup.on_event(ev.RankExit("a", 0, 3, WALL + 5.0, 4.0), 5.1)
    sup.on_event(ev.RankExit("a", 1, -15, WALL + 5.5, 4.5), 5.6)
    assert [f.rank for f in sup.failures] == [0]
    assert sup.ranks[1].status == "stopped (job teardown)"
    assert sup.ranks[0].status == "exit 3"


def test_os_exit_0_is_success_and_a_signal_is_named() -> None:
    sup = make()
    start(sup)
    sup.on_event(ev.RankExit("a", 0, 0, WALL + 2.0, 1.0), 2.0)  # the shim saw exit status 0
    assert sup.ranks[0].status == "ok" and not sup.failures
    sup.on_event(ev.RankExit("a", 1, -signal.SIGKILL, WALL + 3.0, 1.0), 3.0)
    assert sup.failures[0].message == "killed by SIGKILL"


@pytest.mark.parametrize("returned_first", [True, False])
def test_a_death_after_the_program_returned_is_named_in_either_order(returned_first) -> None:
    sup = make()
    start(sup)
    returned = ev.RankData("a", 1, {"kind": "returned", "t": WALL + 2.0})
    died = ev.RankExit("a", 1, -signal.SIGABRT, WALL + 2.1, 1.0)
    for e in (returned, died) if returned_first else (died, returned):
        sup.on_event(e, 2.2)
    (f,) = sup.failures
    assert f.message == ("killed by SIGABRT after its program had returned, in the "
                         "interpreter's shutdown")
    assert f.fix is not None and "PR 179291" in f.fix


def test_a_kill_after_the_program_returned_is_not_blamed_on_its_shutdown() -> None:
    sup = make()
    start(sup)
    sup.on_event(ev.RankData("a", 1, {"kind": "returned", "t": WALL + 2.0}), 2.0)
    sup.on_event(ev.RankExit("a", 1, -signal.SIGKILL, WALL + 2.1, 1.0), 2.2)
    (f,) = sup.failures
    assert f.message == "killed by SIGKILL" and f.fix is None  # the OOM killer, say


def test_guard_exit_0_means_every_started_rank_on_it_succeeded() -> None:
    sup = make()
    start(sup)
    sup.on_event(ev.RankStart("b", 2, 99, WALL + 1.5), 1.5)
    sup.on_event(ev.GuardExit("b", 0, "job ended"), 4.0)
    assert sup.ranks[2].exit_code == 0 and not sup.failures


def test_torchrun_failure_without_a_rank_failure_is_reported() -> None:
    sup = make()
    start(sup)
    actions = sup.on_event(ev.GuardExit("b", 1, "job ended"), 4.0)
    assert sup.failures[0].code == "run.torchrun-exited"
    assert sup.failures[0].problem.fields == {"code": "1", "error": "job ended"}
    assert sends(actions, "stop") == ["a", "b"]


def test_only_the_users_stop_tells_the_guards_that_no_attempt_follows() -> None:
    """``final``: a guard ends the job's warm pool at once rather than keep it for a restart."""
    failed, stopped = make(), make()
    start(failed)
    start(stopped)
    after_failure = failed.on_event(ev.GuardExit("b", 1, "job ended"), 4.0)
    by_user = stopped.request_stop("SIGINT received", 2.0)
    told = [a.payload for a in after_failure if isinstance(a, Send) and a.kind == "stop"]
    assert len(told) == 2 and not any("final" in payload for payload in told)
    assert [a.payload.get("final") for a in by_user if isinstance(a, Send)] == [True, True]
    # (the runner ends the pools that guards said they kept: Runner._end_kept_pools)
    again = failed.request_stop("SIGINT received", 5.0)  # (already stopping: no final reaches
    assert not [a for a in again if isinstance(a, Send) and a.kind == "stop"]  # them)


def test_escalation_takes_each_step_once_per_node_and_says_so() -> None:
    sup = make(stop_deadline=8.0)
    start(sup)
    sup.request_stop("SIGINT received", 2.0)
    assert sup.interrupted and not sup.failures
    sup.on_event(ev.GuardExit("a", -15, "stopped by the head"), 3.0)
    sup.on_event(ev.ChannelClosed("a", 0), 3.0)
    all_actions = []
    for t in (5.0, 6.5, 7.0, 10.5, 11.0, 14.5, 15.0, 20.0):
        all_actions += sup.on_tick(t, {"a": 0.0, "b": 0.0})
    assert sends(all_actions, "stop") == ["b"]  # resent once, only to the node still running
    signals = [(a.host, a.sig) for a in all_actions if isinstance(a, SignalChannel)]
    assert signals == [("b", signal.SIGTERM), ("b", signal.SIGKILL)]
    notes = [a.text for a in all_actions if isinstance(a, Status)]
    assert len(notes) == 3 and all(n.startswith("b: ") for n in notes)
    assert sup.node("b").escalations and sup.done


def test_silent_node_is_lost_as_of_when_it_was_last_heard() -> None:
    sup = make(node_silence=20.0)
    start(sup)
    actions = sup.on_tick(30.0, {"a": 0.5, "b": 21.0})
    assert SignalChannel("b", signal.SIGKILL) in actions
    (failure,) = sup.failures
    assert failure.host == "b" and failure.at == pytest.approx(WALL + 9.0)
    # A peer that fails later (its collective timed out) does not become the root cause.
    sup.on_event(ev.RankExit("a", 0, 1, WALL + 25.0, 24.0), 30.1)
    assert sup.failures[0].host == "b"


def test_ready_timeout_names_the_slow_node() -> None:
    sup = make(ready_timeout=10.0)
    sup.on_event(ev.Ready("a", {}), 1.0)
    sup.on_tick(11.0, {})
    assert sup.failures[0].host == "b" and sup.failures[0].code == "run.not-ready"
    assert sup.failures[0].problem.fields == {"timeout": "10"}


def test_deadline_names_the_ranks_still_running() -> None:
    sup = make(deadline=60.0)
    start(sup)
    sup.on_event(ev.RankExit("a", 0, 0, WALL + 5.0, 4.0), 5.0)
    sup.on_tick(62.0, {"a": 0.1, "b": 0.1})
    (failure,) = sup.failures
    assert failure.host == "a, b" and failure.code == "run.timed-out"
    assert failure.problem.fields == {"deadline": "60", "ranks": "1, 2"}


def test_lost_channel_before_ready_is_explained() -> None:
    """The connector explains its channel's end (the runner puts it in the event); the
    supervisor, pure, only words the failure."""
    from ptcluster.remote.transport import explain_channel_failure

    err = ["root@b: Permission denied (publickey)."]
    sup = make()
    sup.on_event(ev.ChannelClosed("b", 255, err,
                                  cause=explain_channel_failure(err, 255, "python3")), 1.0)
    (failure,) = sup.failures
    assert (failure.code, failure.problem.fields) == ("node.ssh-key-refused", {"detail": err[0]})
    assert failure.message.startswith("cannot start the job: ") and failure.fix
    sup = make()
    sup.on_event(ev.ChannelClosed("b", 255, err), 1.0)
    (failure,) = sup.failures
    assert failure.message == f"cannot start the job: {err[0]}" and failure.fix


def test_protocol_version_mismatch_is_refused() -> None:
    sup = make()
    sup.on_event(ev.Hello("a", wire.VERSION + 1, 1, WALL), 0.1)
    assert "protocol" in sup.failures[0].message and sup.phase is Phase.STOPPING


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="stop_deadline"):
        RunOptions(stop_deadline=0)
    with pytest.raises(ValueError, match="heartbeat"):
        RunOptions(guard_heartbeat_timeout=1.0, heartbeat_interval=1.0)


@pytest.mark.parametrize("line, expected", [
    ("o 3 hello world", ev.RankOutput("n", 3, "out", "hello world")),
    ("e 0 Traceback (most recent call last):", ev.RankOutput("n", 0, "err",
                                                             "Traceback (most recent call last):")),
    ("o 1 ", ev.RankOutput("n", 1, "out", "")),
    ("o 2 rexit {\"rank\": 0}", ev.RankOutput("n", 2, "out", "rexit {\"rank\": 0}")),
    ("a [default0]:W torchrun says", ev.AgentOutput("n", "[default0]:W torchrun says")),
    ('rexit {"rank":2,"code":-9,"t":5.5,"duration":1.25}', ev.RankExit("n", 2, -9, 5.5, 1.25)),
    ('rexit {"rank":2,"code":null,"t":5.5}', ev.RankExit("n", 2, None, 5.5, None)),
    ('rstart {"rank":1,"pid":42,"t":3.0,"local_rank":0}', ev.RankStart("n", 1, 42, 3.0)),
    ('rdata {"rank":0,"kind":"row","x":1}', ev.RankData("n", 0, {"kind": "row", "x": 1})),
    ('hello {"v":2,"program":"guard","pid":7,"time":1.5}', ev.Hello("n", 2, 7, 1.5)),
    ('error {"problem":"p","fix":"f"}', ev.GuardRefused("n", Problem("n", "p", "f"))),
    ('error {"problem":"p","fix":"f","environment":"missing"}',
     ev.GuardRefused("n", Problem("n", "p", "f"), environment="missing")),
    ('error {"problem":"p","fix":"f","environment":""}', ev.GuardRefused("n", Problem("n", "p",
                                                                                     "f"))),
    ('exit {"code":0,"reason":"job ended"}', ev.GuardExit("n", 0, "job ended")),
    ("hb {}", ev.Heartbeat("n")),
    ("hb", ev.Heartbeat("n")),
    ('hb {"t":7.5}', ev.Heartbeat("n", 7.5)),
    ('rerror {"rank":1,"t":4.0,"text":"RuntimeError: x"}', ev.RankError("n", 1, 4.0,
                                                                      "RuntimeError: x")),
    ('stopping {"reason":"the guard got SIGTERM","t":9.0,"signal":"SIGTERM"}',
     ev.GuardStopping("n", "the guard got SIGTERM", 9.0, "SIGTERM")),
    ('stopping {"reason":"no heartbeat","t":9.0}', ev.GuardStopping("n", "no heartbeat", 9.0)),
])
def test_decode_recorded_frames(line: str, expected: ev.Event) -> None:
    assert ev.decode("n", line) == expected


@pytest.mark.parametrize("line", ["o x text", "rexit {not json", 'rexit {"code": 1}', "zz {}",
                                  "exit []", "\x1ePTCG ready {}",
                                  'error {"problem":"p","environment":"gone"}',
                                  'error {"problem":"p","environment":1}'])
def test_bad_frames_become_malformed_never_an_exception(line: str) -> None:
    assert isinstance(ev.decode("n", line), ev.Malformed)


def test_wire_round_trip() -> None:
    frame = wire.encode("ready", {"interface": "eth0", "text": "a b\tc"})
    kind, payload = wire.split(frame.decode().rstrip("\n"))
    assert kind == "ready" and wire.control(payload)["text"] == "a b\tc"
    assert wire.encode_text("o", 3, b"x y") == b"o 3 x y\n"
    assert wire.encode_text("a", None, b"z") == b"a z\n"


def test_a_rank_that_raised_before_the_stop_failed_then_not_when_it_was_killed() -> None:
    """Rank 0 raises at t=5 but hangs in its cleanup; its peer times out (exit 1 at t=8); the
    teardown kills rank 0 at t=9. The root cause is rank 0's exception, with its text."""
    sup = make()
    start(sup)
    sup.on_event(ev.RankError("a", 0, WALL + 5.0, "RuntimeError: boom"), 5.1)
    sup.on_event(ev.RankExit("b", 2, 1, WALL + 8.0, 7.0), 8.1)  # starts the teardown
    sup.on_event(ev.RankExit("a", 0, -15, WALL + 9.0, 8.0), 9.1)  # ended by the teardown
    first = sup.failures[0]
    assert first.rank == 0 and first.at == pytest.approx(WALL + 5.0)
    assert first.message == ("RuntimeError: boom, then it hung until the teardown ended it "
                             "(killed by SIGTERM)")
    assert (first.exit_code, first.facts) == (-15, {"hung_after": "RuntimeError: boom"})
    assert sup.ranks[0].status == "killed by SIGTERM"


def test_a_rank_that_exited_on_its_own_just_after_the_stop_did_not_hang() -> None:
    """Both ranks' argparse ends them at once (exit 2); rank 0's report is stamped first, but
    rank 2's exit arrives first and starts the teardown. Rank 0 exited with its own code after
    the stop: not a hang (seen in a doc block's run: "SystemExit: 2, then it hung until the
    teardown ended it (exited with code 2)")."""
    usage = "the following arguments are required: --local_rank"
    sup = make()
    start(sup)
    sup.on_event(ev.RankError("a", 0, WALL + 5.0, "SystemExit: 2", exc="SystemExit",
                              usage=usage), 5.3)
    sup.on_event(ev.RankError("b", 2, WALL + 5.01, "SystemExit: 2", exc="SystemExit",
                              usage=usage), 5.1)
    sup.on_event(ev.RankExit("b", 2, 2, WALL + 5.02, 0.1), 5.1)  # starts the teardown
    sup.on_event(ev.RankExit("a", 0, 2, WALL + 5.2, 0.1), 5.3)  # after the stop (5.1)
    first = sup.failures[0]
    assert first.rank == 0 and first.at == pytest.approx(WALL + 5.0)
    assert first.message == f"exited with code 2 (argparse: {usage})"


def test_the_error_report_may_come_after_the_exit() -> None:
    sup = make()
    start(sup)
    sup.on_event(ev.RankExit("a", 1, 1, WALL + 6.0, 5.0), 6.1)
    sup.on_event(ev.RankError("a", 1, WALL + 5.5, "ValueError: late news"), 6.2)
    (failure,) = sup.failures
    assert failure.at == pytest.approx(WALL + 5.5)
    assert failure.message == "exited with code 1 (ValueError: late news)"


def test_guard_that_stops_on_its_own_is_the_cause() -> None:
    sup = make()
    start(sup)
    actions = sup.on_event(ev.GuardStopping("b", "no heartbeat from the head for 15 s",
                                            WALL + 20.0), 20.5)
    assert sends(actions, "stop") == ["a"]  # b is already stopping
    sup.on_event(ev.RankExit("b", 2, -15, WALL + 21.0, 20.0), 21.1)
    (failure,) = sup.failures
    assert failure.host == "b" and failure.code == "run.guard-stopped"
    assert failure.problem.fields == {"reason": "no heartbeat from the head for 15 s"}
    assert sup.ranks[2].status == "stopped (job teardown)"


def test_a_guard_that_was_signalled_is_not_blamed_on_the_network() -> None:
    sup = make()
    start(sup)
    sup.on_event(ev.GuardStopping("b", "the guard got SIGTERM", WALL + 20.0, "SIGTERM"), 20.5)
    (failure,) = sup.failures
    assert failure.message == "its guard ended the job on its own: the guard got SIGTERM"
    assert failure.code == "run.guard-signalled" and "network" not in str(failure.fix)


def test_second_interrupt_cuts_the_channels_at_once() -> None:
    sup = make()
    start(sup)
    sup.request_stop("SIGINT received", 2.0)
    actions = sup.request_stop("SIGINT received", 2.5)
    signals = sorted((a.host, a.sig) for a in actions if isinstance(a, SignalChannel))
    assert signals == [("a", signal.SIGTERM), ("b", signal.SIGTERM)]
    assert sup.request_stop("SIGINT received", 2.6) == []  # once is enough
    later = sup.on_tick(7.0, {"a": 0.0, "b": 0.0}) + sup.on_tick(11.0, {"a": 0.0, "b": 0.0})
    assert not any(isinstance(a, SignalChannel) and a.sig == signal.SIGTERM for a in later)


def test_first_interrupt_while_a_failure_is_torn_down_is_noted_not_hurried() -> None:
    sup = make()
    start(sup)
    sup.on_event(ev.RankExit("a", 0, 3, WALL + 5.0, 4.0), 5.1)  # a failure stops the job
    actions = sup.request_stop("SIGINT received", 5.2)
    assert sup.interrupted and not any(isinstance(a, SignalChannel) for a in actions)
    assert [a.text for a in actions if isinstance(a, Status)] == [
        "SIGINT received: the job is already being stopped everywhere"]
    again = sup.request_stop("SIGINT received", 5.3)  # the second one hurries
    assert sorted(a.host for a in again if isinstance(a, SignalChannel)) == ["a", "b"]


def test_heartbeats_refine_the_clock_offset() -> None:
    sup = make()
    sup.on_event(ev.Hello("a", wire.VERSION, 1, WALL + 3.0), 1.0)  # arrived 1 s late: 2.0
    assert sup.node("a").clock_offset == pytest.approx(2.0)
    sup.on_event(ev.Heartbeat("a", WALL + 13.0), 10.2)  # arrived 0.2 s late: 2.8
    sup.on_event(ev.Heartbeat("a", WALL + 14.0), 12.0)  # arrived 1 s late
    assert sup.node("a").clock_offset == pytest.approx(2.8)


@pytest.mark.parametrize("facts_b, what", [
    ({"address": "10.0.0.2", "hostname": "b"}, "address"),
    ({"address": "10.0.0.7", "hostname": "10.0.0.2"}, "hostname"),
    ({"address": "10.0.0.7", "hostname": "b"}, None),  # node a's own address, presumably
])
def test_a_rendezvous_address_of_another_node_fails_before_any_rank_starts(facts_b,
                                                                           what) -> None:
    spec = parse_cluster_text(CLUSTER + "master: {addr: 10.0.0.2}\n", "c.yaml")
    sup = Supervisor(plan_launch(spec, Target(script="t.py"), port=29500, job_id="J"),
                     RunOptions(), now=0.0, wall_offset=WALL)
    actions = []
    for host, facts in (("a", {"address": "10.0.0.1", "hostname": "a"}), ("b", facts_b)):
        actions += sup.on_event(ev.Hello(host, wire.VERSION, 10, WALL + 1.0), 1.0)
        actions += sup.on_event(ev.Ready(host, facts), 1.0)
    if what is None:
        assert sends(actions, "go") == ["a", "b"] and not sup.failures
        return
    assert sends(actions, "go") == [] and sends(actions, "stop") == ["a", "b"]
    (f,) = sup.failures
    assert f.host == "a" and f.code == "run.master-elsewhere", f
    assert f.problem.fields == {"addr": "10.0.0.2", "node": "b", "what": what, "first": "a"}


def test_failure_kinds_are_an_enum_shown_as_their_names_in_json() -> None:
    sup = make()
    start(sup)
    sup.on_event(ev.GuardExit("b", 1, "job ended"), 4.0)
    (failure,) = sup.failures
    assert failure.kind is FailureKind.NODE and failure.kind == "node"
    assert json.loads(json.dumps({"kind": failure.kind})) == {"kind": "node"}
    named = Failure(host="a", rank=None, message="x", kind="lost")  # type: ignore[arg-type]
    assert named.kind is FailureKind.LOST
    with pytest.raises(ValueError):
        Failure(host="a", rank=None, message="x", kind="gone")  # type: ignore[arg-type]


def test_each_node_goes_through_its_states_and_is_stopped_or_lost() -> None:
    sup = make(node_silence=20.0)
    states = lambda: {h: sup.node_life(h).state for h in ("a", "b")}  # noqa: E731
    assert states() == {"a": NodeState.STARTING, "b": NodeState.STARTING}
    sup.on_event(ev.Ready("a", {}), 0.5)
    assert states() == {"a": NodeState.READY, "b": NodeState.STARTING}
    assert sup.node("a").ready and not sup.node("b").ready
    sup.on_event(ev.Ready("b", {}), 0.6)
    assert states() == {"a": NodeState.RUNNING, "b": NodeState.RUNNING}
    assert sup.askable == ["a", "b"]
    sup.on_tick(30.0, {"a": 0.5, "b": 21.0})  # b falls silent: lost, a is told to stop
    assert states() == {"a": NodeState.STOPPING, "b": NodeState.LOST}
    assert sup.node("b").closed and not sup.node("a").closed and sup.askable == []
    assert sup.node_life("a").stop_at == pytest.approx(WALL + 30.0)
    sup.on_event(ev.ChannelClosed("b", -9), 30.5)  # a final state is never left
    sup.on_event(ev.ChannelClosed("a", 0), 31.0)
    assert states() == {"a": NodeState.STOPPED, "b": NodeState.LOST} and sup.done
    assert sup.cut_off == []  # lost by silence (a failure of its own), not cut at the deadline


def test_escalation_steps_are_recorded_with_when_they_were_taken() -> None:
    sup = make(stop_deadline=8.0)
    start(sup)
    sup.request_stop("SIGINT received", 2.0)
    for t in (6.5, 10.5, 14.5):
        sup.on_tick(t, {"a": 0.0, "b": 0.0})
    assert sup.node_life("a").steps == {Escalation.RESEND: 6.5, Escalation.TERM: 10.5,
                                   Escalation.KILL: 14.5}
    assert sup.node_life("a").state is NodeState.LOST and sup.cut_off == ["a", "b"] and sup.done


def test_a_second_stop_request_counts_the_steps_up_to_sigterm_as_taken() -> None:
    sup = make(stop_deadline=8.0)
    start(sup)
    sup.request_stop("SIGINT received", 2.0)
    sup.request_stop("SIGINT received", 2.5)
    assert sup.node_life("b").steps == {Escalation.RESEND: 2.5, Escalation.TERM: 2.5}
    assert sup.on_tick(11.0, {"a": 0.0, "b": 0.0}) == []
    kills = [a for a in sup.on_tick(14.5, {"a": 0.0, "b": 0.0}) if isinstance(a, SignalChannel)]
    assert kills == [SignalChannel("a", signal.SIGKILL), SignalChannel("b", signal.SIGKILL)]
    assert sup.node_life("b").steps[Escalation.KILL] == 14.5


def test_every_event_reaches_the_supervisor_and_comes_back_as_actions() -> None:
    """The runner has no dispatcher of its own: node lines, records for the caller's sink
    and stacks answers come out of ``on_event`` as actions."""
    sup = make()
    start(sup)
    reply = ev.StacksReply("b", 1, {2: {"pid": 7, "text": "x"}})
    got = [sup.on_event(e, 2.0) for e in (
        ev.AgentOutput("a", "torchrun says"), ev.Malformed("a", "zz {}", "unknown kind"),
        ev.RankOutput("a", 2, "out", "not a's rank"), ev.RankData("b", 2, {"kind": "row"}),
        ev.RankData("b", 2, {"kind": "checkpoint", "step": 5}), reply)]
    assert got == [[NodeLine("a", "torchrun says", show=True)],
                   [NodeLine("a", "zz {}", show=True)],
                   [NodeLine("a", "(rank 2?) not a's rank", show=True)],
                   [DeliverData("b", 2, {"kind": "row"})], [], [StacksAnswered(reply)]]
    assert sup.checkpoint == 5
    sup.request_stop("SIGINT received", 3.0)
    assert sup.on_event(ev.AgentOutput("a", "Traceback"), 3.1) == [
        NodeLine("a", "Traceback", show=False)]  # our own teardown: logged, not shown


def test_the_guards_timing_frames_name_the_straggler_once() -> None:
    """Ranks 0,1 on a wait for rank 2 on b: one Status line, in the summary's figures too;
    a rank the node does not have is ignored."""
    sup = make(straggler_threshold=1.5)
    start(sup)
    for rank, host in ((0, "a"), (1, "a"), (2, "b")):
        sup.on_event(ev.RankStart(host, rank, 90 + rank, WALL + 1.5), 1.5)
    said = []
    for i in range(8):
        now = 2.0 + 2.0 * i
        fast = {"span": 2.0, "run": 0.4, "delay": 0.1, "collectives": 50}
        sup.on_event(ev.Timing("a", {0: fast, 1: fast, 7: fast}, {}), now)
        sup.on_event(ev.Timing("b", {2: {"span": 2.0, "run": 0.6, "delay": 0.7,
                                         "collectives": 50}}, {"mem_available": 0.5}), now)
        said += [a.text for a in sup.on_tick(now, {}) if isinstance(a, Status)]
    assert len(said) == 1 and said[0].startswith("rank 2 on b is the straggler: "), said
    report = sup.straggler_figures()
    assert report["current"] is not None
    assert report["current"]["seen"] == pytest.approx({"cpu_starved": 0.35})
    assert [r["rank"] for r in report["ranks"]] == [0, 1, 2]
    assert report["history"][0]["line"] == said[0] and report["current"]["ranks"] == [2]
    current = report["current"]
    assert (current["others_wait_share"], current["wait_per_collective_s"]) == (0.75, 0.03)
    assert current["why"] in said[0] and current["ratio"] == pytest.approx(2.6)


@pytest.mark.parametrize("facts, notes", [
    ({"interface": "eth0", "interface_source": "cluster file"}, []),
    ({"interface": "eth1", "interface_source": "route to the master"},
     ["n: sockets on eth1 (route to the master)"]),
    ({"gpus": {"visible": "0,1", "why": "auto: the first 2 free"}},
     ["n: GPUs 0,1: auto: the first 2 free"]),
    ({"subreaper": False, "subreaper_error": "EPERM"},
     ["n: cannot become a subreaper (EPERM); orphans of the job may escape teardown"]),
    ({"subreaper": True, "leases_off": "run --no-leases: unsafe"},
     ["n: no leases (run --no-leases: unsafe)"]),
])
def test_ready_notes_say_what_the_ready_facts_call_for(facts: wire.ReadyFacts,
                                                       notes: list[str]) -> None:
    assert ready_notes("n", facts) == notes
    sup = make()
    said = [a.text for a in sup.on_event(ev.Ready("a", facts), 1.0) if isinstance(a, Status)]
    assert said == [n.replace("n: ", "a: ", 1) for n in notes]  # (the supervisor says them)


@pytest.mark.parametrize("pools, warm", [
    ({"a": True, "b": True}, True),
    ({"a": True, "b": False}, False),  # (b's ranks cold: a's too, or they never meet)
    ({"a": False, "b": False}, False),
    ({}, None),  # (no warm ranks asked for: the go says nothing of them)
])
def test_the_go_says_warm_only_where_every_node_has_a_pool(pools, warm) -> None:
    sup = make()
    actions = []
    for host in ("a", "b"):
        actions += sup.on_event(ev.Hello(host, wire.VERSION, 10, WALL + 1.0), 1.0)
        facts: wire.ReadyFacts = {"pool": pools[host]} if pools else {}
        actions += sup.on_event(ev.Ready(host, facts), 1.0)
    gos = [a for a in actions if isinstance(a, Send) and a.kind == "go"]
    assert [g.host for g in gos] == ["a", "b"]
    assert {(g.payload or {}).get("warm") for g in gos} == {warm}
    said = [a.text for a in actions if isinstance(a, Status) and "no warm pool" in a.text]
    assert len(said) == (1 if warm is False and any(pools.values()) else 0), said
    if said:
        assert said[0].startswith("every node's ranks start cold: b has no warm pool")


def test_after_a_pool_failed_at_its_fork_the_go_says_cold_though_every_node_has_one() -> None:
    sup = Supervisor(plan_launch(parse_cluster_text(CLUSTER, "c.yaml"), Target(script="t.py"),
                                 port=29500, job_id="J"),
                     RunOptions(pooled=False), now=0.0, wall_offset=WALL)
    actions = []
    for host in ("a", "b"):
        actions += sup.on_event(ev.Hello(host, wire.VERSION, 10, WALL + 1.0), 1.0)
        actions += sup.on_event(ev.Ready(host, {"pool": True}), 1.0)
    gos = [a for a in actions if isinstance(a, Send) and a.kind == "go"]
    assert [(g.host, (g.payload or {}).get("warm")) for g in gos] == [("a", False), ("b", False)]
