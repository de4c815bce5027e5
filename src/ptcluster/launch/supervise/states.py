"""The states of a job on the head: the job's :class:`Phase`, each node's :class:`NodeState`
with its transitions, and the teardown steps for a node that does not end (:class:`Escalation`);
all of one attempt together in :class:`JobState`, what the supervisor knows and the runner reads.

The supervisor keeps one :class:`NodeLife` per node; ``NodeLife.enter`` is the only place a
node's state changes (and with it ``NodeOutcome.ready``/``closed`` of the result). Each rank's
reports are kept together in one :class:`RankLife`, judged there when the rank ends; the job's
stop in one :class:`StopRecord`.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field, replace
from enum import Enum

from ptcluster.errors import Problem
from ptcluster.launch.options import RunOptions
from ptcluster.launch.plan import LaunchPlan
from ptcluster.launch.result import Failure, NodeOutcome, RankRecord
from ptcluster.launch.supervise.actions import Action, Send, SignalChannel, Status
from ptcluster.launch.supervise.hang import HangWatch
from ptcluster.launch.supervise.known import VERSIONS, order_failures, versions_said
from ptcluster.launch.supervise.readmit import CheckpointReports, Readmissions
from ptcluster.launch.supervise.straggler import Report, StragglerWatch
from ptcluster.launch.supervise.verdict import Raised, judge_rank
from ptcluster.node import wire

KILL_AFTER = 4.0
"""Seconds after the channel's SIGTERM before SIGKILL and giving up on the node."""


class Phase(Enum):
    """The job's (one attempt's) phase."""

    STARTING = "starting"
    """Guards connect and check their node."""
    RUNNING = "running"
    """Every node said ready, the head said go."""
    STOPPING = "stopping"
    """A failure, a stop request or the deadline: every node told to stop, then escalation."""
    DONE = "done"
    """Every node STOPPED or LOST."""


class NodeState(Enum):
    """One node's part of the job as the head knows it (cf. torch elastic's ``WorkerState``).

    STARTING -> READY -> RUNNING -> STOPPING -> STOPPED or LOST; a node may also go to STOPPING,
    STOPPED or LOST from any earlier state. STOPPED and LOST are final: what still comes from
    such a node changes nothing."""

    STARTING = "starting"
    """Its channel is started; its guard connects and checks the node."""
    READY = "ready"
    """Its guard passed its checks and waits for go."""
    RUNNING = "running"
    """Told go: torchrun and the node's ranks run."""
    STOPPING = "stopping"
    """Told to stop, or its guard began stopping on its own: a rank's end now is teardown."""
    STOPPED = "stopped"
    """Its channel closed (each guard ends its part of the job when its channel closes)."""
    LOST = "lost"
    """Given up on: silent for ``node_silence``, or its channel cut at the stop deadline (its
    ranks may run on until its guard notices)."""


FINAL = frozenset({NodeState.STOPPED, NodeState.LOST})
NEXT: dict[NodeState, frozenset[NodeState]] = {
    NodeState.STARTING: frozenset({NodeState.READY, NodeState.STOPPING}) | FINAL,
    NodeState.READY: frozenset({NodeState.RUNNING, NodeState.STOPPING}) | FINAL,
    NodeState.RUNNING: frozenset({NodeState.STOPPING}) | FINAL,
    NodeState.STOPPING: FINAL,
    NodeState.STOPPED: frozenset(), NodeState.LOST: frozenset(),
}
"""The transitions a node may take (anything else is ignored)."""


class Escalation(Enum):
    """The head's steps for a node not ended after stop, in order, each taken once."""

    RESEND = wire.Kind.STOP
    """Half the stop deadline: stop sent again."""
    TERM = "term"
    """The stop deadline: its channel gets SIGTERM."""
    KILL = "kill"
    """``KILL_AFTER`` later: its channel is cut (SIGKILL) and the node given up on (LOST)."""

    def due(self, stop_deadline: float) -> float:
        """Seconds after the stop when this step is taken."""
        return {Escalation.RESEND: stop_deadline / 2, Escalation.TERM: stop_deadline,
                Escalation.KILL: stop_deadline + KILL_AFTER}[self]


