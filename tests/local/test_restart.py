"""Whole-job restarts (`run --max-restarts`): the rule as a pure function, then real local jobs.

The multi-node cases (a node's link cut, the master's node lost) are in
``tests/testbed/test_restart.py``.
"""

from __future__ import annotations

import json
import signal
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from ptcluster.launch.result import AttemptRecord, Failure, FailureKind
from ptcluster.launch.supervise.restart import RestartPolicy, decide, start_step
from tests.support.head import Head, only_run, rank_fields, run_head

HOSTS = ["a", "b", "c"]


def attempt(number: int, *, ok: bool = False, cause: tuple[str, str] | None = ("b", "rank"),
            hosts: list[str] | None = None, resumed: int | None = None,
            saved: int | None = None) -> AttemptRecord:
    failure = None if cause is None or ok else \
        Failure(host=cause[0], rank=None if cause[1] != "rank" else 1,
                kind=FailureKind(cause[1]),
                message="x")
    return AttemptRecord(number=number, hosts=hosts or HOSTS, world_size=3, master_port=1,
                         started_at=0.0, ok=ok, cause=failure, resumed_from=resumed,
                         checkpoint=saved)


def failures_of(a: AttemptRecord) -> list[Failure]:
    return [a.cause] if a.cause is not None else []


P = RestartPolicy(max_restarts=3, min_nodes=2)


@pytest.mark.parametrize(("policy", "attempts", "interrupted", "restart", "drop", "why"), [
    # success and stops are final
    (P, [attempt(0, ok=True)], False, False, (), ""),
    (P, [attempt(0)], True, False, (), "stopped by the user"),
    # no --max-restarts: a failure ends the job as before
    (RestartPolicy(), [attempt(0)], False, False, (), ""),
    # a script that reports nothing: plain restarts until none are left
    (P, [attempt(0)], False, True, (), "restart 1 of 3"),
    (P, [attempt(0), attempt(1, cause=("a", "rank")), attempt(2, cause=("c", "rank")),
         attempt(3, cause=("a", "rank"))], False, False, ("a",), "no restarts left (3 of 3"),
    # progress: saved a newer checkpoint than it started from -> restart
    (P, [attempt(0, resumed=0, saved=20)], False, True, (), "restart 1 of 3"),
    (P, [attempt(0, resumed=0, saved=20), attempt(1, resumed=20, saved=40, cause=("a", "rank"))],
     False, True, (), "restart 2 of 3"),
    # no progress -> give up (exit 3)
    (P, [attempt(0, resumed=0)], False, False, (), "no progress"),
    (P, [attempt(0, resumed=0, saved=20), attempt(1, resumed=20, saved=20, cause=("a", "rank"))],
     False, False, (), "no progress (attempt 1 saved no checkpoint after step 20)"),
    (P, [attempt(0, saved=20), attempt(1, cause=("c", "rank"))], False, False, (), "no progress"),
    # a lost node is dropped; its attempt is exempt from the no-progress rule
    (P, [attempt(0, cause=("c", "lost"), resumed=0)], False, True, ("c",),
     "restart 1 of 3 without c"),
    (P, [attempt(0, cause=("a", "start"))], False, True, ("a",), "without a"),
    # the same node caused two attempts: dropped
    (P, [attempt(0, saved=5), attempt(1, saved=9)], False, True, ("b",), "without b"),
    (RestartPolicy(max_restarts=3, min_nodes=3), [attempt(0, saved=5), attempt(1, saved=9)],
     False, True, (), "restart 2 of 3"),  # ...unless fewer than --min-nodes would remain
    # fewer than --min-nodes would remain
    (RestartPolicy(max_restarts=3, min_nodes=3), [attempt(0, cause=("c", "lost"))], False,
     False, ("c",), "only 2 node(s) would remain after dropping c (lost); --min-nodes is 3"),
])
def test_restart_rule(policy, attempts, interrupted, restart, drop, why) -> None:
    d = decide(policy, attempts, failures_of(attempts[-1]), interrupted)
    assert (d.restart, d.drop) == (restart, drop), d
    assert why in d.reason, d
    assert d.no_progress == ("no progress" in why)


