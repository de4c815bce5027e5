"""Runs a :class:`LaunchPlan`: one guard per node over a node channel, the supervisor decides.

Glue only: start a channel per node -> a bounded queue of what the channels bring -> frames
decoded into events (``events``) -> output to the logs and the ``on_line`` sink, everything else
to the :class:`Supervisor`, whose actions (send, signal a channel, tell the user) are applied
here -> a :class:`RunResult`, also written as ``summary.json``.

Control never waits on output: heartbeats go out from the channels' I/O thread, the sinks are
expected to be quick (the CLI's console is a bounded, dropping feed), and the loop takes a
bounded batch of events between its checks.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ptcluster.cluster.model import ClusterSpec
from ptcluster.control.protocol import ControlServer
from ptcluster.errors import PtclusterError
from ptcluster.launch.options import RunOptions
from ptcluster.launch.plan import LaunchPlan, Target, replan, restart_port
from ptcluster.launch.port import free_port
from ptcluster.launch.result import AttemptRecord, FailureKind, RunResult
from ptcluster.launch.rundir import RunDir, RunLogs, log_files_budget, write_private
from ptcluster.launch.stacks.collector import HANG, StackCollector
from ptcluster.launch.supervise import events as ev
from ptcluster.launch.supervise.actions import (
    Action,
    CollectStacks,
    DeliverData,
    NodeLine,
    Send,
    SignalChannel,
    StacksAnswered,
    Status,
)
from ptcluster.launch.supervise.restart import RestartPolicy, decide
from ptcluster.launch.supervise.states import Phase
from ptcluster.launch.supervise.supervisor import Supervisor
from ptcluster.launch.supervise.view import SupervisorView
from ptcluster.node import GUARD
from ptcluster.remote.channel import NodeChannel, close_all, start_all
from ptcluster.remote.transport import Transport, explain_channel_failure

log = logging.getLogger(__name__)

LineSink = Callable[[str, "int | None", str], None]
"""on_line(host, rank or None for the node's own lines, text)."""
DataSink = Callable[[str, int, dict[str, Any]], None]
"""on_data(host, rank, record) for structured records a rank program reports."""
ANY_ATTEMPT = -1
"""Queue tag of a request that is for whichever attempt runs (``ptcluster stacks``)."""
BATCH_SECONDS = 0.05
"""Longest stretch the loop spends on queued events before it looks at its timers."""
WAKE_SECONDS = 0.005
"""Shortest time between two wake-ups of the loop: what comes sooner waits for the next one
and is handled with it. At 1024 nodes the channels hand over ~2000 batches a second, and a
wake-up for each (a thread switch and the interpreter lock handed back and forth) cost more
than the batches; a few milliseconds more before a line is logged or a stop is sent cost
nothing."""
TICK_SECONDS = 0.2
"""How often the checks over every node run (silence, hang, the teardown's escalation)."""
FLUSH_SECONDS = 0.5
"""How often the logs are written (what a crash of the head could lose at most), on jobs of up
to ``LOG_WRITES_PER_SECOND`` / 2 ranks and nodes together (``flush_every``)."""
LOG_WRITES_PER_SECOND = 4096
"""Log-file writes a second the head allows itself in all: each one is a system call into a
different file (~10 us here), and 1024 nodes x 8 ranks that each print once a second would
otherwise cost 8192 of them a second. Larger jobs write their logs less often instead (1024 x 8:
every 2.25 s)."""
ASK_SECONDS = 4.0
"""How long the control socket waits for the loop's straggler figures (``monitor`` asks with a
5 s timeout of its own)."""
BACKLOG = 256
"""Batches waiting for the loop (<= 64 KiB each, so <= ~16 MiB) before the channels stop
reading: the nodes' output then waits in their pipes, and the job never waits for the head's
memory. They read again once the loop is down to half of it (not at the next batch: a hold
that lifted at 255 would hold again at once)."""


def flush_every(plan: LaunchPlan) -> float:
    """Seconds between two writes of the logs of ``plan`` (every rank's and every node's)."""
    return max(FLUSH_SECONDS, (plan.world_size + len(plan.nodes)) / LOG_WRITES_PER_SECOND)


@dataclass(frozen=True)
class _Ask:
    """From the control socket's thread: collect the stacks (``what`` "stacks") or take the
    straggler report's figures ("straggler") in the loop, and answer on ``reply`` (unless the
    asker gave up, at ``until``, monotonic clock)."""

    what: str
    reply: queue.Queue[dict[str, Any]]
    until: float


class RunDirError(PtclusterError):
    """The run directory cannot be created or written (checked before anything starts)."""


@dataclass(frozen=True)
class Restarts:
    """How a failed attempt is followed by another (``run --max-restarts``): ``policy`` says
    whether, ``plan.replan`` plans it (the same ``target`` on the nodes of ``spec`` that
    remain)."""

    policy: RestartPolicy
    spec: ClusterSpec
    target: Target

    def next_plan(self, first: LaunchPlan, attempt: int, hosts: tuple[str, ...],
                  addresses: dict[str, str]) -> LaunchPlan:
        """Attempt ``attempt`` on ``hosts`` (each node's address as its guard reported it): on
        the local cluster at a port free now, else at ``plan.restart_port``."""
        port = free_port() if self.spec.local else restart_port(first.master_port, attempt)
        return replan(self.spec, self.target, job_id=first.job_id, attempt=attempt,
                      hosts=hosts, addresses=addresses, port=port,
                      max_restarts=self.policy.max_restarts)


class Runner:
    def __init__(self, plan: LaunchPlan, transports: dict[str, Transport], run_dir: Path,
                 on_line: LineSink | None = None, on_status: Callable[[str], None] | None = None,
                 options: RunOptions | None = None, on_data: DataSink | None = None,
                 restarts: Restarts | None = None,
                 ended_by: Callable[[], str | None] | None = None,
                 console_dropped: Callable[[], int] | None = None) -> None:
        self.plan = self._first = plan
        self.restarts = restarts
        self.ended_by = ended_by
        """After a failed attempt: who ended it from outside, if anyone did (Slurm's scancel,
        time limit, preemption): then it is not the job's failure, and never restarted."""
        self.console_dropped = console_dropped
        """How many of the lines given to ``on_line`` its console skipped (for the summary)."""
        self.transports = transports
        self.run_dir = run_dir
        self.layout = RunDir(run_dir)
        self.on_line = on_line or (lambda host, rank, text: None)
        self.on_status = on_status or (lambda text: None)
        self.on_data = on_data or (lambda host, rank, data: None)
        self.opts = options or RunOptions()
        # (attempt, host, frames or event): what a channel of an earlier attempt still brings
        # after its attempt ended is dropped, not taken for news of the next one.
        self.events: queue.Queue[tuple[int, str, Any]] = queue.Queue()
        """Bounded by the channels: none reads more frames while BACKLOG batches wait here."""
        self.channels: dict[str, NodeChannel] = {}
        self._behind = False
        self.logs = RunLogs(run_dir, on_error=lambda text: self.on_status(text))
        self._use_plan(plan)
        self._stop_reason = ""
        self._stop_requests = 0
        self._killed_by = ""
        """Who ended the job through the control socket (``ptcluster kill``), if anyone did."""
        self._sink_errors: set[str] = set()
        self.sup: Supervisor | None = None
        self.stacks = StackCollector(run_dir, self.on_status)
        self._hang_report: dict[str, Any] | None = None
        self._looping = False
        """Whether the loop runs (and answers ``_Ask``); the control socket's thread reads it."""
        self._figures: tuple[int, dict[str, Any]] = (-1, {})
        """(the straggler watch's version, its figures) as last built by the loop."""
        self._addresses: dict[str, str] = {}
        """Each node's address as its guard last reported it (where a new master is reached)."""

    # -- public -------------------------------------------------------------------------------
    def request_stop(self, reason: str = "interrupted") -> None:
        """Thread- and signal-safe: ask the run to end everywhere (Ctrl-C, SIGTERM)."""
        self._stop_reason = reason
        self._stop_requests += 1

    def ask_stacks(self, timeout: float = 20.0) -> dict[str, Any]:
        """Thread-safe: every rank's stacks, collected by the loop (the job goes on), and the
        straggler report's figures."""
        answer = self._ask("stacks", timeout)
        if not answer.get("ok", True):
            return answer
        return {**answer, "straggler": self.straggler_figures().get("straggler", {})}

    def straggler_figures(self) -> dict[str, Any]:
        """Thread-safe: the straggler report's current figures. From the loop while it runs
        (built when asked: those of 8192 ranks take ~80 ms), else at once, as the last loop
        left them (between attempts, during a teardown)."""
        if not self._looping:
            return {"ok": True, "straggler": self._figures[1]}
        return self._ask("straggler", ASK_SECONDS)

    def _ask(self, what: str, timeout: float) -> dict[str, Any]:
        """The loop's answer to ``what`` (``_Ask``), built there from its own state."""
        reply: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=1)
        self.events.put((ANY_ATTEMPT, "", _Ask(what, reply, time.monotonic() + timeout)))
        try:
            return reply.get(timeout=timeout)
        except queue.Empty:
            return {"ok": False, "error": f"no {what} report within {timeout:.0f} s"}

    def run(self) -> RunResult:
        """Every attempt of the job (one unless ``restarts`` allows more): the last one's
        result, with the record of each attempt."""
        t0 = time.monotonic()
        self.logs.max_open = log_files_budget(len(self.plan.nodes))
        self._prepare_run_dir()
        attempts: list[AttemptRecord] = []
        control = self._open_control()  # one for the job: `stacks` reaches the running attempt
        try:
            result = self._attempts(attempts, t0)
        finally:
            if control is not None:
                control.close()
        self.logs.close()  # (every line written before the summary counts what is missing)
        if self.console_dropped is not None:  # (no line reaches on_line after the loop)
            result.console_dropped = self.console_dropped()
        result.log_errors = [f"{error} ({self.logs.lost.get(name, 0)} line(s) missing)"
                             for name, error in self.logs.errors.items()]
        write_private(self.layout.summary, json.dumps(result.to_json(), indent=2))
        return result

    def _attempts(self, attempts: list[AttemptRecord], t0: float) -> RunResult:
        waiting_since, said = time.monotonic(), ""
        shown, held_back = self.on_status, list[str]()
        while True:
            if said:  # a try while waiting: its lines only if it is not tried again
                self.on_status = held_back.append
            try:
                view, result, record = self._attempt(attempts, t0)
            finally:
                self.on_status = shown
            if self._may_wait(result, time.monotonic() - waiting_since):
                held_back.clear()
                why = "; ".join(f"{f.host}: {f.message}" for f in result.failures)
                if why != said:  # once, and again when who holds them changes
                    self.on_status(f"waiting (--wait, no queue): {why}")
                    said = why
                deadline = time.monotonic() + self.opts.wait_poll
                while time.monotonic() < deadline and not self._stop_requests:
                    time.sleep(0.1)
                if not self._stop_requests:
                    continue
            for text in held_back:
                shown(text)
            held_back.clear()
            attempts.append(record)
            result.attempts = attempts
            self._addresses.update((n.host, str(n.facts["address"])) for n in result.nodes
                                   if n.facts.get("address"))
            killed_by = self._killed_by or view.killed_by  # (through the head, or a guard)
            if not record.ok and killed_by:
                result.ended_by = killed_by
            elif not record.ok and self.ended_by is not None:
                result.ended_by = self.ended_by() or ""
            decision = decide(None if self.restarts is None else self.restarts.policy,
                              attempts, result.failures, result.interrupted, view.cut_off,
                              ended_by=result.ended_by, stop_requested=self._stop_requests > 0)
            record.dropped = list(decision.drop)
            result.interrupted = result.interrupted or decision.stopped
            if not decision.restart or self.restarts is None:
                result.gave_up, result.no_progress = decision.reason, decision.no_progress
                break
            hosts = tuple(n.host for n in self.plan.nodes if n.host not in decision.drop)
            self._use_plan(self.restarts.next_plan(self._first, len(attempts), hosts,
                                                   self._addresses))
            self.on_status(f"{decision.reason}: attempt {len(attempts)} on {len(hosts)} "
                           f"node(s), world size {self.plan.world_size}, rendezvous port "
                           f"{self.plan.master_port or 'auto'}")
            self._write_plan()
        return result

    def _attempt(self, before: list[AttemptRecord],
                 run_t0: float) -> tuple[SupervisorView, RunResult, AttemptRecord]:
        """One attempt: every node started, supervised, torn down; every channel closed."""
        t0 = time.monotonic()
        sup = self.sup = Supervisor(self.plan, self.opts, t0, wall_offset=time.time() - t0)
        view = sup.view
        record = AttemptRecord(number=self.plan.attempt,
                               hosts=[n.host for n in self.plan.nodes],
                               world_size=self.plan.world_size,
                               master_port=self.plan.master_port, started_at=sup.wall(t0))
        if self.plan.attempt:  # the same files go on; the last lines are this attempt's
            self.logs.new_attempt(f"----- attempt {self.plan.attempt}: world size "
                                  f"{self.plan.world_size} -----")
        self._hang_report = None
        try:
            started = start_all([self._channel(n.host) for n in self.plan.nodes],
                                self._could_not_start)
            self.channels = {c.host: c for c in started}
            self._looping = True
            try:
                self._loop(sup)
            finally:
                self._looping = False
                self._straggler_now(sup)  # (what the control socket answers until the next)
        finally:
            self.stacks.abandon()
            close_all(list(self.channels.values()), timeout=self.opts.stop_deadline)
            self.channels = {}
            self.logs.close()
        result = self._result(view, time.monotonic() - run_t0)
        record.ok, record.cause = result.ok, result.root_cause
        record.ended_at = time.time()
        record.checkpoint, record.resumed_from = view.checkpoint, view.resumed_from
        record.master_port = view.master_port
        record.ranks_started_at = start = view.first_rank_start
        previous = before[-1] if before else None
        if previous is not None and previous.cause is not None and start is not None:
            record.downtime = start - previous.cause.at
        return view, result, record

    def _may_wait(self, result: RunResult, waited: float) -> bool:
        """``--wait``: the attempt was refused only because other jobs hold what it asks for,
        no rank started, and the wait is not over."""
        return (self.opts.wait is not None and waited < self.opts.wait
                and not self._stop_requests and bool(result.failures)
                and all(f.kind is FailureKind.BUSY for f in result.failures)
                and all(r.started_at is None for r in result.ranks))

    def _use_plan(self, plan: LaunchPlan) -> None:
        self.plan = plan
        self._node_rank = {n.host: n.node_rank for n in plan.nodes}
        self._ranks_of = {n.host: frozenset(n.ranks) for n in plan.nodes}

    # -- starting -----------------------------------------------------------------------------
    def _prepare_run_dir(self) -> None:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._write_plan()
        except OSError as exc:
            raise RunDirError(f"cannot write the run directory {self.run_dir}: "
                              f"{exc.strerror or exc}",
                              "pass --run-dir with a directory you can write to") from None

    def _write_plan(self) -> None:
        write_private(self.layout.plan_file(self.plan.attempt),
                      json.dumps(plan_json(self.plan, self.opts), indent=2))

    def _open_control(self) -> ControlServer | None:
        """``ptcluster stacks`` asks through this; a run goes on without it."""
        try:
            control = ControlServer(self.run_dir, self._control_request, job_id=self.plan.job_id)
        except OSError as exc:
            self.on_status(f"no control socket in {self.run_dir} ({exc}): `ptcluster stacks` "
                           "cannot reach this job")
            return None
        if control.unregistered:
            self.on_status(f"this job is not in your registry of heads ({control.unregistered})"
                           ": `ptcluster kill` on this machine goes through its nodes' guards")
        return control

    def _control_request(self, request: dict[str, Any]) -> dict[str, Any]:
        if request.get("cmd") == "stacks":
            return self.ask_stacks()
        if request.get("cmd") == "kill":
            return self._kill_request(request)
        if request.get("cmd") == "straggler":
            return self.straggler_figures()
        return {"ok": False, "error": f"unknown request {str(request.get('cmd'))[:40]!r}"}

    def _kill_request(self, request: dict[str, Any]) -> dict[str, Any]:
        """``ptcluster kill`` (the owner or root: the control socket checked who): stop the job
        in order everywhere, as on Ctrl-C, with the asker named as the cause; KILL is the
        hurried stop of a second Ctrl-C (no waiting for the nodes)."""
        job_id, signame = request.get("job_id"), request.get("signal") or "TERM"
        if job_id != self.plan.job_id:
            return {"ok": False, "error": f"this head runs job {self.plan.job_id}, not "
                                          f"{str(job_id)[:40]}"}
        if signame not in ("TERM", "INT", "KILL"):
            return {"ok": False, "error": f"unknown signal {str(signame)[:20]!r}"}
        by = request.get("by")
        by = by if isinstance(by, dict) else {}
        host, user = (str(by.get(k) or "?")[:100] for k in ("host", "user"))
        self._killed_by = self._killed_by or f"ended by `ptcluster kill` from {host} ({user})"
        for _ in range(2 if signame == "KILL" else 1):
            self.request_stop(self._killed_by)
        return {"ok": True, "job_id": self.plan.job_id, "pid": os.getpid()}

    def _channel(self, host: str) -> NodeChannel:
        node = self.plan.nodes[self._node_rank[host]]
        config = node.guard_config(self.plan, self.opts)
        put, attempt = self.events.put, self.plan.attempt
        return NodeChannel(
            self.transports[host], node.python, GUARD, dict(config),
            on_frames=lambda lines: put((attempt, host, lines)),
            on_stderr=lambda line: put((attempt, host, ev.AgentOutput(host, line, "stderr"))),
            on_closed=lambda code, err: put((attempt, host, ev.ChannelClosed(
                host, code, err, cause=explain_channel_failure(err, code, node.python)))),
            heartbeat=config["heartbeat_every"], tag=self.plan.job_id,
            backlog=self._backlogged)

    def _backlogged(self) -> bool:
        """The channels' one ``backlog`` (the hub asks it once for all it holds)."""
        size = self.events.qsize()
        self._behind = size >= (BACKLOG // 2 if self._behind else BACKLOG)
        return self._behind

    def _could_not_start(self, channel: NodeChannel, problem: str, fix: str) -> None:
        self.events.put((self.plan.attempt, channel.host,
                         ev.ChannelClosed(channel.host, None, [problem], cause=(problem, fix))))

    # -- the loop -----------------------------------------------------------------------------
    def _loop(self, sup: Supervisor) -> None:
        """Events as they come; the checks over every node (silence, hangs, the teardown's
        steps) and the logs' writes on fixed timers, so the work per event does not grow with
        the number of nodes."""
        stops_applied = 0
        now = time.monotonic()
        flush_gap = flush_every(self.plan)
        next_tick, next_flush = now, now + flush_gap
        while not sup.view.done:
            while stops_applied < self._stop_requests:  # a second Ctrl-C hurries the teardown
                stops_applied += 1
                self._apply(sup.request_stop(self._stop_reason, time.monotonic()))
            try:
                item: tuple[int, str, Any] | None = self.events.get(
                    timeout=max(0.0, next_tick - time.monotonic()))
            except queue.Empty:
                item = None
            woke = time.monotonic()
            budget_end = woke + BATCH_SECONDS
            while item is not None:
                self._handle(sup, *item)
                if time.monotonic() > budget_end:
                    break
                try:
                    item = self.events.get_nowait()
                except queue.Empty:
                    item = None
            now = time.monotonic()
            if now - woke < WAKE_SECONDS and stops_applied == self._stop_requests:
                time.sleep(WAKE_SECONDS - (now - woke))
                now = time.monotonic()
            if now >= next_flush:
                self.logs.flush()
                next_flush = now + flush_gap
            if now >= next_tick:
                self._finish_collections(sup, now)
                quiet = {h: 0.0 if c.busy else now - c.last_recv
                         for h, c in self.channels.items()}
                self._apply(sup.on_tick(now, quiet))
                next_tick = now + TICK_SECONDS

    def _handle(self, sup: Supervisor, attempt: int, host: str, payload: Any) -> None:
        if attempt != self.plan.attempt and attempt != ANY_ATTEMPT:
            return  # a late word from an earlier attempt's channel
        try:
            if isinstance(payload, _Ask) and time.monotonic() > payload.until:
                return  # (its asker has given up)
            if isinstance(payload, _Ask) and payload.what == "straggler":
                payload.reply.put({"ok": True, "straggler": self._straggler_now(sup)})
            elif isinstance(payload, _Ask):
                self._collect(sup.view, "asked by `ptcluster stacks`", payload.reply)
            elif isinstance(payload, list):
                self._frames(sup, host, payload)
            else:
                self._apply(sup.on_event(payload, time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - a log or sink error must not lose the job
            log.debug("handling a batch from %s failed", host, exc_info=True)
            self._sink_error(exc)

    def _straggler_now(self, sup: Supervisor) -> dict[str, Any]:
        """The report's figures, built again only when reports came since the last time."""
        if self._figures[0] != sup.straggler.version:
            self._figures = (sup.straggler.version, sup.view.straggler)
        return self._figures[1]

    def _frames(self, sup: Supervisor, host: str, lines: list[str]) -> None:
        """A batch of frames. Output lines (nearly all of them under load) take a short path:
        straight to the rank's log and the sink, without an event object each. A failure there
        costs that line, never the frames after it (an exit status, a checkpoint report)."""
        mine = self._ranks_of[host]
        rank_line, on_line = self.logs.rank_line, self.on_line
        for line in lines:
            if line[:2] in ("o ", "e "):
                rank_text, _, text = line[2:].partition(" ")
                if rank_text.isdigit() and int(rank_text) in mine:
                    rank = int(rank_text)
                    try:
                        rank_line(rank, text)
                        on_line(host, rank, text)
                    except Exception as exc:  # noqa: BLE001 - (free in 3.11 when not raised)
                        log.debug("%s: a line of rank %d was not handled", host, rank,
                                  exc_info=True)
                        self._sink_error(exc)
                    continue
            self._apply(sup.on_event(ev.decode(host, line), time.monotonic()))

    def _sink_error(self, exc: Exception) -> None:
        """Once per kind of error: say it, keep supervising (the logs may be incomplete)."""
        key = type(exc).__name__
        if key not in self._sink_errors:
            self._sink_errors.add(key)
            self.on_status(f"output could not be handled ({exc}); the job goes on, but its "
                           "logs or console output may be incomplete")

    def _node_line(self, host: str, text: str, show: bool) -> None:
        self.logs.node_line(self._node_rank[host], host, text)
        if show:
            self.on_line(host, None, text)

    def _deliver(self, d: DeliverData) -> None:
        try:
            self.on_data(d.host, d.rank, d.data)
        except Exception:  # noqa: BLE001 - a bad record is noted, the job is not lost
            log.exception("%s: rank %s reported a record the caller cannot use", d.host, d.rank)
            assert self.sup is not None
            self._node_line(d.host, f"ptcluster: unusable record from rank {d.rank}: "
                            f"{str(d.data)[:200]}", show=not self.sup.view.stopping)

    def _apply(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Send):
                channel = self.channels.get(action.host)
                if channel is not None:
                    channel.send(action.kind, action.payload)
            elif isinstance(action, SignalChannel):
                channel = self.channels.get(action.host)
                if channel is not None:
                    channel.signal(action.sig)
            elif isinstance(action, Status):
                self.on_status(action.text)
            elif isinstance(action, NodeLine):
                self._node_line(action.host, action.text, action.show)
            elif isinstance(action, DeliverData):
                self._deliver(action)
            elif isinstance(action, StacksAnswered):
                self.stacks.reply(action.reply)
            elif isinstance(action, CollectStacks):
                assert self.sup is not None
                self._collect(self.sup.view, action.purpose)

    # -- stacks -------------------------------------------------------------------------------
    def _collect(self, view: SupervisorView, purpose: str,
                 waiter: queue.Queue[dict[str, Any]] | None = None) -> None:
        """Ask every node that runs ranks for their stacks (answers: ``StacksAnswered``)."""
        hosts = {h for h in view.askable if h in self.channels}
        if view.phase is not Phase.RUNNING or not hosts:
            if waiter is not None:
                waiter.put({"ok": False, "error": f"the job is {view.phase.value}, not running"})
                return
            hosts = set()  # a hang with no node left to ask: an empty report, at once
        reason = (f"hang: no rank made progress for {self.opts.hang_timeout:.0f} s"
                  if purpose == HANG else purpose)
        self.stacks.start(purpose, reason, hosts,
                          lambda host, payload: self.channels[host].send("stacks", payload),
                          waiter)

    def _finish_collections(self, sup: Supervisor, now: float) -> None:
        for purpose, report in self.stacks.finish(now):
            if purpose == HANG:
                self._hang_report = report.to_json()
                late, _ = report.straggler()
                self._apply(sup.hang_reported(
                    report.headline(), late[0].rank if len(late) == 1 else None,
                    ", ".join(dict.fromkeys(r.host for r in late)) or None, now))

    # -- results ------------------------------------------------------------------------------
    def _result(self, view: SupervisorView, duration: float) -> RunResult:
        failures = view.failures
        for failure in failures:
            # Filled now, not when the exit arrived: a traceback may come after it.
            if failure.rank is not None:
                failure.last_lines = self.logs.tail(failure.rank)
            elif not failure.last_lines and failure.host in self._node_rank:
                failure.last_lines = self.logs.node_tail(failure.host)
        return RunResult(job_id=self.plan.job_id, run_dir=self.run_dir,
                         ranks=view.ranks, nodes=view.nodes,
                         failures=failures, interrupted=view.interrupted, duration=duration,
                         hang_report=self._hang_report, straggler=view.straggler)


def plan_json(plan: LaunchPlan, opts: RunOptions) -> dict[str, Any]:
    """The plan as shipped: per node, the guard's whole config (configuration only: the code
    travels in the guard's program)."""
    data: dict[str, Any] = {k: v for k, v in asdict(plan).items() if k != "nodes"}
    data["options"] = asdict(opts)
    data["nodes"] = []
    for node in plan.nodes:
        cfg = node.guard_config(plan, opts)
        data["nodes"].append({"host": node.host, "node_rank": node.node_rank,
                              "ranks": [node.ranks.start, node.ranks.stop - 1],
                              "python": node.python, "guard": cfg})
    return data