@dataclass
class StopRecord:
    """The job's stop as the supervisor keeps it, in one place (each node's own stop and
    escalation steps: its :class:`NodeLife`)."""

    since: float | None = None
    """When the head began stopping every node (monotonic); None while it has not."""
    requests: int = 0
    """Stop requests so far (Ctrl-C, SIGTERM, a caller): 1 stops the job, 2 cuts the channels."""
    killed_by: str = ""
    """``ended by `ptcluster kill` from HOST (user)`` when a guard said so, else ""."""


@dataclass
class NodeLife:
    """A node's state, its stop and its escalation, as the supervisor tracks them."""

    outcome: NodeOutcome
    """Its record in the result: ``ready`` and ``closed`` follow the state (set in ``enter``)."""
    state: NodeState = NodeState.STARTING
    stop_at: float | None = None
    """Head wall time at which it was told to stop (for a guard that began on its own: its
    time, corrected); what its ranks do from then on is teardown."""
    steps: dict[Escalation, float] = field(default_factory=dict)
    """Each escalation step taken, with when (monotonic)."""

    @property
    def facts(self) -> wire.ReadyFacts:
        """What its guard reported at ready (``{}`` before), kept in its record."""
        return self.outcome.facts

    def enter(self, state: NodeState, at: float | None = None) -> bool:
        """The one place a node changes state (``at``: for STOPPING and LOST, when it was told
        to stop, unless it was before). False: not a transition from where the node is."""
        if state not in NEXT[self.state]:
            return False
        self.state = state
        if state in (NodeState.STOPPING, NodeState.LOST) and self.stop_at is None:
            self.stop_at = at
        self.outcome.ready = self.outcome.ready or state is NodeState.READY
        self.outcome.closed = state in FINAL
        return True

    def escalate(self, step: Escalation, now: float, stop_deadline: float) -> list[Action]:
        """Take ``step`` for this node unless it is ended or took it already."""
        if self.state in FINAL or step in self.steps:
            return []
        self.steps[step] = now
        host = self.outcome.host
        actions: list[Action]
        if step is Escalation.RESEND:
            note = "not ended yet: stop sent again"
            actions = [Send(host, wire.Kind.STOP, {"reason": "stop deadline"})]
        elif step is Escalation.TERM:
            note = f"not ended {stop_deadline:.0f} s after stop: its channel gets SIGTERM"
            actions = [SignalChannel(host, signal.SIGTERM)]
        else:
            note = "still not ended: its channel was cut (SIGKILL); the node's guard ends " \
                   "the job when it notices"
            actions = [SignalChannel(host, signal.SIGKILL)]
            self.outcome.reason = self.outcome.reason or \
                "given up: channel cut after the stop deadline"
            self.enter(NodeState.LOST)
        self.outcome.escalations.append(note)
        return [*actions, Status(f"{host}: {note}")]

    def hurry(self, now: float) -> list[Action]:
        """A second stop request: skip the wait, SIGTERM its channel now (the steps up to it
        count as taken); its guard ends its part of the job when the channel closes."""
        if self.state in FINAL:
            return []
        self.steps.setdefault(Escalation.RESEND, now)
        self.steps.setdefault(Escalation.TERM, now)
        return [SignalChannel(self.outcome.host, signal.SIGTERM)]