def test_a_node_cut_off_at_the_stop_deadline_is_dropped() -> None:
    """Its ranks may still run (its guard has not noticed yet): the next attempt goes without."""
    d = decide(P, [attempt(0, cause=("b", "rank"))], [], False, cut_off=["c"])
    assert d.restart and d.drop == ("c",), d
    d = decide(RestartPolicy(max_restarts=3, min_nodes=3), [attempt(0)], [], False, ["c"])
    assert not d.restart and "c (lost)" in d.reason, d


@pytest.mark.parametrize(("policy", "ended_by", "stop", "why", "drop"), [
    # ended from outside (Slurm): stopped, never restarted; named only when restarts were asked
    (P, "scancel", False, "ended from outside: not restarted", ()),
    (None, "scancel", False, "", ()),
    # Ctrl-C after the attempt had ended: stopped, not restarted (what it would drop is kept)
    (P, "", True, "stopped by the user: not restarted", ("c",)),
])
def test_an_attempt_stopped_from_outside_or_after_it_ended_is_not_restarted(
        policy, ended_by, stop, why, drop) -> None:
    a = attempt(0, cause=("c", "lost"))
    d = decide(policy, [a], failures_of(a), False, ended_by=ended_by, stop_requested=stop)
    assert (d.restart, d.stopped, d.reason, d.drop) == (False, True, why, drop), d


def test_no_restarts_asked_for_is_no_decision_to_make() -> None:
    d = decide(None, [attempt(0)], [], True, stop_requested=True)
    assert (d.restart, d.reason, d.stopped) == (False, "", False), d


def test_start_step_is_what_the_attempt_resumed_from_else_the_last_checkpoint() -> None:
    assert start_step([attempt(0)]) is None
    assert start_step([attempt(0, saved=10), attempt(1)]) == 10
    assert start_step([attempt(0, saved=10), attempt(1, resumed=5)]) == 5


def test_policy_validates() -> None:
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError, match="min_nodes"):
        RestartPolicy(min_nodes=0)


def test_the_console_s_dropped_lines_are_in_the_summary(tmp_path) -> None:
    from ptcluster.cluster import parse_cluster_text
    from ptcluster.launch.plan import Target, plan_launch
    from ptcluster.launch.result import RunResult
    from ptcluster.launch.runner import Runner

    spec = parse_cluster_text("nodes:\n  - {host: a, slots: 1}\n", "c.yaml")
    plan = plan_launch(spec, Target(script="t.py"), port=29500, job_id="J")
    runner = Runner(plan, {}, tmp_path / "run", console_dropped=lambda: 7)

    class Done:  # (an attempt that ended well at once)
        def run(self, before, t0):
            record = AttemptRecord(number=0, hosts=["a"], world_size=1, master_port=29500,
                                   started_at=0.0, ok=True)
            return SimpleNamespace(killed_by="", cut_off=[]), RunResult(
                job_id="J", run_dir=tmp_path / "run", ranks=[], nodes=[], failures=[],
                interrupted=False, duration=1.0), record

    runner.new_attempt = Done  # type: ignore[method-assign]
    runner.logs.run_dir = tmp_path / "nowhere"  # (what the job wrote: no log could be made)
    runner.logs.rank_line(0, "a line")
    assert runner.run().console_dropped == 7
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["console_dropped"] == 7
    assert written["log_errors"] == ["rank0.log: No such file or directory (1 line(s) missing)"]


