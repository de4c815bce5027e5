"""One attempt of a job: every node started, supervised, torn down; every channel closed.

Glue only: a channel per node -> one bounded queue of what the channels bring -> frames decoded
into events (``supervise.events``) -> output to the logs and the ``on_line`` sink, everything
else to the :class:`Supervisor`, whose actions (send, signal a channel, tell the user) are
applied here (``_apply``). Requests of the control socket (``control.server.Ask``) come on the
same queue and are answered from the loop's own state.

Control never waits on output: heartbeats go out from the channels' I/O thread, the sinks are
expected to be quick (the CLI's console is a bounded, dropping feed), and the loop takes a
bounded batch of events between its checks.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ptcluster.control.protocol import Answer, Request
from ptcluster.control.server import Ask, HeadDoor
from ptcluster.errors import Problem
from ptcluster.launch.lost import explain_losses
from ptcluster.launch.options import CHECK_EVERY, RunOptions
from ptcluster.launch.plan import LaunchPlan
from ptcluster.launch.readmit_watch import NodeBack
from ptcluster.launch.result import AttemptRecord, RunResult
from ptcluster.launch.runlogs import RunLogs
from ptcluster.launch.stacks.collector import StackCollector
from ptcluster.launch.stacks.report import StackReport
from ptcluster.launch.supervise import events as ev
from ptcluster.launch.supervise.actions import (
    HANG,
    Action,
    CollectStacks,
    DeliverData,
    NodeLine,
    Send,
    SignalChannel,
    StacksAnswered,
    Status,
)
from ptcluster.launch.supervise.states import Phase
from ptcluster.launch.supervise.straggler import Report
from ptcluster.launch.supervise.supervisor import Supervisor
from ptcluster.node import GUARD
from ptcluster.node.wire import Kind
from ptcluster.remote.channel import NodeChannel, close_all, start_all
from ptcluster.remote.transport import Transport, explain_channel_failure

log = logging.getLogger(__name__)

LineSink = Callable[[str, "int | None", str], None]
"""on_line(host, rank or None for the node's own lines, text)."""
DataSink = Callable[[str, int, dict[str, Any]], None]
"""on_data(host, rank, record) for structured records a rank program reports."""
StatusSink = Callable[[str], None]
"""on_status(text): a note for the user (the CLI prints it as ``ptcluster: text``)."""
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
TICK_SECONDS = CHECK_EVERY
"""How often the checks over every node run (silence, hang, the teardown's escalation)."""
FLUSH_SECONDS = 0.5
"""How often the logs are written (what a crash of the head could lose at most), on jobs of up
to ``LOG_WRITES_PER_SECOND`` / 2 ranks and nodes together (``flush_every``)."""
LOG_WRITES_PER_SECOND = 4096
"""Log-file writes a second the head allows itself in all: each one is a system call into a
different file (~10 us here), and 1024 nodes x 8 ranks that each print once a second would
otherwise cost 8192 of them a second. Larger jobs write their logs less often instead (1024 x 8:
every 2.25 s)."""
BACKLOG = 256
"""Batches waiting for the loop (<= 64 KiB each, so <= ~16 MiB) before the channels stop
reading: the nodes' output then waits in their pipes, and the job never waits for the head's
memory. They read again once the loop is down to half of it (not at the next batch: a hold
that lifted at 255 would hold again at once)."""


def flush_every(plan: LaunchPlan) -> float:
    """Seconds between two writes of the logs of ``plan`` (every rank's and every node's)."""
    return max(FLUSH_SECONDS, (plan.world_size + len(plan.nodes)) / LOG_WRITES_PER_SECOND)


def _no_line(host: str, rank: int | None, text: str) -> None:
    pass


def _no_data(host: str, rank: int, data: dict[str, Any]) -> None:
    pass


def _no_status(text: str) -> None:
    pass


@dataclass(frozen=True)
class Sinks:
    """Where a run's output goes besides its logs (the CLI's console, a library caller)."""

    on_line: LineSink = _no_line
    on_status: StatusSink = _no_status
    on_data: DataSink = _no_data

    @classmethod
    def given(cls, on_line: LineSink | None = None, on_status: StatusSink | None = None,
              on_data: DataSink | None = None) -> Sinks:
        """Those given; one that does nothing for each left out."""
        return cls(on_line=on_line or _no_line, on_status=on_status or _no_status,
                   on_data=on_data or _no_data)


@dataclass
class Stops:
    """Stop requests from outside the loop (Ctrl-C, SIGTERM, ``ptcluster kill``): written by a
    signal handler or another thread, read by the loop (a second request hurries the
    teardown)."""

    count: int = 0
    reason: str = ""
    signum: int | None = None
    """The first signal that asked (None: none did, or a thread asked)."""

    def request(self, reason: str, signum: int | None = None) -> None:
        self.reason = reason
        self.count += 1
        if self.signum is None:
            self.signum = signum


@dataclass
class RunContext:
    """What every attempt of a run shares (built once by the ``Runner``)."""

    opts: RunOptions
    transports: dict[str, Transport]
    run_dir: Path
    logs: RunLogs
    stacks: StackCollector
    sinks: Sinks
    stops: Stops
    door: HeadDoor
    events: queue.Queue[tuple[int, str, Any]]
    """(attempt, host, frames or event or ``Ask``): what a channel of an earlier attempt still
    brings after its attempt ended is dropped, not taken for news of the next one. Bounded by
    the channels: none reads more frames while ``BACKLOG`` batches wait here."""
    sink_errors: set[str] = field(default_factory=set)
    """The kinds of error the sinks or logs raised (each said once)."""
    behind: bool = False
    """The channels were told to hold their reading (until the queue is down to half)."""
    on_ranks_started: Callable[[], None] = field(default=lambda: None)
    """Called once an attempt's first rank started: from then on it is no try that ``--wait``
    tries again (the runner shows the notes it held back)."""

    def backlogged(self) -> bool:
        """The channels' one ``backlog`` (the hub asks it once for all it holds)."""
        size = self.events.qsize()
        self.behind = size >= (BACKLOG // 2 if self.behind else BACKLOG)
        return self.behind


class Attempt:
    """One attempt of ``plan`` (a restart's plan is a new attempt) with the run's shared
    ``ctx``; ``run`` returns how it went."""

    def __init__(self, plan: LaunchPlan, ctx: RunContext) -> None:
        self.plan = plan
        self.ctx = ctx
        self.opts = ctx.opts
        self.logs = ctx.logs
        self.channels: dict[str, NodeChannel] = {}
        """The channels that started, by host (empty again once the attempt is over)."""
        self._node_rank = {n.host: n.node_rank for n in plan.nodes}
        self._ranks_of = {n.host: frozenset(n.ranks) for n in plan.nodes}
        self._hang_report: StackReport | None = None
        self._saved_at: dict[str, str] = {}
        """Per node, where the attempts before saved their last checkpoint."""
        t0 = time.monotonic()
        self.t0 = t0
        self.sup = Supervisor(plan, self.opts, t0, wall_offset=time.time() - t0)

    def run(self, before: list[AttemptRecord],
            run_t0: float) -> tuple[Supervisor, RunResult, AttemptRecord]:
        """Every node started, supervised, torn down; every channel closed. ``before``: the
        attempts so far (the downtime since the last one's failure)."""
        sup, plan, door = self.sup, self.plan, self.ctx.door
        self._saved_at = {h: p for rec in before for h, p in rec.checkpoint_paths.items()}
        view = sup  # (what the attempt reads of it: its read-only properties)
        record = AttemptRecord(number=plan.attempt, hosts=[n.host for n in plan.nodes],
                               world_size=plan.world_size, master_port=plan.master_port,
                               started_at=sup.wall(self.t0))
        if plan.attempt:  # the same files go on; the last lines are this attempt's
            self.logs.new_attempt(f"----- attempt {plan.attempt}: world size "
                                  f"{plan.world_size} -----")
        try:
            started = start_all([self._channel(n.host) for n in plan.nodes],
                                self._could_not_start)
            self.channels = {c.host: c for c in started}
            door.job = {"attempt": plan.attempt, "world_size": plan.world_size,
                        "nodes": len(plan.nodes)}
            door.looping = True
            try:
                self._loop(sup)
            finally:
                door.looping = False
                self._straggler_now(sup)  # (what the control socket answers until the next)
        finally:
            self.ctx.stacks.abandon()
            close_all(list(self.channels.values()), timeout=self.opts.stop_deadline)
            self.channels = {}
            self.logs.close()
        explain_losses(view.failures, view.nodes, plan, self.ctx.transports)  # (<= PROBE_BOUND)
        result = self._result(view, time.monotonic() - run_t0)
        record.ok, record.cause = result.ok, result.root_cause
        result.planned = view.planned
        record.end, record.planned = result.outcome.value, result.planned
        record.planned_at = view.planned_at
        record.ended_at = time.time()
        record.checkpoint, record.resumed_from = view.checkpoint, view.resumed_from
        record.checkpoint_paths = view.checkpoint_paths
        record.master_port = view.master_port
        record.ranks_started_at = start = view.first_rank_start
        record.warm = {n.host: n.facts["warm"] for n in result.nodes if "warm" in n.facts}
        previous = before[-1] if before else None
        if previous is not None and previous.cause is not None and start is not None:
            record.downtime = start - previous.cause.at
        elif previous is not None and previous.planned_at is not None and start is not None:
            record.downtime = start - previous.planned_at  # (a planned restart's own cost)
        return view, result, record

    # -- starting -----------------------------------------------------------------------------
    def _channel(self, host: str) -> NodeChannel:
        node = self.plan.nodes[self._node_rank[host]]
        config = node.guard_config(self.plan, self.opts)
        if host in self._saved_at:  # (a restart: its gate checks the checkpoint's disk too)
            config["checkpoints"] = [self._saved_at[host]]
        put, attempt = self.ctx.events.put, self.plan.attempt
        return NodeChannel(
            self.ctx.transports[host], node.python, GUARD, dict(config),
            on_frames=lambda lines: put((attempt, host, lines)),
            on_stderr=lambda line: put((attempt, host, ev.AgentOutput(host, line, "stderr"))),
            on_closed=lambda code, err: put((attempt, host, ev.ChannelClosed(
                host, code, err, cause=explain_channel_failure(err, code, node.python)))),
            heartbeat=config["heartbeat_every"], tag=self.plan.job_id,
            backlog=self.ctx.backlogged)

    def _could_not_start(self, channel: NodeChannel, said: Problem) -> None:
        self.ctx.events.put((self.plan.attempt, channel.host,
                             ev.ChannelClosed(channel.host, None, [said.what], cause=said)))

    # -- the loop -----------------------------------------------------------------------------
    def _loop(self, sup: Supervisor) -> None:
        """Events as they come; the checks over every node (silence, hangs, the teardown's
        steps) and the logs' writes on fixed timers, so the work per event does not grow with
        the number of nodes."""
        stops, events = self.ctx.stops, self.ctx.events
        stops_applied = 0
        now = time.monotonic()
        flush_gap = flush_every(self.plan)
        next_tick, next_flush = now, now + flush_gap
        started = False
        while not sup.done:
            while stops_applied < stops.count:  # a second Ctrl-C hurries the teardown
                stops_applied += 1
                self._apply(sup.request_stop(stops.reason, time.monotonic()))
            try:
                item: tuple[int, str, Any] | None = events.get(
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
                    item = events.get_nowait()
                except queue.Empty:
                    item = None
            if not started and sup.first_rank_start is not None:
                started = True
                self.ctx.on_ranks_started()
            now = time.monotonic()
            if now - woke < WAKE_SECONDS and stops_applied == stops.count:
                time.sleep(WAKE_SECONDS - (now - woke))
                now = time.monotonic()
            if now >= next_flush:
                self.logs.flush()
                next_flush = now + flush_gap
            if now >= next_tick:
                self._finish_collections(sup, now)
                quiet = {h: 0.0 if c.held else now - c.last_recv
                         for h, c in self.channels.items()}
                self._apply(sup.on_tick(now, quiet))
                next_tick = now + TICK_SECONDS

    def _handle(self, sup: Supervisor, attempt: int, host: str, payload: Any) -> None:
        if attempt != self.plan.attempt and attempt != ANY_ATTEMPT:
            return  # a late word from an earlier attempt's channel
        try:
            if isinstance(payload, Ask):
                self._answer(sup, payload)
            elif isinstance(payload, NodeBack):
                self._apply(sup.node_back(payload.host, payload.refused, time.monotonic()))
            elif isinstance(payload, list):
                self._frames(sup, host, payload)
            else:
                self._apply(sup.on_event(payload, time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - a log or sink error must not lose the job
            log.debug("handling a batch from %s failed", host, exc_info=True)
            self._sink_error(exc)

    def _answer(self, sup: Supervisor, ask: Ask) -> None:
        """A request of the control socket, answered from the loop's own state."""
        if time.monotonic() > ask.until:
            return  # (its asker has given up)
        if ask.what == Request.STRAGGLER:
            ask.reply.put({"ok": True, "straggler": self._straggler_now(sup)})
        else:
            self._collect(sup, "asked by `ptcluster stacks`", ask.reply)

    def _straggler_now(self, sup: Supervisor) -> Report | None:
        """The report's figures, built again only when reports came since the last time."""
        door = self.ctx.door
        if door.figures[0] != sup.straggler_version:
            door.figures = (sup.straggler_version, sup.straggler_figures())
        return door.figures[1]

    def _frames(self, sup: Supervisor, host: str, lines: list[str]) -> None:
        """A batch of frames. Output lines (nearly all of them under load) take a short path:
        straight to the rank's log and the sink, without an event object each. A failure there
        costs that line, never the frames after it (an exit status, a checkpoint report)."""
        mine = self._ranks_of[host]
        rank_line, on_line = self.logs.rank_line, self.ctx.sinks.on_line
        for line in lines:
            if line[:2] in _OUTPUT:
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
        if key not in self.ctx.sink_errors:
            self.ctx.sink_errors.add(key)
            self.ctx.sinks.on_status(f"output could not be handled ({exc}); the job goes on, "
                                     "but its logs or console output may be incomplete")

    # -- actions ------------------------------------------------------------------------------
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
                self.ctx.sinks.on_status(action.text)
            elif isinstance(action, NodeLine):
                self._node_line(action.host, action.text, action.show)
            elif isinstance(action, DeliverData):
                self._deliver(action)
            elif isinstance(action, StacksAnswered):
                self.ctx.stacks.reply(action.reply)
            elif isinstance(action, CollectStacks):
                self._collect(self.sup, action.purpose)

    def _node_line(self, host: str, text: str, show: bool) -> None:
        self.logs.node_line(self._node_rank[host], host, text)
        if show:
            self.ctx.sinks.on_line(host, None, text)

    def _deliver(self, d: DeliverData) -> None:
        try:
            self.ctx.sinks.on_data(d.host, d.rank, d.data)
        except Exception:  # noqa: BLE001 - a bad record is noted, the job is not lost
            log.exception("%s: rank %s reported a record the caller cannot use", d.host, d.rank)
            self._node_line(d.host, f"ptcluster: unusable record from rank {d.rank}: "
                            f"{str(d.data)[:200]}", show=not self.sup.stopping)

    # -- stacks -------------------------------------------------------------------------------
    def _collect(self, view: Supervisor, purpose: str,
                 waiter: queue.Queue[Answer] | None = None) -> None:
        """Ask every node that runs ranks for their stacks (answers: ``StacksAnswered``)."""
        hosts = {h for h in view.askable if h in self.channels}
        if view.phase is not Phase.RUNNING or not hosts:
            if waiter is not None:
                waiter.put({"ok": False, "error": f"the job is {view.phase.value}, not running"})
                return
            hosts = set()  # a hang with no node left to ask: an empty report, at once
        reason = (f"hang: no rank made progress for {self.opts.hang_timeout:.0f} s"
                  if purpose == HANG else purpose)
        self.ctx.stacks.start(
            purpose, reason, hosts,
            lambda host, payload: self.channels[host].send(Kind.STACKS, payload), waiter)

    def _finish_collections(self, sup: Supervisor, now: float) -> None:
        for purpose, report in self.ctx.stacks.finish(now):
            if purpose == HANG:
                self._hang_report = report
                late, _ = report.straggler()
                self._apply(sup.hang_reported(
                    report.headline(), late[0].rank if len(late) == 1 else None,
                    ", ".join(dict.fromkeys(r.host for r in late)) or None, now,
                    named=tuple(r.rank for r in late)))

    # -- results ------------------------------------------------------------------------------
    def _result(self, view: Supervisor, duration: float) -> RunResult:
        failures = view.failures
        for failure in failures:
            # Filled now, not when the exit arrived: a traceback may come after it.
            if failure.rank is not None:
                failure.last_lines = self.logs.tail(failure.rank)
            elif not failure.last_lines and failure.host in self._node_rank:
                failure.last_lines = self.logs.node_tail(failure.host)
        return RunResult(job_id=self.plan.job_id, run_dir=self.ctx.run_dir,
                         ranks=view.ranks, nodes=view.nodes,
                         failures=failures, interrupted=view.interrupted, duration=duration,
                         hang_report=self._hang_report, straggler=view.straggler_figures())


_OUTPUT = (Kind.OUT + " ", Kind.ERR + " ")
"""The first two characters of a rank's output frame (``o RANK TEXT``, ``e RANK TEXT``)."""
