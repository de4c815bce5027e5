"""The life of one job as an explicit state machine: no I/O, no threads, no clock of its own.

``Supervisor.on_event(event, now)`` and ``.on_tick(now, quiet)`` take what happened and return
what to do (:data:`Action` values: send a frame to a node, signal a node's channel, tell the
user). The runner executes the actions; tests drive it with a fake clock.

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
from typing import Any

from ptcluster.launch.options import RunOptions
from ptcluster.launch.plan import AUTO_PORT, LaunchPlan
from ptcluster.launch.result import (
    Failure,
    FailureKind,
    NodeOutcome,
    RankRecord,
)
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
from ptcluster.launch.supervise.hang import ProgressWatch
from ptcluster.launch.supervise.states import FINAL, Escalation, NodeLife, NodeState, Phase
from ptcluster.launch.supervise.straggler import StragglerWatch
from ptcluster.launch.supervise.verdict import (
    Raised,
    guard_stopped,
    hung,
    judge,
    master_elsewhere,
    node_silent,
    not_ready,
    timed_out,
)
from ptcluster.launch.supervise.view import SupervisorView
from ptcluster.node import wire
from ptcluster.node.rank_wire import CHECKPOINT, PROGRESS_REPORTS, RESUMED, RETURNED


class Supervisor:
    def __init__(self, plan: LaunchPlan, opts: RunOptions, now: float,
                 wall_offset: float = 0.0) -> None:
        """``now`` is monotonic; ``wall_offset`` turns it into the head's wall clock."""
        self.plan = plan
        self.opts = opts
        self.wall_offset = wall_offset
        self.phase = Phase.STARTING
        self.started = now
        self.went_at: float | None = None
        self.stopping_since: float | None = None
        self._stop_requests = 0
        """Ctrl-C, SIGTERM or a caller so far: 1 stops the job, 2 cuts the channels."""
        self.nodes = {n.host: NodeOutcome(host=n.host, node_rank=n.node_rank)
                      for n in plan.nodes}
        self.life = {h: NodeLife(node) for h, node in self.nodes.items()}
        self._unfinished = list(self.life)
        """Nodes that may not be in a final state yet (a final state is never left: checked
        from the end, each node once, so the check per event does not grow with the nodes)."""
        self._not_ready = set(self.nodes)
        """Nodes not heard ready yet (so that "every node ready" is not a scan per event)."""
        self.ranks = {r: RankRecord(rank=r, host=n.host, local_rank=r - n.rank_base)
                      for n in plan.nodes for r in n.ranks}
        self._ranks_on = {n.host: n.ranks for n in plan.nodes}
        self.failures: list[Failure] = []
        self._raised: dict[int, Raised] = {}
        """When (corrected) and what an exception left a rank's code, from the rank itself."""
        self._returned: set[int] = set()
        """Ranks whose program returned (or exited 0): a death after that is in the shutdown."""
        self._rank_failure: dict[int, Failure] = {}
        self.checkpoint: int | None = None
        """The newest checkpoint step the job reported saving (``checkpoint_saved``)."""
        self.resumed_from: int | None = None
        """The step the job reported resuming from (``resumed_from``)."""
        self.first_rank_start: float | None = None
        """When the first rank started (corrected head clock)."""
        self.master_port = plan.master_port
        """The rendezvous port: the plan's, or (``auto``) the one the master's guard took."""
        self.killed_by = ""
        """Why the job ended when `ptcluster kill` ended it (from its guards' notes)."""
        beat = opts.heartbeat_for(len(plan.nodes))
        self.progress = None if opts.hang_timeout is None else ProgressWatch(
            timeout=opts.hang_timeout, fresh=max(3.0, 3 * beat))
        self.hang_seen_at: float | None = None
        self.straggler = StragglerWatch(threshold=opts.straggler_threshold,
                                        every=wire.timing_every(beat))
        """The straggler report (``launch.straggler``), fed by the guards' ``timing`` frames."""

    # -- inputs -------------------------------------------------------------------------------
    def on_event(self, event: ev.Event, now: float) -> list[Action]:
        handler = _HANDLERS.get(type(event))
        actions = handler(self, event, now) if handler else []
        self._update_done()
        return actions

    def on_tick(self, now: float, quiet: dict[str, float]) -> list[Action]:
        """Periodic checks; ``quiet[host]``: seconds since that node's channel brought data."""
        actions: list[Action] = []
        if self.phase is Phase.STARTING and now - self.started > self.opts.ready_timeout:
            slow = [h for h, life in self.life.items() if life.state is NodeState.STARTING]
            actions += self._fail(not_ready(slow or [self.plan.nodes[0].host],
                                            self.opts.ready_timeout, self.wall(now)), now)
        if (self.phase is Phase.RUNNING and self.opts.deadline is not None
                and self.went_at is not None and now - self.went_at > self.opts.deadline):
            running = [r for r in self.ranks.values() if r.exit_code is None]
            actions += self._fail(timed_out(running, self.plan.nodes[0].host,
                                            self.opts.deadline, self.wall(now)), now)
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
        if self.phase is Phase.DONE:
            return []
        self._stop_requests += 1
        if self._stop_requests == 1:
            if self.phase is not Phase.STOPPING:
                return self._stop_all(reason, now)
            return [Status(f"{reason}: the job is already being stopped everywhere")]
        if self._stop_requests > 2:
            return []
        actions: list[Action] = [Status(f"{reason} again: not waiting for the nodes, cutting "
                                        "their channels (each guard ends its job on EOF)")]
        for life in self.life.values():
            actions += life.hurry(now)
        return actions

    @property
    def interrupted(self) -> bool:
        """Stopped by a request (Ctrl-C, SIGTERM, a caller): never a failure of its own."""
        return self._stop_requests > 0

    @property
    def cut_off(self) -> list[str]:
        """Nodes given up on at the stop deadline (channel SIGKILLed): their part of the job
        may run on until their guard notices, so a restart must not use them."""
        return [h for h, life in self.life.items() if Escalation.KILL in life.steps]

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    @property
    def view(self) -> SupervisorView:
        return SupervisorView(self)

    def wall(self, now: float) -> float:
        return now + self.wall_offset

    # -- events -------------------------------------------------------------------------------
    def _hello(self, e: ev.Hello, now: float) -> list[Action]:
        node = self.nodes[e.host]
        node.clock_offset = round(e.node_time - self.wall(now), 3)
        if e.version != wire.VERSION:
            return self._fail(Failure(
                host=e.host, rank=None, at=self.wall(now), kind=FailureKind.GUARD,
                message=f"its node program speaks protocol v{e.version}, the head v"
                        f"{wire.VERSION}", fix="use the same ptcluster version everywhere"), now)
        return []

    def _ready(self, e: ev.Ready, now: float) -> list[Action]:
        self.nodes[e.host].facts = dict(e.facts)
        if self.life[e.host].state is NodeState.STARTING:
            self._enter(e.host, NodeState.READY)
        actions: list[Action] = []
        if e.facts.get("interface_source") and e.facts.get("interface_source") != "cluster file":
            actions.append(Status(f"{e.host}: sockets on {e.facts.get('interface') or '?'} "
                                  f"({e.facts['interface_source']})"))
        if e.facts.get("leases_off"):
            actions.append(Status(f"{e.host}: no leases ({e.facts['leases_off']}): other "
                                  "jobs' GPUs and ports are not checked, and `ptcluster ps` "
                                  "does not list this job there; `ptcluster setup` makes the "
                                  "directory"))
        if e.facts.get("gpus"):
            chosen = e.facts["gpus"]
            actions.append(Status(f"{e.host}: GPUs {chosen.get('visible') or 'none'}: "
                                  f"{chosen.get('why')}"))
        if e.facts.get("subreaper") is False:
            actions.append(Status(f"{e.host}: cannot become a subreaper "
                                  f"({e.facts.get('subreaper_error')}); orphans of the job "
                                  "may escape teardown"))
        self._not_ready.discard(e.host)
        if self.phase is Phase.STARTING and not self._not_ready and \
                all(life.state is NodeState.READY for life in self.life.values()):
            wrong = master_elsewhere(self.plan, {h: n.facts for h, n in self.nodes.items()},
                                     self.wall(now))
            if wrong is not None:
                return actions + self._fail(wrong, now)
            self.phase, self.went_at = Phase.RUNNING, now
            told = None
            if self.plan.master_port == AUTO_PORT:  # the port the master's guard leased
                self.master_port = int(self.nodes[self.plan.nodes[0].host].facts
                                       .get("master_port") or 0)
                told = {"master_port": self.master_port}
                actions.append(Status(f"rendezvous port {self.master_port} (auto: the first "
                                      f"free one on {self.plan.nodes[0].host})"))
            actions.append(Status(f"all {len(self.nodes)} node(s) ready in "
                                  f"{now - self.started:.2f} s; starting "
                                  f"{self.plan.world_size} rank(s)"))
            for host in self.nodes:
                self._enter(host, NodeState.RUNNING)
                actions.append(Send(host, "go", told))
        return actions

    def _node_output(self, e: ev.AgentOutput | ev.Malformed | ev.RankOutput,
                     now: float) -> list[Action]:
        """The node's own lines (torchrun, ssh), and frames that are not what they should be
        (the output of a rank the node does not run: rank lines take the runner's short path)."""
        text = e.text if isinstance(e, ev.AgentOutput) else e.line \
            if isinstance(e, ev.Malformed) else f"(rank {e.rank}?) {e.text}"
        return [NodeLine(e.host, text, show=self.stopping_since is None)]

    def _rank_data(self, e: ev.RankData, now: float) -> list[Action]:
        if e.data.get("kind") in PROGRESS_REPORTS:  # the job's life: ours; the rest: the caller's
            return self._progress(e, now)
        return [DeliverData(e.host, e.rank, e.data)]

    def _stacks(self, e: ev.StacksReply, now: float) -> list[Action]:
        return [StacksAnswered(e)]

    def _started(self, e: ev.Started, now: float) -> list[Action]:
        self.nodes[e.host].facts["torchrun_pid"] = e.pid
        return []

    def _guard_refused(self, e: ev.GuardRefused, now: float) -> list[Action]:
        return self._fail(Failure(host=e.host, rank=None, message=e.problem, fix=e.fix or None,
                                  kind=FailureKind.BUSY if e.busy else FailureKind.GUARD,
                                  at=self.wall(now)), now)

    def _rank_start(self, e: ev.RankStart, now: float) -> list[Action]:
        record = self._rank(e.host, e.rank)
        if record is not None:
            record.started_at = self._corrected(e.host, e.node_time)
            if self.first_rank_start is None or record.started_at < self.first_rank_start:
                self.first_rank_start = record.started_at
        return []

    def _progress(self, e: ev.RankData, now: float) -> list[Action]:
        """The job's own progress reports: a checkpoint saved, the step it resumed from; and
        from the rank's shim: its program returned (what is left is the interpreter's exit)."""
        record = self._rank(e.host, e.rank)
        if e.data.get("kind") == RETURNED and record is not None:
            self._returned.add(e.rank)
            return self._judge(record, now) if record.ended_at is not None else []
        step = e.data.get("step")
        if type(step) is not int or self._rank(e.host, e.rank) is None:
            return []
        if e.data.get("kind") == CHECKPOINT:
            self.checkpoint = step if self.checkpoint is None else max(self.checkpoint, step)
        elif e.data.get("kind") == RESUMED:
            self.resumed_from = step if self.resumed_from is None else min(self.resumed_from,
                                                                           step)
        return []

    def _rank_exit(self, e: ev.RankExit, now: float) -> list[Action]:
        record = self._rank(e.host, e.rank)
        if record is None:
            return []
        record.exit_code, record.duration = e.code, e.duration
        record.ended_at = self._corrected(e.host, e.node_time)
        return self._judge(record, now)

    def _rank_error(self, e: ev.RankError, now: float) -> list[Action]:
        record = self._rank(e.host, e.rank)
        if record is None:
            return []
        self._raised[e.rank] = Raised(self._corrected(e.host, e.node_time), e.text,
                                      exit_call=e.exc == "SystemExit")
        return self._judge(record, now) if record.ended_at is not None else []

    def _judge(self, record: RankRecord, now: float) -> list[Action]:
        """A rank that ended: success, a failure (when it failed: the exception it reported,
        else its exit), or a result of our own teardown. Either report may come first."""
        verdict = judge(record, self._raised.get(record.rank), record.rank in self._returned,
                        self.life[record.host].stop_at)
        if verdict is None:
            return []
        record.stopped = verdict.stopped
        if verdict.stopped:
            return []
        known = self._rank_failure.get(record.rank)
        if known is not None:  # the second report of the same failure: refine it
            known.at, known.message, known.fix = verdict.at, verdict.message, verdict.fix
            return []
        failure = Failure(host=record.host, rank=record.rank, message=verdict.message,
                          exit_code=record.exit_code, at=verdict.at, fix=verdict.fix)
        self._rank_failure[record.rank] = failure
        return self._fail(failure, now)

    def _heartbeat(self, e: ev.Heartbeat, now: float) -> list[Action]:
        node = self.nodes[e.host]
        if e.node_time is not None and node.clock_offset is not None:
            # A frame is received after it was sent: the largest (node - head) is the best
            # estimate of the offset.
            node.clock_offset = max(node.clock_offset, round(e.node_time - self.wall(now), 3))
        if self.progress is not None:
            self.progress.heartbeat(e.host, e.idle, now)
        return []

    def _guard_stopping(self, e: ev.GuardStopping, now: float) -> list[Action]:
        if self.life[e.host].stop_at is not None:
            return []  # it is doing what the head asked
        at = self._corrected(e.host, e.node_time)
        self._enter(e.host, NodeState.STOPPING, at)
        if e.killed_by and not self.killed_by:
            self.killed_by = e.killed_by
        return self._fail(guard_stopped(e.host, e.reason, bool(e.signal), at), now)

    def _guard_exit(self, e: ev.GuardExit, now: float) -> list[Action]:
        node = self.nodes[e.host]
        node.guard_exit, node.reason = e.code, e.reason
        if self.life[e.host].stop_at is not None:
            return [Status(f"{e.host}: stopped")]
        if e.code == 0:
            # torchrun exits 0 only when every rank on its node did.
            for record in (self.ranks[r] for r in self._ranks_on[e.host]):
                if record.exit_code is None and record.started_at is not None:
                    record.exit_code = 0
            return []
        if any(f.host == e.host and f.rank is not None for f in self.failures):
            return []  # its failed rank is the news, torchrun's exit the consequence
        return self._fail(Failure(host=e.host, rank=None, exit_code=e.code, at=self.wall(now),
                                  kind=FailureKind.NODE,
                                  message=f"torchrun exited with code {e.code} ({e.reason})"),
                          now)

    def _closed(self, e: ev.ChannelClosed, now: float) -> list[Action]:
        node = self.nodes[e.host]
        node.transport_exit, node.stderr = e.exit_code, list(e.stderr)
        life = self.life[e.host]
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
            problem, fix = e.cause or (detail, "see the node log in the run directory")
            failure = Failure(host=e.host, rank=None, message=f"cannot start the job: {problem}",
                              kind=FailureKind.START,
                              fix=fix, exit_code=e.exit_code, last_lines=err, at=self.wall(now))
        return self._fail(failure, now)

    # -- checks -------------------------------------------------------------------------------
    def _check_silence(self, now: float, quiet: dict[str, float]) -> list[Action]:
        actions: list[Action] = []
        for host, node in self.nodes.items():
            silent = quiet.get(host, 0.0)
            if self.life[host].state in FINAL or not node.ready or \
                    silent <= self.opts.node_silence:
                continue
            node.reason = f"no data for {silent:.0f} s"
            # Gone as far as we can tell (its guard ends itself); what it still sends is teardown.
            self._enter(host, NodeState.LOST, self.wall(now))
            actions.append(SignalChannel(host, signal.SIGKILL))
            actions += self._fail(node_silent(host, silent, self.wall(now - silent)), now)
        return actions

    def _timing(self, e: ev.Timing, now: float) -> list[Action]:
        if self.phase is Phase.RUNNING:
            mine = {r: body for r, body in e.ranks.items() if self._rank(e.host, r) is not None}
            self.straggler.report(e.host, mine, e.node)
        return []

    def _check_straggler(self, now: float) -> list[Action]:
        """A new straggler, another one, or none any more: one line (``launch.straggler``)."""
        at = self.wall(now)
        if self.phase is not Phase.RUNNING or not self.straggler.due(at):
            return []
        running = {r.rank for r in self.ranks.values()
                   if r.started_at is not None and r.ended_at is None}
        line = self.straggler.evaluate(at, running)
        return [] if line is None else [Status(line)]

    def _check_hang(self, now: float, quiet: dict[str, float]) -> list[Action]:
        """No running rank made progress for the hang timeout: collect every rank's stacks
        (the runner then calls ``hang_reported``). Once per job."""
        if self.progress is None or self.phase is not Phase.RUNNING or \
                self.hang_seen_at is not None:
            return []
        running = {r.rank: r.host for r in self.ranks.values()
                   if r.started_at is not None and r.ended_at is None}
        if not self.progress.hung(running, now, quiet):
            return []
        self.hang_seen_at = now
        return [Status(f"no rank made progress for {self.progress.timeout:.0f} s: collecting "
                       "every rank's stacks"), CollectStacks("hang")]

    def hang_reported(self, headline: str, rank: int | None, host: str | None,
                      now: float) -> list[Action]:
        """The stacks of a hang are in: end the job with the hang as a failure."""
        assert self.progress is not None and self.hang_seen_at is not None
        return self._fail(hung(host or ", ".join(self.nodes), rank, headline,
                               self.progress.timeout,
                               self.wall(self.hang_seen_at - self.progress.timeout)), now)

    def _escalate(self, now: float) -> list[Action]:
        if self.stopping_since is None:
            return []
        late, deadline = now - self.stopping_since, self.opts.stop_deadline
        # The latest step due (one a tick: a step skipped over is not taken late).
        step = next((s for s in reversed(Escalation) if late > s.due(deadline)), None)
        if step is None:
            return []
        return [a for life in self.life.values() for a in life.escalate(step, now, deadline)]

    # -- stopping -----------------------------------------------------------------------------
    def _fail(self, failure: Failure, now: float) -> list[Action]:
        self.failures.append(failure)
        if self.phase in (Phase.STOPPING, Phase.DONE):
            return []
        return self._stop_all(failure.headline(), now)

    def _stop_all(self, reason: str, now: float) -> list[Action]:
        self.phase, self.stopping_since = Phase.STOPPING, now
        actions: list[Action] = [Status(f"stopping the job on every node: {reason}")]
        for host, life in self.life.items():  # (not one that is stopping by itself)
            if life.stop_at is None and self._enter(host, NodeState.STOPPING, self.wall(now)):
                actions.append(Send(host, "stop", {"reason": reason}))
        return actions

    def _enter(self, host: str, state: NodeState, at: float | None = None) -> bool:
        return self.life[host].enter(state, at)

    def _update_done(self) -> None:
        unfinished = self._unfinished
        while unfinished and self.life[unfinished[-1]].state in FINAL:
            unfinished.pop()
        if self.phase is not Phase.DONE and not unfinished:
            self.phase = Phase.DONE

    # -- results ------------------------------------------------------------------------------
    def ordered_failures(self) -> list[Failure]:
        """Every failure, earliest first (rank failures before others at the same time)."""
        return sorted(self.failures, key=lambda f: (f.at, f.rank is None))

    def _rank(self, host: str, rank: int) -> RankRecord | None:
        record = self.ranks.get(rank)
        return record if record is not None and record.host == host else None

    def _corrected(self, host: str, node_time: float) -> float:
        return node_time - (self.nodes[host].clock_offset or 0.0)


_HANDLERS: dict[type, Any] = {
    ev.Hello: Supervisor._hello, ev.Ready: Supervisor._ready,
    ev.GuardRefused: Supervisor._guard_refused, ev.RankStart: Supervisor._rank_start,
    ev.RankExit: Supervisor._rank_exit, ev.RankError: Supervisor._rank_error,
    ev.GuardExit: Supervisor._guard_exit, ev.ChannelClosed: Supervisor._closed,
    ev.Heartbeat: Supervisor._heartbeat, ev.GuardStopping: Supervisor._guard_stopping,
    ev.RankData: Supervisor._rank_data, ev.Started: Supervisor._started,
    ev.AgentOutput: Supervisor._node_output, ev.Malformed: Supervisor._node_output,
    ev.RankOutput: Supervisor._node_output, ev.StacksReply: Supervisor._stacks,
    ev.Timing: Supervisor._timing,
}