def test_a_torn_down_attempts_late_channel_close_is_not_the_next_attempts(tmp_path) -> None:
    # A channel SIGKILLed at the end of one attempt (a lost node, the stop deadline) reports its
    # close when it is gone, which may be after the next attempt started, on the same queue.
    from ptcluster.cluster import parse_cluster_text
    from ptcluster.launch.options import RunOptions
    from ptcluster.launch.plan import Target, plan_launch
    from ptcluster.launch.runner import Runner
    from ptcluster.launch.supervise import events as ev
    from ptcluster.launch.supervise.supervisor import Supervisor
    from ptcluster.node import wire

    spec = parse_cluster_text("nodes:\n  - {host: a, slots: 1}\n  - {host: b, slots: 1}\n",
                              "c.yaml")
    plan = plan_launch(spec, Target(script="t.py"), port=29500, job_id="J", attempt=2)
    runner = Runner(plan, {}, tmp_path / "run")  # attempt 2 runs
    sup = Supervisor(plan, RunOptions(), 0.0, wall_offset=0.0)
    for host in ("a", "b"):
        sup.on_event(ev.Hello(host, wire.VERSION, 10, 1.0), 1.0)
        sup.on_event(ev.Ready(host, {"interface": "lo", "interface_source": "x"}), 1.0)
    attempt = runner.new_attempt()
    attempt._handle(sup, 1, "a", ev.ChannelClosed("a", -9, ["killed"]))
    assert not sup.node("a").closed and not sup.failures
    attempt._handle(sup, 2, "a", ev.ChannelClosed("a", -9, ["killed"]))  # this attempt's: counts
    assert sup.node("a").closed and [f.kind for f in sup.failures] == ["lost"]



def test_a_log_that_cannot_be_written_loses_no_frame_after_it(tmp_path) -> None:
    """Rank 0's log cannot be opened (here: a directory in its place; at scale: no descriptors
    left): its output still reaches the console, and the exit status in the same batch is
    not lost (it used to be: the batch ended at the error, and the rank looked killed)."""
    from ptcluster.cluster import parse_cluster_text
    from ptcluster.launch.options import RunOptions
    from ptcluster.launch.plan import Target, plan_launch
    from ptcluster.launch.runner import Runner
    from ptcluster.launch.supervise import events as ev
    from ptcluster.launch.supervise.supervisor import Supervisor
    from ptcluster.node import wire

    spec = parse_cluster_text("nodes:\n  - {host: a, slots: 2}\n", "c.yaml")
    plan = plan_launch(spec, Target(script="t.py"), port=29500, job_id="J")
    run = tmp_path / "run"
    (run / "rank0.log").mkdir(parents=True)
    lines, notes = [], []
    runner = Runner(plan, {}, run, on_line=lambda h, r, text: lines.append((r, text)),
                    on_status=notes.append)
    sup = Supervisor(plan, RunOptions(), 0.0, wall_offset=0.0)
    sup.on_event(ev.Hello("a", wire.VERSION, 10, 1.0), 1.0)
    sup.on_event(ev.Ready("a", {"interface": "lo", "interface_source": "x"}), 1.0)
    batch = ["o 0 hello from 0", "o 1 hello from 1", "o 0 more from 0",
             wire.encode("rexit", {"rank": 0, "code": 0, "t": 2.0}).decode().strip(),
             wire.encode("rexit", {"rank": 1, "code": 0, "t": 2.0}).decode().strip()]
    runner.new_attempt()._handle(sup, 0, "a", batch)
    assert [sup.ranks[r].exit_code for r in (0, 1)] == [0, 0]
    assert lines == [(0, "hello from 0"), (1, "hello from 1"), (0, "more from 0")]
    runner.logs.flush()  # (what the loop does a few times a second)
    assert runner.logs.lost == {"rank0.log": 2} and runner.logs.tail(0) == ["hello from 0",
                                                                         "more from 0"]
    assert len(notes) == 1 and notes[0].startswith("cannot write rank0.log: ")
    runner.logs.close()
    assert (run / "rank1.log").read_text() == "hello from 1\n"