@dataclass
class RankLife:
    """A rank as the supervisor tracks it: its record in the result and what the rank itself
    reported, whichever report comes first (its exit, what its code raised, its return)."""

    record: RankRecord
    """Its record in the result: start, exit status, end (head clock), ``stopped``."""
    raised: Raised | None = None
    """When (corrected) and what an exception left its code, from the rank itself."""
    returned: bool = False
    """Its program returned (or exited 0): a death after that is in the interpreter's shutdown."""
    oom: wire.OomFacts | None = None
    """The kernel's OOM kills its guard found when it ended (its exit's ``oom``)."""
    xids: tuple[wire.XidFacts, ...] = ()
    """The GPU driver's Xids its guard tied to it when it ended (its exit's ``xids``)."""
    failure: Failure | None = None
    """The failure it was found to be (a second report refines it, never adds one)."""

    @property
    def running(self) -> bool:
        """Started, not ended."""
        return self.record.started_at is not None and self.record.ended_at is None

    def judge(self, stop_at: float | None,
              versions: dict[str, dict[str, str]] | None = None) -> Failure | None:
        """Once it ended: a failure that is news, or None (it succeeded, has not ended, ended
        in the teardown of ``stop_at`` (its node's), or was judged before: then refined).
        ``versions``: the nodes' versions that differ (``known.differing_versions``), the
        explanation of a failure that has none of its own (``known.VERSIONS``; its facts'
        ``versions`` then)."""
        record = self.record
        verdict = judge_rank(record, self.raised, self.returned, stop_at, self.oom, self.xids)
        if verdict is None:
            return None
        record.stopped = verdict.stopped
        if verdict.stopped:
            return None
        known, fix, facts = verdict.known, verdict.fix, verdict.facts
        if known is None and fix is None and versions:
            known, fix = VERSIONS, f"{VERSIONS.fix} ({versions_said(versions)})"
            facts = {**facts, "versions": versions}
        if self.failure is None:
            self.failure = Failure(host=record.host, rank=record.rank, message="",
                                   exit_code=record.exit_code)
            news: Failure | None = self.failure
        else:  # the second report of the same failure: refine it
            news = None
        failure = self.failure
        failure.at = verdict.at
        # a declared problem brings its code and fields; words alone, none
        failure.problem = (verdict.declared or Problem(None, "")).by(failure.who)
        failure.message, failure.fix = verdict.message, fix
        failure.kind, failure.facts, failure.exit_code = verdict.kind, facts, record.exit_code
        failure.known, failure.meaning = (None, None) if known is None else \
            (known.name, known.meaning)
        return news


