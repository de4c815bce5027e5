"""The life of one job as an explicit state machine: no I/O, no threads, no clock of its own.

``Supervisor.on_event(event, now)`` and ``.on_tick(now, quiet)`` take what happened and return
what to do (:data:`Action` values: send a frame to a node, signal a node's channel, tell the
user). The runner executes the actions and reads the job's state through the supervisor's own
read-only properties (its base, :class:`JobState`); tests drive it with a fake clock.

The job's phases: STARTING (guards connect and check their node) -> RUNNING (every node said
ready, the head said go) -> STOPPING (a failure, Ctrl-C or the deadline: every node is told to
stop, then escalation) -> DONE (every node STOPPED or LOST). Each node has its own
:class:`NodeState`, changed in one place (``Supervisor._enter``); a node that does not end after
stop is taken through the :class:`Escalation` steps. Every failure is kept with the time it
happened on a corrected clock (node time minus the offset measured at hello); the earliest is the
root cause, whatever order the news arrived in.
"""

from __future__ import annotations

import signal
from dataclasses import replace
from typing import NoReturn

from ptcluster.errors import Problem
from ptcluster.launch.plan import AUTO_PORT
from ptcluster.launch.result import Failure, FailureKind
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
from ptcluster.launch.supervise.known import (
    VERSIONS,
    differing_versions,
    match_agent,
    versions_said,
)
from ptcluster.launch.supervise.machine_view import xid_said
from ptcluster.launch.supervise.readmit import said_back
from ptcluster.launch.supervise.states import (
    FINAL,
    Escalation,
    JobState,
    NodeState,
    Phase,
    RankLife,
)
from ptcluster.launch.supervise.verdict import (
    TORCHRUN_EXITED,
    Raised,
    guard_stopped,
    hung,
    master_elsewhere,
    node_silent,
    not_ready,
    ready_notes,
    timed_out,
)
from ptcluster.node import wire
from ptcluster.node.rank_wire import CHECKPOINT, PROGRESS_REPORTS, RESUMED, RETURNED

MAX_GPU_ERRORS = 32
"""Xids kept (and shown) per node: a failing GPU may repeat its line many times."""