def test_a_sink_that_raises_costs_its_line_never_the_frames_after_it(tmp_path) -> None:
    from ptcluster.cluster import parse_cluster_text
    from ptcluster.launch.options import RunOptions
    from ptcluster.launch.plan import Target, plan_launch
    from ptcluster.launch.runner import Runner
    from ptcluster.launch.supervise import events as ev
    from ptcluster.launch.supervise.supervisor import Supervisor
    from ptcluster.node import wire

    def broken_sink(host: str, rank: int | None, text: str) -> None:
        raise RuntimeError("the console is gone")

    plan = plan_launch(parse_cluster_text("nodes:\n  - {host: a, slots: 1}\n", "c.yaml"),
                       Target(script="t.py"), port=29500, job_id="J")
    notes: list[str] = []
    runner = Runner(plan, {}, tmp_path / "run", on_line=broken_sink, on_status=notes.append)
    sup = Supervisor(plan, RunOptions(), 0.0, wall_offset=0.0)
    sup.on_event(ev.Hello("a", wire.VERSION, 10, 1.0), 1.0)
    sup.on_event(ev.Ready("a", {"interface": "lo", "interface_source": "x"}), 1.0)
    runner.new_attempt()._handle(sup, 0, "a", ["o 0 a line", "o 0 another",
                                 wire.encode("rexit", {"rank": 0, "code": 0, "t": 2.0})
                                 .decode().strip()])
    assert sup.ranks[0].exit_code == 0  # the exit after the failed lines arrived
    assert runner.logs.tail(0) == ["a line", "another"]
    assert notes == ["output could not be handled (the console is gone); the job goes on, but "
                     "its logs or console output may be incomplete"]  # (once per kind)


def test_the_notes_of_a_wait_s_retried_tries_are_held_by_every_part(tmp_path) -> None:
    """--wait: a try that is tried again says nothing (its notes are dropped, the first try's
    too), the last one's are shown once its ranks start; the stacks collector's notes are held
    too (it once kept the callback it was built with, and its notes escaped the hold)."""
    from types import SimpleNamespace

    from ptcluster.cluster import parse_cluster_text
    from ptcluster.launch.options import RunOptions
    from ptcluster.launch.plan import Target, plan_launch
    from ptcluster.launch.result import RunResult
    from ptcluster.launch.runner import Runner

    plan = plan_launch(parse_cluster_text("nodes:\n  - {host: a, slots: 1}\n", "c.yaml"),
                       Target(script="t.py"), port=29500, job_id="J")
    notes: list[str] = []
    runner = Runner(plan, {}, tmp_path / "run", on_status=notes.append,
                    options=RunOptions(wait=60.0, wait_poll=0.01))
    tries = iter([True, True, False])  # refused (busy) twice, then it runs

    class Try:
        def run(self, before, t0):
            busy = next(tries)
            runner.ctx.stacks.on_status("from the collector")
            runner.ctx.sinks.on_status("from the attempt")
            if not busy:  # its ranks start: what it held is shown then, and the rest as said
                runner.ctx.on_ranks_started()
                shown.append(list(notes))
                runner.ctx.sinks.on_status("after the start")
                shown.append(list(notes))
            failures = [Failure(host="a", rank=None, message="held by job X",
                                kind=FailureKind.BUSY)] if busy else []
            result = RunResult(job_id="J", run_dir=tmp_path, ranks=[], nodes=[],
                               failures=failures, interrupted=False, duration=0.0)
            record = AttemptRecord(number=0, hosts=["a"], world_size=1, master_port=29500,
                                   started_at=0.0, ok=not busy)
            return SimpleNamespace(killed_by="", cut_off=[]), result, record

    shown: list[list[str]] = []
    runner.new_attempt = Try  # type: ignore[method-assign]
    runner.run()
    # the two refused tries say nothing (their teardown's "stopping the job ... Fix: ... (run
    # --wait)" was once shown for the first, before the wait line); the wait is said once;
    # the third try's notes are shown when its ranks start, and from then on as they come
    waited = ["waiting (--wait, no queue): a: held by job X"]
    assert shown == [waited + ["from the collector", "from the attempt"],
                     waited + ["from the collector", "from the attempt", "after the start"]]
    assert notes == shown[-1]