class JobState:
    """One attempt of a job as the head knows it: its phase and stop, every node's and rank's
    life, the failures, the job's own reports. Only the supervisor (its subclass) changes it;
    the runner reads it through the properties below, each a fresh list, a copy or a value
    (torch elastic's ``get_worker_group``: the agent's own read-only view, no second object)."""

    def __init__(self, plan: LaunchPlan, opts: RunOptions, now: float,
                 wall_offset: float = 0.0) -> None:
        """``now`` is monotonic; ``wall_offset`` turns it into the head's wall clock."""
        self._plan, self._opts, self._wall_offset = plan, opts, wall_offset
        self._phase = Phase.STARTING
        self._started_at = now
        self._went_at: float | None = None
        self._stop = StopRecord()
        self._nodes = {n.host: NodeOutcome(host=n.host, node_rank=n.node_rank)
                       for n in plan.nodes}
        self._life = {h: NodeLife(node) for h, node in self._nodes.items()}
        self._unfinished = list(self._life)
        """Nodes that may not be in a final state yet (a final state is never left: checked
        from the end, each node once, so the check per event does not grow with the nodes)."""
        self._not_ready = set(self._nodes)
        """Nodes not heard ready yet (so that "every node ready" is not a scan per event)."""
        self._ranks = {r: RankLife(RankRecord(rank=r, host=n.host, local_rank=r - n.rank_base))
                       for n in plan.nodes for r in n.ranks}
        self._ranks_on = {n.host: n.ranks for n in plan.nodes}
        self._failures: list[Failure] = []
        self._versions: dict[str, dict[str, str]] = {}
        """The torch or NCCL versions that differ between the nodes
        (``known.differing_versions``, read once every node is ready), {} where they agree."""
        self._checkpoint: int | None = None
        self._checkpoint_paths: dict[str, str] = {}
        """Per node: where the job said it saved its last checkpoint there."""
        self._resumed_from: int | None = None
        self._reports = CheckpointReports()
        """Every rank's checkpoint steps (the step every rank saved: ``run --readmit``)."""
        self._readmit = Readmissions()
        """The nodes back to be taken back by a planned restart, and its step once due."""
        self._first_rank_start: float | None = None
        self._master_port = plan.master_port
        beat = opts.heartbeat_for(len(plan.nodes))
        self._hang = None if opts.hang_timeout is None else HangWatch(
            timeout=opts.hang_timeout, fresh=max(3.0, 3 * beat))
        self._hang_seen_at: float | None = None
        self._straggler = StragglerWatch(threshold=opts.straggler_threshold,
                                         every=wire.timing_every(beat))
        """The straggler report (``straggler``), fed by the guards' ``timing`` frames."""

    def wall(self, now: float) -> float:
        """The head's wall clock at monotonic ``now``."""
        return now + self._wall_offset

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def done(self) -> bool:
        """Every node STOPPED or LOST: the attempt is over."""
        return self._phase is Phase.DONE

    @property
    def stopping(self) -> bool:
        """The job is being (or was) stopped: a node's lines are logged, not shown."""
        return self._stop.since is not None

    @property
    def interrupted(self) -> bool:
        """Stopped by a request (Ctrl-C, SIGTERM, a caller): never a failure of its own."""
        return self._stop.requests > 0

    @property
    def killed_by(self) -> str:
        """``ended by `ptcluster kill` from HOST (user)``, or ""."""
        return self._stop.killed_by

    @property
    def cut_off(self) -> list[str]:
        """Nodes given up on at the stop deadline (channel SIGKILLed): their part of the job
        may run on until their guard notices, so a restart must not use them."""
        return [h for h, life in self._life.items() if Escalation.KILL in life.steps]

    @property
    def askable(self) -> list[str]:
        """Nodes whose ranks may be asked for stacks: ready or running, not told to stop."""
        return [h for h, life in self._life.items()
                if life.state in (NodeState.READY, NodeState.RUNNING)]

    @property
    def master_port(self) -> int:
        """The rendezvous port: the plan's, or (``auto``) the one the master's guard took (0
        before)."""
        return self._master_port

    @property
    def checkpoint(self) -> int | None:
        """The newest checkpoint step the job reported saving (``checkpoint_saved``)."""
        return self._checkpoint

    @property
    def checkpoint_paths(self) -> dict[str, str]:
        """Per node, where its last checkpoint was saved (when the job said: ``path``)."""
        return dict(self._checkpoint_paths)

    @property
    def planned(self) -> int | None:
        """The step of the planned restart that stopped the job (``run --readmit``), or None."""
        return self._readmit.step

    @property
    def planned_at(self) -> float | None:
        """When the planned restart began stopping the job (head wall clock), or None."""
        return self._readmit.at

    @property
    def readmit(self) -> tuple[str, ...]:
        """The nodes the planned restart takes back (seen back and fit), in that order."""
        return self._readmit.waiting if self._readmit.step is not None else ()

    @property
    def resumed_from(self) -> int | None:
        """The step the job reported resuming from (``resumed_from``)."""
        return self._resumed_from

    @property
    def first_rank_start(self) -> float | None:
        """When the first rank started (corrected head clock)."""
        return self._first_rank_start

    @property
    def failures(self) -> list[Failure]:
        """Every failure, earliest first (rank failures before others at the same time), but a
        peer's reset never before the death it follows (``known.order_failures``): the root
        cause is the first, whatever order the news arrived in."""
        return order_failures(self._failures)

    @property
    def ranks(self) -> list[RankRecord]:
        """Every rank's record, by rank."""
        return [self._ranks[r].record for r in sorted(self._ranks)]

    @property
    def nodes(self) -> list[NodeOutcome]:
        """Every node's record, in the plan's order."""
        return [self._nodes[n.host] for n in self._plan.nodes]

    def node(self, host: str) -> NodeOutcome:
        return self._nodes[host]

    def node_life(self, host: str) -> NodeLife:
        """A copy of the node's life: its state, when it was told to stop, its escalation."""
        life = self._life[host]
        return replace(life, steps=dict(life.steps))

    @property
    def straggler_version(self) -> int:
        """Counts the timing reports taken: ``straggler_figures`` changes only with it."""
        return self._straggler.version

    def straggler_figures(self) -> Report:
        """The straggler report's current figures (``StragglerWatch.to_json``: built anew, for
        8192 ranks ~80 ms)."""
        return self._straggler.to_json()