class Supervisor(JobState):
    """Events, ticks and stop requests in, actions out; the one place the job's state changes
    (what it is and what the runner reads of it: :class:`JobState`)."""

    # -- inputs -------------------------------------------------------------------------------
    def on_event(self, event: ev.Event, now: float) -> list[Action]:
        actions = self._dispatch(event, now)
        self._update_done()
        return actions

    def on_tick(self, now: float, quiet: dict[str, float]) -> list[Action]:
        """Periodic checks; ``quiet[host]``: seconds since that node's channel brought data."""
        actions: list[Action] = []
        if self._phase is Phase.STARTING and now - self._started_at > self._opts.ready_timeout:
            slow = [h for h, life in self._life.items() if life.state is NodeState.STARTING]
            actions += self._fail(not_ready(slow or [self._plan.nodes[0].host],
                                            self._opts.ready_timeout, self.wall(now)), now)
        if (self._phase is Phase.RUNNING and self._opts.deadline is not None
                and self._went_at is not None and now - self._went_at > self._opts.deadline):
            running = [r.record for r in self._ranks.values() if r.record.exit_code is None]
            actions += self._fail(timed_out(running, self._plan.nodes[0].host,
                                            self._opts.deadline, self.wall(now)), now)
        actions += self._check_silence(now, quiet)
        actions += self._check_hang(now, quiet)
        actions += self._check_straggler(now)
        actions += self._escalate(now)
        self._update_done()
        return actions

    def request_stop(self, reason: str, now: float) -> list[Action]:
        """Ctrl-C, SIGTERM or a caller: end the job everywhere (never a failure of its own).
        Asked again while stopping: skip the wait, cut every channel now (each guard ends its
        node's job when its channel closes)."""
        if self._phase is Phase.DONE:
            return []
        self._stop.requests += 1
        if self._stop.requests == 1:
            if self._phase is not Phase.STOPPING:
                return self._stop_all(reason, now, final=True)
            return [Status(f"{reason}: the job is already being stopped everywhere")]
        if self._stop.requests > 2:
            return []
        actions: list[Action] = [Status(f"{reason} again: not waiting for the nodes, cutting "
                                        "their channels (each guard ends its job on EOF)")]
        for life in self._life.values():
            actions += life.hurry(now)
        return actions

    def node_back(self, host: str, refused: str, now: float) -> list[Action]:
        """``run --readmit``: ``host``, lost in an earlier attempt, answers again; unless
        ``refused`` says why not (its health gate, two strikes, a spare in its place), a
        planned restart at the next checkpoint every rank saves takes it back
        (``supervise.readmit``)."""
        if refused:
            return [Status(f"{host} answers again but {refused}")]
        if self._phase in (Phase.STOPPING, Phase.DONE) or \
                not self._readmit.back(host, self._reports.common_step(len(self._nodes))):
            return []
        return [Status(f"{host} answers again and passed its health gate: a planned restart "
                       "at the next checkpoint every rank saved takes it back (--readmit)")]

    def _readmit_due(self, now: float) -> list[Action]:
        """A planned restart that the newest checkpoint every rank saved makes due: stop."""
        if self._phase is not Phase.RUNNING or self._readmit.step is not None or \
                not self._readmit.waiting:
            return []
        step = self._readmit.due(self._reports.common_step(len(self._nodes)), self.wall(now))
        if step is None:
            return []
        return self._stop_all(said_back(self._readmit.waiting, step), now)

    # -- events -------------------------------------------------------------------------------
    def _dispatch(self, e: ev.Event, now: float) -> list[Action]:
        """Each kind of event to its handler (mypy checks that every kind has one)."""
        match e:
            case ev.Hello():
                return self._hello(e, now)
            case ev.Ready():
                return self._ready(e, now)
            case ev.GuardRefused():
                return self._guard_refused(e, now)
            case ev.Started():
                return self._started(e, now)
            case ev.Heartbeat():
                return self._heartbeat(e, now)
            case ev.GuardStopping():
                return self._guard_stopping(e, now)
            case ev.RankStart():
                return self._rank_start(e, now)
            case ev.RankExit():
                return self._rank_exit(e, now)
            case ev.RankError():
                return self._rank_error(e, now)
            case ev.RankData():
                return self._rank_data(e, now)
            case ev.RankOutput() | ev.AgentOutput() | ev.Malformed():
                return self._node_output(e, now)
            case ev.GuardExit():
                return self._guard_exit(e, now)
            case ev.ChannelClosed():
                return self._closed(e, now)
            case ev.StacksReply():  # (a node speaks for its own ranks only)
                return [StacksAnswered(replace(e, ranks={
                    r: v for r, v in e.ranks.items() if self._rank(e.host, r) is not None}))]
            case ev.Timing():
                return self._timing(e, now)
            case ev.GpuError():
                return self._gpu_error(e)
            case _:
                return _unhandled(e)

    def _hello(self, e: ev.Hello, now: float) -> list[Action]:
        node = self._nodes[e.host]
        node.clock_offset = round(e.node_time - self.wall(now), 3)
        if e.version != wire.VERSION:
            return self._fail(Failure(
                host=e.host, rank=None, at=self.wall(now), kind=FailureKind.GUARD,
                message=f"its node program speaks protocol v{e.version}, the head v"
                        f"{wire.VERSION}", fix="use the same ptcluster version everywhere"), now)
        return []

    def _ready(self, e: ev.Ready, now: float) -> list[Action]:
        self._nodes[e.host].facts = e.facts.copy()
        if self._life[e.host].state is NodeState.STARTING:
            self._enter(e.host, NodeState.READY)
        actions: list[Action] = [Status(note) for note in ready_notes(e.host, e.facts)]
        self._not_ready.discard(e.host)
        if self._phase is Phase.STARTING and not self._not_ready and \
                all(life.state is NodeState.READY for life in self._life.values()):
            actions += self._go(now)
        return actions

    def _go(self, now: float) -> list[Action]:
        """Every node is ready: unless the rendezvous is on the wrong node, tell each to go."""
        wrong = master_elsewhere(self._plan, {h: life.facts for h, life in self._life.items()},
                                 self.wall(now))
        if wrong is not None:
            return self._fail(wrong, now)
        self._phase, self._went_at = Phase.RUNNING, now
        self._versions = differing_versions({h: life.facts for h, life in self._life.items()})
        actions: list[Action] = [] if not self._versions else \
            [Status(f"the nodes' versions differ ({versions_said(self._versions)}): "
                    f"{VERSIONS.fix}")]
        told: dict[str, object] | None = None
        if self._plan.master_port == AUTO_PORT:  # the port the master's guard leased
            master = self._life[self._plan.nodes[0].host].facts
            self._master_port = int(master.get("master_port") or 0)
            told = {"master_port": self._master_port}
            actions.append(Status(f"rendezvous port {self._master_port} (auto: the first "
                                  f"free one on {self._plan.nodes[0].host})"))
        pools = {h: life.facts["pool"] for h, life in self._life.items() if "pool" in life.facts}
        if pools:  # (warm ranks asked for: from the pools only where every node has one)
            told = {**(told or {}), "warm": self._opts.pooled and all(pools.values())
                    and len(pools) == len(self._life)}
            cold = sorted(set(self._life) - {h for h, held in pools.items() if held})
            if cold and len(cold) < len(self._life) and self._opts.pooled:
                actions.append(Status(f"every node's ranks start cold: {', '.join(cold[:3])}"
                                      f"{f' and {len(cold) - 3} more' if len(cold) > 3 else ''}"
                                      f" {'has' if len(cold) == 1 else 'have'} no warm pool "
                                      "(a job's ranks rendezvous one way: all pooled or all "
                                      "torchrun's)"))
        for host in self._nodes:  # (the go first: the line for the user after it)
            self._enter(host, NodeState.RUNNING)
            actions.append(Send(host, wire.Kind.GO, told))
        actions.append(Status(f"all {len(self._nodes)} node(s) ready in "
                              f"{now - self._started_at:.2f} s; starting "
                              f"{self._plan.world_size} rank(s)"))
        return actions

    def _node_output(self, e: ev.AgentOutput | ev.Malformed | ev.RankOutput,
                     now: float) -> list[Action]:
        """The node's own lines (torchrun, ssh), and frames that are not what they should be
        (a rank the node does not run; a malformed frame of a known kind: the node's failure)."""
        text = e.text if isinstance(e, ev.AgentOutput) else e.line \
            if isinstance(e, ev.Malformed) else f"(rank {e.rank}?) {e.text}"
        line: list[Action] = [NodeLine(e.host, text, show=not self.stopping)]
        return line + (self._fail(ev.malformed(e, self.wall(now)), now)
                       if isinstance(e, ev.Malformed) and e.kind else [])

    def _rank_data(self, e: ev.RankData, now: float) -> list[Action]:
        if e.data.get("kind") in PROGRESS_REPORTS:  # the job's life: ours; the rest: the caller's
            return self._progress(e, now)
        return [DeliverData(e.host, e.rank, e.data)]

    def _started(self, e: ev.Started, now: float) -> list[Action]:
        self._life[e.host].facts["torchrun_pid"] = e.pid
        self._life[e.host].facts["warm"] = e.warm
        return []

    def _guard_refused(self, e: ev.GuardRefused, now: float) -> list[Action]:
        return self._fail(Failure(host=e.host, rank=None, problem=e.problem,
                                  kind=FailureKind.BUSY if e.busy else FailureKind.UNHEALTHY
                                  if e.unhealthy else FailureKind.ENVIRONMENT
                                  if e.environment else FailureKind.GUARD,
                                  at=self.wall(now)), now)

    def _rank_start(self, e: ev.RankStart, now: float) -> list[Action]:
        rank = self._rank(e.host, e.rank)
        if rank is not None:
            rank.record.started_at = at = self._corrected(e.host, e.node_time)
            rank.record.python = e.python
            if self._first_rank_start is None or at < self._first_rank_start:
                self._first_rank_start = at
        return []

    def _progress(self, e: ev.RankData, now: float) -> list[Action]:
        """The job's own progress reports: a checkpoint saved, the step it resumed from; and
        from the rank's shim: its program returned (what is left is the interpreter's exit)."""
        rank = self._rank(e.host, e.rank)
        if e.data.get("kind") == RETURNED and rank is not None:
            rank.returned = True
            return self._judge_rank(rank, now)
        step = e.data.get("step")
        if type(step) is not int or rank is None:
            return []
        if e.data.get("kind") == CHECKPOINT:
            self._checkpoint = step if self._checkpoint is None else max(self._checkpoint, step)
            if isinstance(e.data.get("path"), str) and e.data["path"].startswith("/"):
                self._checkpoint_paths[e.host] = e.data["path"]
            self._reports.add(e.host, e.rank, step)
            return self._readmit_due(now)
        elif e.data.get("kind") == RESUMED:
            self._resumed_from = step if self._resumed_from is None else min(self._resumed_from,
                                                                           step)
        return []

    def _rank_exit(self, e: ev.RankExit, now: float) -> list[Action]:
        rank = self._rank(e.host, e.rank)
        if rank is None:
            return []
        rank.record.exit_code, rank.record.duration = e.code, e.duration
        rank.record.ended_at = self._corrected(e.host, e.node_time)
        rank.oom, rank.xids = e.oom, e.xids
        return self._judge_rank(rank, now)

    def _gpu_error(self, e: ev.GpuError) -> list[Action]:
        """An Xid while the job runs: a warning now; the failure, if a rank dies of it."""
        node = self._nodes[e.host]
        if len(node.gpu_errors) >= MAX_GPU_ERRORS:
            return []
        node.gpu_errors.append(dict(e.xid))
        return [Status(f"warning: {xid_said(e.host, e.xid)}")]

    def _rank_error(self, e: ev.RankError, now: float) -> list[Action]:
        rank = self._rank(e.host, e.rank)
        if rank is None:
            return []
        rank.raised = Raised(self._corrected(e.host, e.node_time), e.text,
                             exit_call=e.exc == "SystemExit", exc=e.exc, errno=e.errno,
                             usage=e.usage, disk=e.disk, declared=e.declared)
        return self._judge_rank(rank, now)

    def _judge_rank(self, rank: RankLife, now: float) -> list[Action]:
        """A rank that ended: success, a failure (when it failed: the exception it reported,
        else its exit), or a result of our own teardown. Either report may come first."""
        failure = rank.judge(self._life[rank.record.host].stop_at, self._versions)
        return [] if failure is None else self._fail(failure, now)

    def _heartbeat(self, e: ev.Heartbeat, now: float) -> list[Action]:
        node = self._nodes[e.host]
        if e.node_time is not None and node.clock_offset is not None:
            # A frame is received after it was sent: the largest (node - head) is the best
            # estimate of the offset.
            node.clock_offset = max(node.clock_offset, round(e.node_time - self.wall(now), 3))
        if self._hang is not None:
            self._hang.heartbeat(e.host, e.idle, now)
        return []

    def _guard_stopping(self, e: ev.GuardStopping, now: float) -> list[Action]:
        if self._life[e.host].stop_at is not None:
            return []  # it is doing what the head asked
        at = self._corrected(e.host, e.node_time)
        self._enter(e.host, NodeState.STOPPING, at)
        if e.killed_by and not self._stop.killed_by:
            self._stop.killed_by = e.killed_by
        return self._fail(guard_stopped(e.host, e.reason, bool(e.signal), at), now)

    def _guard_exit(self, e: ev.GuardExit, now: float) -> list[Action]:
        node = self._nodes[e.host]
        node.guard_exit, node.reason, node.kept_pool = e.code, e.reason, e.kept_pool
        if e.nccl is not None:
            node.nccl = e.nccl
        if self._life[e.host].stop_at is not None:
            return [Status(f"{e.host}: stopped")]
        if e.code == 0:
            # torchrun exits 0 only when every rank on its node did.
            for record in (self._ranks[r].record for r in self._ranks_on[e.host]):
                if record.exit_code is None and record.started_at is not None:
                    record.exit_code = 0
            return []
        if any(f.host == e.host and f.rank is not None for f in self._failures):
            return []  # its failed rank is the news, torchrun's exit the consequence
        failure = Failure(host=e.host, rank=None, exit_code=e.code, at=self.wall(now),
                          kind=FailureKind.NODE, problem=Problem.of(
                              TORCHRUN_EXITED, None, code=e.code, error=e.error or e.reason))
        known = match_agent(e.error)
        if known is not None:
            failure.known, failure.meaning, failure.fix = known.name, known.meaning, known.fix
        return self._fail(failure, now)

    def _closed(self, e: ev.ChannelClosed, now: float) -> list[Action]:
        node = self._nodes[e.host]
        node.transport_exit, node.stderr = e.exit_code, list(e.stderr)
        life = self._life[e.host]
        if not self._enter(e.host, NodeState.STOPPED) or node.guard_exit is not None or \
                life.stop_at is not None:
            return []  # given up on before, or the end of what it was doing
        err = [line for line in e.stderr if line.strip()]
        detail = err[-1] if err else f"exit status {e.exit_code}"
        if node.ready:
            failure = Failure(host=e.host, rank=None, message=f"connection lost: {detail}",
                              kind=FailureKind.LOST,
                              fix="check the node's network and power (`ptcluster doctor`)",
                              exit_code=e.exit_code, last_lines=err, at=self.wall(now))
        else:
            # (what the channel's own words mean is the connector's to say: the event's cause)
            cause = e.cause or Problem(None, detail, "see the node log in the run directory")
            failure = Failure(host=e.host, rank=None, problem=replace(  # (its code stays)
                cause, what=f"cannot start the job: {cause.what}"), kind=FailureKind.START,
                exit_code=e.exit_code, last_lines=err, at=self.wall(now))
        return self._fail(failure, now)

    # -- checks -------------------------------------------------------------------------------
    def _check_silence(self, now: float, quiet: dict[str, float]) -> list[Action]:
        actions: list[Action] = []
        for host, node in self._nodes.items():
            silent = quiet.get(host, 0.0)
            if self._life[host].state in FINAL or not node.ready or \
                    silent <= self._opts.node_silence:
                continue
            node.reason = f"no data for {silent:.0f} s"
            # Gone as far as we can tell (its guard ends itself); what it still sends is teardown.
            self._enter(host, NodeState.LOST, self.wall(now))
            actions.append(SignalChannel(host, signal.SIGKILL))
            actions += self._fail(node_silent(host, silent, self.wall(now - silent)), now)
        return actions

    def _timing(self, e: ev.Timing, now: float) -> list[Action]:
        if self._phase is Phase.RUNNING:
            mine = {r: body for r, body in e.ranks.items() if self._rank(e.host, r) is not None}
            self._straggler.report(e.host, mine, e.node)
        return []

    def _check_straggler(self, now: float) -> list[Action]:
        """A new straggler, another one, or none any more: one line
        (``launch.supervise.straggler``)."""
        at = self.wall(now)
        if self._phase is not Phase.RUNNING or not self._straggler.due(at):
            return []
        running = {r.record.rank for r in self._ranks.values() if r.running}
        line = self._straggler.evaluate(at, running)
        return [] if line is None else [Status(line)]

    def _check_hang(self, now: float, quiet: dict[str, float]) -> list[Action]:
        """No running rank made progress for the hang timeout: collect every rank's stacks
        (the runner then calls ``hang_reported``). Once per job."""
        if self._hang is None or self._phase is not Phase.RUNNING or \
                self._hang_seen_at is not None:
            return []
        running = {r.record.rank: r.record.host for r in self._ranks.values() if r.running}
        if not self._hang.hung(running, now, quiet):
            return []
        self._hang_seen_at = now
        return [Status(f"no rank made progress for {self._hang.timeout:.0f} s: collecting "
                       "every rank's stacks"), CollectStacks(HANG)]

    def hang_reported(self, headline: str, rank: int | None, host: str | None,
                      now: float, named: tuple[int, ...] = ()) -> list[Action]:
        """The stacks of a hang are in: end the job with the hang as a failure; ``named``, the
        ranks the report says the others wait for, are ``hung`` (the teardown stops them too)."""
        assert self._hang is not None and self._hang_seen_at is not None
        for r in set(named) & set(self._ranks):
            self._ranks[r].record.hung = True
        return self._fail(hung(host or ", ".join(self._nodes), rank, headline,
                               self._hang.timeout,
                               self.wall(self._hang_seen_at - self._hang.timeout)), now)

    def _escalate(self, now: float) -> list[Action]:
        if self._stop.since is None:
            return []
        late, deadline = now - self._stop.since, self._opts.stop_deadline
        # The latest step due (one a tick: a step skipped over is not taken late).
        step = next((s for s in reversed(Escalation) if late > s.due(deadline)), None)
        if step is None:
            return []
        return [a for life in self._life.values() for a in life.escalate(step, now, deadline)]

    # -- stopping -----------------------------------------------------------------------------
    def _fail(self, failure: Failure, now: float) -> list[Action]:
        self._failures.append(failure)
        if self._phase in (Phase.STOPPING, Phase.DONE):
            return []
        return self._stop_all(failure.headline(), now)

    def _stop_all(self, reason: str, now: float, final: bool = False) -> list[Action]:
        """Every node told to stop (``final``: the user's stop, never followed by a restart:
        a guard ends the job's warm pool at once)."""
        self._phase, self._stop.since = Phase.STOPPING, now
        actions: list[Action] = [Status(f"stopping the job on every node: {reason}")]
        said = {"reason": reason, **({"final": True} if final else {})}
        for host, life in self._life.items():  # (not one that is stopping by itself)
            if life.stop_at is None and self._enter(host, NodeState.STOPPING, self.wall(now)):
                actions.append(Send(host, wire.Kind.STOP, said))
        return actions

    def _enter(self, host: str, state: NodeState, at: float | None = None) -> bool:
        return self._life[host].enter(state, at)

    def _update_done(self) -> None:
        unfinished = self._unfinished
        while unfinished and self._life[unfinished[-1]].state in FINAL:
            unfinished.pop()
        if self._phase is not Phase.DONE and not unfinished:
            self._phase = Phase.DONE

    def _rank(self, host: str, rank: int) -> RankLife | None:
        """The rank's life, if ``host`` runs that rank (else a report that makes no sense)."""
        life = self._ranks.get(rank)
        return life if life is not None and life.record.host == host else None

    def _corrected(self, host: str, node_time: float) -> float:
        return node_time - (self._nodes[host].clock_offset or 0.0)


def _unhandled(event: NoReturn) -> NoReturn:
    """(Typed ``NoReturn``: mypy fails where a kind of :data:`ev.Event` has no case above.)"""
    raise AssertionError(f"no handler for {event!r}")