def test_a_run_directory_s_files_are_named_by_its_layout(tmp_path) -> None:
    """The names users, scripts and the other commands read (README, `stacks`, `kill`): one
    RunDir names them, and the logs are written where it says."""
    from ptcluster.launch.runlogs import RunLogs
    from ptcluster.rundir import RunDir

    layout = RunDir(tmp_path)
    assert [p.name for p in (layout.rank_log(3), layout.plan_file(), layout.plan_file(2),
                             layout.summary, layout.control_socket,
                             *layout.stacks_report(RunDir.HANG_STACKS),
                             *layout.stacks_report(RunDir.stacks_stem(4, "120000")))] == [
        "rank3.log", "plan.json", "plan.2.json", "summary.json", "control.sock",
        "hang-stacks.txt", "hang-stacks.json", "stacks-120000-4.txt", "stacks-120000-4.json"]
    logs = RunLogs(tmp_path)
    logs.rank_line(3, "r")
    logs.node_line(1, "h", "n")
    logs.close()
    assert layout.rank_log(3).read_text() == "r\n"
    assert (tmp_path / RunDir.node_log_name(1, "h")).read_text() == "n\n"
    assert RunDir.node_log_name(1, "h") == "node1-h.log"


def test_the_logs_of_a_restart_go_on_in_the_same_files_after_a_banner(tmp_path) -> None:
    from ptcluster.launch.runlogs import RunLogs

    logs = RunLogs(tmp_path, max_open=1)  # (a pool of one: every file reopened in turn)
    for rank in (0, 1):
        logs.rank_line(rank, f"attempt 0, rank {rank}")
    logs.node_line(0, "a", "node line")
    logs.flush()
    logs.new_attempt("----- attempt 1: world size 2 -----")
    assert logs.tail(0) == [] and logs.node_tail("a") == []  # the summary's lines: this one's
    for rank in (0, 1):
        logs.rank_line(rank, f"attempt 1, rank {rank}")
        logs.rank_line(rank, "more")
    logs.close()
    assert (tmp_path / "rank1.log").read_text().splitlines() == [
        "attempt 0, rank 1", "----- attempt 1: world size 2 -----", "attempt 1, rank 1", "more"]
    assert logs.tail(1) == ["attempt 1, rank 1", "more"] and not logs.errors and not logs.lost


# -- real jobs on this machine -------------------------------------------------------------
KILLER = textwrap.dedent("""
    # The reference trainer, with rank KILL_RANK SIGKILLed at optimizer step KILL_STEP of the
    # first attempt (a real kill -9, in the middle of training).
    import os, signal, sys
    import torch
    from ptcluster.examples.mnist.train import run

    step, victim = int(sys.argv.pop(1)), sys.argv.pop(1)
    if os.environ["PTCLUSTER_ATTEMPT"] == "0" and os.environ["RANK"] == victim:
        count = [0]
        original = torch.optim.AdamW.step

        def counted(self, *a, **k):
            count[0] += 1
            if count[0] == step:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(self, *a, **k)

        torch.optim.AdamW.step = counted
    run()  # the trainer's own entry point, so it ends as `-m ptcluster.examples.mnist` does
""")
TRAIN = ["--dataset", "digits", "--no-download", "--epochs", "2", "--batch-size", "32",
         "--checkpoint-every-steps", "5"]
"""2 ranks: 22 steps per epoch (1438 samples, global batch 64), a checkpoint every 5 steps."""


def summary(runs: Path) -> dict:
    return only_run(runs)[1]


@pytest.mark.slow
def test_a_killed_rank_restarts_the_job_and_it_ends_as_if_uninterrupted(
        tmp_path, no_leftovers) -> None:
    (tmp_path / "killer.py").write_text(KILLER)
    code, head = run_head(["run", "--nproc", "2", "--run-dir", "clean", "-m",
                           "ptcluster.examples.mnist", "--checkpoint-dir", "ck-clean", *TRAIN],
                          cwd=tmp_path, timeout=240)
    no_leftovers.append(only_run(tmp_path / "clean")[0])
    assert code == 0, head.output()
    clean = rank_fields(head.lines)

    code, head = run_head(["run", "--nproc", "2", "--run-dir", "runs", "--max-restarts", "2",
                           "killer.py", "13", "1", "--checkpoint-dir", "ck", *TRAIN],
                          cwd=tmp_path, timeout=300)
    job_id, s = only_run(tmp_path / "runs")
    no_leftovers.append(job_id)
    assert code == 0, head.output()
    attempts = s["attempts"]
    assert [a["ok"] for a in attempts] == [False, True], \
        [(a["attempt"], a["cause"] and (a["cause"]["rank"], a["cause"]["message"]))
         for a in attempts]
    cause = attempts[0]["cause"]
    assert (cause["rank"], cause["host"], cause["kind"]) == (1, "localhost", "rank") and \
        "SIGKILL" in cause["message"]
    # Killed at step 13 of attempt 0 (global step 13): the checkpoint of step 10 is the newest.
    assert attempts[0]["checkpoint"] == 10 and attempts[1]["resumed_from"] == 10, attempts
    assert 13 - attempts[1]["resumed_from"] <= 5  # lost work <= --checkpoint-every-steps
    assert attempts[1]["downtime_s"] is not None and attempts[1]["downtime_s"] > 0
    assert attempts[1]["master_port"] != attempts[0]["master_port"]  # a fresh store
    ranks = rank_fields(head.lines)
    assert {r["start_step"] for r in ranks.values()} == {"10"}, ranks
    # The same parameters, bit for bit, as the run that was never interrupted.
    assert {r["params_sha256"] for r in ranks.values()} == \
        {r["params_sha256"] for r in clean.values()}, (ranks, clean)
    # both attempts on the one node, world size 2 (the restart's line is test_spares'),
    # and rank 1's log goes on after the second attempt's banner
    assert [(a["attempt"], a["hosts"], a["world_size"]) for a in attempts] == \
        [(0, ["localhost"], 2), (1, ["localhost"], 2)], attempts
    log = (tmp_path / "runs" / job_id / "rank1.log").read_text().splitlines()
    assert [line for line in log if line.startswith("-----")] == \
        ["----- attempt 1: world size 2 -----"]


ATTEMPTS = textwrap.dedent("""
    import os, sys
    import ptcluster
    print("attempt", os.environ["PTCLUSTER_ATTEMPT"], os.environ["TORCHELASTIC_RESTART_COUNT"],
          os.environ["TORCHELASTIC_MAX_RESTARTS"], flush=True)
    if len(sys.argv) > 1:
        ptcluster.resumed_from(0)  # a job that reports its progress...
    sys.exit(7)                    # ...and crashes at start
""")


@pytest.mark.slow
def test_a_script_that_never_reports_progress_gets_plain_restarts(tmp_path, no_leftovers) -> None:
    (tmp_path / "fail.py").write_text(ATTEMPTS)
    code, head = run_head(["run", "--nproc", "1", "--run-dir", "runs", "--max-restarts", "2",
                           "fail.py"], cwd=tmp_path, timeout=120)
    job_id, s = only_run(tmp_path / "runs")
    no_leftovers.append(job_id)
    assert code == 1, head.output()
    seen = [line.split("] ", 1)[1] for line in head.lines if "] attempt " in line]
    assert seen == ["attempt 0 0 2", "attempt 1 1 2", "attempt 2 2 2"], head.output()
    assert [a["attempt"] for a in s["attempts"]] == [0, 1, 2]
    assert (s["gave_up_code"], s["gave_up_fields"]) == ("run.no-restarts-left", {
        "used": "2", "most": "2"}) and not s["no_progress"]
    assert s["gave_up"] in "\n".join(head.err)  # the console says what summary.json says


@pytest.mark.slow
def test_a_script_that_crashes_at_start_gives_up_with_no_progress(tmp_path,
                                                                  no_leftovers) -> None:
    (tmp_path / "fail.py").write_text(ATTEMPTS)
    code, head = run_head(["run", "--nproc", "1", "--run-dir", "runs", "--max-restarts", "3",
                           "fail.py", "report"], cwd=tmp_path, timeout=120)
    job_id, s = only_run(tmp_path / "runs")
    no_leftovers.append(job_id)
    assert code == 3, head.output()
    assert len(s["attempts"]) == 1 and s["no_progress"], s
    assert (s["gave_up_code"], s["gave_up_fields"]) == ("run.no-progress", {
        "attempt": "0", "since": "after step 0"}), s
    assert s["attempts"][0]["resumed_from"] == 0 and s["attempts"][0]["checkpoint"] is None
    err = "\n".join(head.err)
    assert s["gave_up"] in err and s["root_cause"]["rank"] == 0, err
    assert f"rank 0 on localhost: {s['root_cause']['message']}" in err, err


@pytest.mark.slow
def test_a_job_ended_from_outside_is_stopped_not_failed_and_not_restarted(tmp_path,
                                                                          no_leftovers) -> None:
    """What Slurm's scancel does to an allocation, through the runner's ``ended_by`` (the real
    scancel is in test_slurm.py): asked once, after the failed attempt."""
    from ptcluster.cluster import local_cluster
    from ptcluster.launch.api import prepare
    from ptcluster.launch.plan import Target
    from ptcluster.launch.runner import Restarts, Runner
    from ptcluster.remote.connect import transports

    (tmp_path / "fail.py").write_text(ATTEMPTS)
    spec = local_cluster(1)
    target = Target(script=str(tmp_path / "fail.py"))
    plan = prepare(spec, target, max_restarts=3)
    no_leftovers.append(plan.job_id)
    asked: list[int] = []

    def ended_by() -> str:
        asked.append(1)
        return "the scheduler ended it"

    result = Runner(plan, transports(spec), tmp_path / "run",
                    restarts=Restarts(RestartPolicy(max_restarts=3), spec, target),
                    ended_by=ended_by).run()
    assert asked == [1] and len(result.attempts) == 1, result.attempts
    assert result.interrupted and not result.ok and result.ended_by == "the scheduler ended it"
    assert result.gave_up == "ended from outside: not restarted"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["ended_by"] == "the scheduler ended it"


SLOW_FAIL = textwrap.dedent("""
    import os, sys, time
    print("started", os.environ["PTCLUSTER_ATTEMPT"], flush=True)
    if os.environ["RANK"] == "1":
        sys.exit(3)
    time.sleep(60)
""")


@pytest.mark.slow
def test_ctrl_c_during_a_restart_stops_everything(tmp_path, no_leftovers) -> None:
    (tmp_path / "job.py").write_text(SLOW_FAIL)
    head = Head(["run", "--nproc", "2", "--run-dir", "runs", "--max-restarts", "5", "job.py"],
                cwd=tmp_path)
    try:
        head.wait_for("started 1", timeout=60)  # the restart is under way
        head.signal(signal.SIGINT)
        code = head.wait(timeout=60)
    finally:
        if head.proc.poll() is None:
            head.kill()
    job_id, s = only_run(tmp_path / "runs")
    no_leftovers.append(job_id)
    assert code == 130, head.output()
    assert s["interrupted"] and len(s["attempts"]) <= 3, json.dumps(s)[:2000]


HANGS_ONCE = textwrap.dedent("""
    import os, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    if os.environ["PTCLUSTER_ATTEMPT"] == "0" and dist.get_rank() == 1:
        time.sleep(600)  # the straggler: the others wait in the all_reduce
    t = torch.ones(1)
    dist.all_reduce(t)
    print("sum", int(t.item()), flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_a_hang_is_reported_then_the_job_restarts(tmp_path, no_leftovers) -> None:
    (tmp_path / "job.py").write_text(HANGS_ONCE)
    code, head = run_head(["run", "--nproc", "2", "--run-dir", "runs", "--max-restarts", "1",
                           "--hang-timeout", "3", "job.py"], cwd=tmp_path, timeout=120)
    job_id, s = only_run(tmp_path / "runs")
    no_leftovers.append(job_id)
    assert code == 0, head.output()
    first, second = s["attempts"]
    assert first["cause"]["kind"] == "hang" and first["cause"]["rank"] == 1, first
    assert second["ok"] and [line for line in head.lines if "sum 2" in line], head.output()
    assert (tmp_path / "runs" / job_id / "hang-stacks.txt").exists()
