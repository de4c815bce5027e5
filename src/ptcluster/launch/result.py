"""What a run produced: per-rank and per-node records, failures, attempts, ``summary.json``.

Outputs only: the runner's knobs are ``launch.options``."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ptcluster.errors import Problem
from ptcluster.launch.supervise.straggler import Report
from ptcluster.node.wire import NcclChoice, ReadyFacts

if TYPE_CHECKING:
    from ptcluster.launch.stacks.report import StackReport


HUNG = "hung (named by the hang report)"
"""A rank's status when the hang report named it (``RankRecord.hung``)."""


@dataclass(kw_only=True)
class RankRecord:
    rank: int
    host: str
    local_rank: int
    started_at: float | None = None
    """Head clock (node clock corrected by the offset measured at hello)."""
    exit_code: int | None = None
    """Wait status: >= 0 an exit code, < 0 killed by that signal, None unknown."""
    ended_at: float | None = None
    """Head clock, corrected like ``started_at``."""
    duration: float | None = None
    python: str = ""
    """The interpreter the rank ran on (its ``sys.executable``, as its shim reported)."""
    stopped: bool = False
    """It ended after its node was told to stop: a result of the teardown, not a cause."""
    hung: bool = False
    """``--hang-timeout``: the hang report named it as the rank the others wait for (its
    straggler); the teardown that followed stopped it like the rest, but it is the cause."""

    @property
    def status(self) -> str:
        if self.exit_code == 0:
            return "ok"
        if self.hung:
            return HUNG
        if self.stopped:
            return "stopped (job teardown)"
        if self.exit_code is None:
            return "not started" if self.started_at is None else "lost (no exit status)"
        if self.exit_code < 0:
            return f"killed by {signame(-self.exit_code)}"
        return f"exit {self.exit_code}"


@dataclass(kw_only=True)
class NodeOutcome:
    host: str
    node_rank: int
    ready: bool = False
    facts: ReadyFacts = field(default_factory=ReadyFacts)
    """What the guard reported at ready (checked: ``remote.guard_replies.ready_facts``):
    hostname, interface (and how it was chosen), ..."""
    clock_offset: float | None = None
    """Node clock minus head clock (s), measured at hello; within one-way latency."""
    guard_exit: int | None = None
    reason: str = ""
    transport_exit: int | None = None
    stderr: list[str] = field(default_factory=list)
    escalations: list[str] = field(default_factory=list)
    """Teardown steps the head had to take for this node (stop resent, channel signalled)."""
    closed: bool = False
    """The channel is finished: ended, or given up on by the head."""
    after_loss: dict[str, Any] | None = None
    """Lost: what it answered when asked once more (``launch.lost``), ``{"answered": False}``
    when it did not."""
    nccl: NcclChoice | None = None
    """What NCCL chose there, from its own log (``launch.supervise.events.nccl_chosen``)."""
    gpu_errors: list[dict[str, Any]] = field(default_factory=list)
    """The GPU driver's Xids on the node while the job ran (``wire.XidFacts``)."""
    kept_pool: bool | None = None
    """Whether its guard handed the job's warm pool on to the next attempt, as its exit frame
    said (None: no exit frame came)."""


class FailureKind(str, Enum):
    """What failed (a ``str`` enum: ``summary.json`` shows the value)."""

    RANK = "rank"
    """A rank's own failure."""
    LOST = "lost"
    """A node stopped answering, its channel closed, or its guard ended the job on its own."""
    START = "start"
    """A node could not start its part (not reachable, not ready in time)."""
    GUARD = "guard"
    """A node's checks or its guard."""
    NODE = "node"
    """torchrun itself."""
    TIMEOUT = "timeout"
    """The job's deadline."""
    HANG = "hang"
    """No rank made progress for ``--hang-timeout``."""
    BUSY = "busy"
    """A node refused only because another job holds what this one asks for (GPUs, a port)."""
    OOM = "oom"
    """A rank (or a process of its tree) was killed by the kernel's out-of-memory killer."""
    DISK = "disk"
    """A rank's filesystem was full (ENOSPC, EDQUOT)."""
    GPU = "gpu"
    """A rank failed after the GPU driver reported an Xid for its process or its GPU."""
    UNHEALTHY = "unhealthy"
    """A node refused by its health gate (``node.facts.health``): too few GPUs, a nearly full disk,
    too little memory. A restart leaves it out, like a lost node."""
    ENVIRONMENT = "environment"
    """A node refused because the project's environment the head expected is missing or
    changed there: the runner ships and builds it, then launches again (once)."""

    def __str__(self) -> str:
        return self.value


@dataclass(init=False)
class Failure:
    """One thing that went wrong; the earliest (on a corrected clock) is the root cause.

    What went wrong is its one :class:`Problem` (``problem``: who, the rank or node; what; the
    fix; the code of a declared one and its fields); ``message`` and ``fix`` are its what and
    fix, and setting them sets the problem's."""

    host: str
    rank: int | None
    problem: Problem
    kind: FailureKind
    exit_code: int | None
    at: float
    """When it happened, head clock (for a rank: its node's time, corrected)."""
    last_lines: list[str]
    facts: dict[str, Any]
    """What the node saw of it (``oom``: the kernel's kills, ``disk``: the full filesystem)."""
    known: str | None
    """The known failure it is, by name (``launch.supervise.known``; ``fix`` is its fix)."""
    meaning: str | None
    """What that known failure means."""

    def __init__(self, *, host: str, rank: int | None, message: str = "",
                 kind: FailureKind | str = FailureKind.RANK, fix: str | None = None,
                 exit_code: int | None = None, at: float = 0.0,
                 last_lines: list[str] | None = None, facts: dict[str, Any] | None = None,
                 known: str | None = None, meaning: str | None = None,
                 problem: Problem | None = None) -> None:
        """``message`` and ``fix`` in words, or the ``problem`` itself (its who is replaced by
        this failure's: the rank on its node, or the node)."""
        self.host, self.rank = host, rank
        self.kind = FailureKind(kind)  # a kind's name ("lost") is taken, an unknown one not
        self.problem = (problem or Problem(None, message, fix)).by(self.who)
        self.exit_code, self.at, self.known, self.meaning = exit_code, at, known, meaning
        self.last_lines = [] if last_lines is None else last_lines
        self.facts = {} if facts is None else facts

    @property
    def who(self) -> str:
        """``rank 3 on node2``, or the node for a failure that is not one rank's."""
        return f"rank {self.rank} on {self.host}" if self.rank is not None else self.host

    @property
    def message(self) -> str:
        return self.problem.what

    @message.setter
    def message(self, what: str) -> None:
        self.problem = replace(self.problem, what=what)

    @property
    def fix(self) -> str | None:
        return self.problem.fix

    @fix.setter
    def fix(self, fix: str | None) -> None:
        self.problem = replace(self.problem, fix=fix)

    @property
    def code(self) -> str | None:
        """The declared problem it is (``guard.*``, ``health.*``, ``node.*``), or the known
        failure it is (``known.NAME``: ``launch.supervise.known``'s table); None otherwise."""
        return self.problem.code or (f"known.{self.known}" if self.known else None)

    def headline(self) -> str:
        return str(self.problem)


class Outcome(str, Enum):
    """How a run ended, one word: the exit code follows from it by one table
    (``cli.exits.for_outcome``), ``summary.json`` says it as ``outcome``."""

    SUCCEEDED = "succeeded"
    """Every rank of the last attempt exited 0."""
    FAILED = "failed"
    """A rank failed or a node was lost, and no restart followed (or restarts were spent)."""
    HUNG = "hung"
    """``--hang-timeout``: no rank made progress for that long."""
    NO_PROGRESS = "no progress"
    """The restarts gave up: an attempt saved no newer checkpoint."""
    INTERRUPTED = "interrupted"
    """Stopped by a signal to the head (Ctrl-C, SIGTERM) or ``ptcluster kill``."""
    ENDED_OUTSIDE = "ended outside"
    """Slurm ended it (scancel, the time limit, preemption, a requeue)."""
    PLANNED_RESTART = "planned restart"
    """An attempt the head stopped at a checkpoint every rank saved, to take back a node that
    answers again (``run --readmit``): not a failure, and always followed by the attempt that
    takes the node back (so a whole run never ends with it)."""


@dataclass(kw_only=True)
class RunResult:
    job_id: str
    run_dir: Path
    ranks: list[RankRecord]
    nodes: list[NodeOutcome]
    failures: list[Failure]
    interrupted: bool
    duration: float
    console_dropped: int = 0
    """Lines the console skipped because it could not keep up (all are in the logs)."""
    log_errors: list[str] = field(default_factory=list)
    """Logs that could not be written, with the first error and the lines they miss."""
    attempts: list[AttemptRecord] = field(default_factory=list)
    """Every attempt of the job in order (one unless ``--max-restarts`` restarted it)."""
    gave_up: str = ""
    """Why no further attempt was made after a failed one ("" when none failed, or no restarts
    were allowed)."""
    gave_up_problem: Problem | None = None
    """``gave_up`` as its declared problem (``supervise.restart.GAVE_UP``: its code and
    fields); None for a stop (said in words)."""
    no_progress: bool = False
    """The restart rule gave up because an attempt saved no newer checkpoint (exit 3)."""
    hang_report: StackReport | None = None
    """Every rank's stacks when the job was found hung (``StackReport.to_json``)."""
    straggler: Report | None = None
    """The straggler report of the last attempt: every rank's wait share (window and whole
    attempt), the current straggler and the history of changes (``StragglerWatch.to_json``)."""
    environment: dict[str, Any] | None = None
    """The project's environment the ranks ran in (``venvs.runenv.Environment.to_json``),
    None without ``requirements``."""
    waited: list[list[Failure]] = field(default_factory=list)
    """``--wait``: the refusals it waited out (others held what it asks for: ``guard.gpus-busy``,
    ``guard.port-leased``), as said each time they changed; not failures of the job."""
    went_cold: list[Failure] = field(default_factory=list)
    """Why an attempt was launched again with every node's ranks cold, not counted as a restart
    (``guard.pool-lost``: a node's warm pool failed at its fork after the others' had forked)."""
    ended_by: str = ""
    """Who ended the job from outside, when someone did (Slurm: scancel, the time limit,
    preemption, a requeue): the job was stopped, it did not fail (``interrupted``)."""
    signum: int | None = None
    """The first signal the head got that stopped the job (SIGINT, SIGTERM), if one did."""
    planned: int | None = None
    """The step of the planned restart that stopped the attempt (``run --readmit``)."""

    @property
    def outcome(self) -> Outcome:
        """The one word for how it ended: a signal to the head wins over what the teardown
        made the ranks do; Slurm's end over a failure it caused."""
        if self.ok:
            return Outcome.SUCCEEDED
        if self.ended_by and not self.signum:
            return Outcome.ENDED_OUTSIDE
        if self.interrupted and (self.root_cause is None or self.signum):
            return Outcome.INTERRUPTED
        if self.planned is not None and self.root_cause is None:
            return Outcome.PLANNED_RESTART
        if self.no_progress:
            return Outcome.NO_PROGRESS
        if self.hung:
            return Outcome.HUNG
        return Outcome.FAILED

    @property
    def hung(self) -> bool:
        return self.root_cause is not None and self.root_cause.kind is FailureKind.HANG

    @property
    def root_cause(self) -> Failure | None:
        return self.failures[0] if self.failures else None

    @property
    def ok(self) -> bool:
        return (not self.failures and not self.interrupted
                and all(r.exit_code == 0 for r in self.ranks))

    def _environment_json(self) -> dict[str, Any]:
        """``environment`` with each rank's interpreter (``python``), and each node's own where
        its ranks reported it: absolute as the node sees it, also when the head launched
        without asking the node (its record then only knows ``~/.ptcluster/envs/…``)."""
        env = dict(self.environment or {})
        seen = {r.host: r.python for r in self.ranks if r.python}
        env["nodes"] = {h: {**n, "python": seen.get(h) or n.get("python", "")}
                        for h, n in (env.get("nodes") or {}).items()}
        return {**env, "python": {str(r.rank): r.python for r in self.ranks if r.python}}

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id, "ok": self.ok, "outcome": self.outcome.value,
            "signal": None if self.signum is None else signal.Signals(self.signum).name,
            "interrupted": self.interrupted,
            "gave_up": self.gave_up, "no_progress": self.no_progress, "ended_by": self.ended_by,
            "gave_up_code": None if self.gave_up_problem is None else self.gave_up_problem.code,
            "gave_up_fields": {} if self.gave_up_problem is None else
            self.gave_up_problem.fields,
            "attempts": [a.to_json() for a in self.attempts],
            "went_cold": [_failure_json(f) for f in self.went_cold],
            "waited": [[_failure_json(f) for f in said] for said in self.waited],
            "spares": [{"after_attempt": a.number, "node": node, "spare": spare,
                        "why": a.dropped_why.get(node, "")}
                       for a in self.attempts for node, spare in a.replaced.items()],
            "duration_s": round(self.duration, 3), "console_dropped": self.console_dropped,
            "log_errors": self.log_errors,
            "root_cause": None if self.root_cause is None else _failure_json(self.root_cause),
            "failures": [_failure_json(f) for f in self.failures],
            "hang_report": None if self.hang_report is None else self.hang_report.to_json(),
            "straggler": self.straggler,
            "nccl": {n.host: n.nccl for n in self.nodes if n.nccl is not None},
            **({"environment": self._environment_json()}
               if self.environment is not None else {}),
            "ranks": [{"rank": r.rank, "host": r.host, "local_rank": r.local_rank,
                       "exit_code": r.exit_code, "status": r.status, "duration_s": r.duration,
                       "started_at": r.started_at, "ended_at": r.ended_at}
                      for r in self.ranks],
            "nodes": [{"host": n.host, "node_rank": n.node_rank, "ready": n.ready,
                       "interface": n.facts.get("interface"),
                       "interface_source": n.facts.get("interface_source"),
                       "gpus": n.facts.get("gpus"), "hostname": n.facts.get("hostname"),
                       "clock_offset_s": n.clock_offset,
                       "address": n.facts.get("address"),
                       "torchrun_pid": n.facts.get("torchrun_pid"),
                       "warm": n.facts.get("warm"),
                       "torch": n.facts.get("torch"), "nccl": n.facts.get("nccl"),
                       "rdma": n.facts.get("rdma"),
                       "guard_exit": n.guard_exit, "reason": n.reason,
                       "transport_exit": n.transport_exit, "escalations": n.escalations,
                       "after_loss": n.after_loss, "gpu_errors": n.gpu_errors}
                      for n in self.nodes],
        }


@dataclass(kw_only=True)
class AttemptRecord:
    """One attempt of a job (``--max-restarts``): who ran it, how it ended, what it resumed."""

    number: int
    """0 for the first attempt (``PTCLUSTER_ATTEMPT`` / ``TORCHELASTIC_RESTART_COUNT``)."""
    hosts: list[str]
    world_size: int
    master_port: int
    started_at: float
    """Head wall clock when the attempt began (its channels were started)."""
    ranks_started_at: float | None = None
    """When its first rank started (corrected clock): the end of the downtime before it."""
    ended_at: float | None = None
    ok: bool = False
    cause: Failure | None = None
    """Its root cause when it failed."""
    resumed_from: int | None = None
    """The step the job reported resuming from (``resumed_from``), None when not reported."""
    checkpoint: int | None = None
    """The newest checkpoint step the job reported saving during this attempt."""
    checkpoint_paths: dict[str, str] = field(default_factory=dict)
    """Per node, where the job saved its last checkpoint there (the next attempt's health gate
    checks that disk)."""
    downtime: float | None = None
    """Seconds from the previous attempt's failure (or its planned restart's stop) to this
    attempt's first rank start."""
    dropped: list[str] = field(default_factory=list)
    """Nodes left out of the next attempt (lost, unhealthy, or failed twice)."""
    dropped_why: dict[str, str] = field(default_factory=dict)
    """Why each node of ``dropped`` was left out."""
    readmitted: list[str] = field(default_factory=list)
    """Nodes lost in an earlier attempt that answer again, taken back into the next attempt."""
    replaced: dict[str, str] = field(default_factory=dict)
    """Nodes of ``dropped`` whose place a spare takes in the next attempt: node -> spare
    (``spares:`` of the cluster file)."""
    end: str = ""
    """How it ended, in ``Outcome``'s words (``planned restart``: stopped to take a node
    back, ``run --readmit``)."""
    planned: int | None = None
    """The checkpoint step every rank saved at which a planned restart stopped it."""
    planned_at: float | None = None
    """When that stop began (head wall clock): the next attempt's downtime counts from it."""
    warm: dict[str, bool] = field(default_factory=dict)
    """Per node that started its ranks: whether they were forked from a warm pool (``run
    --warm``, or the job's own pool on a restart), not started cold by torchrun."""

    def to_json(self) -> dict[str, Any]:
        return {"attempt": self.number, "hosts": self.hosts, "world_size": self.world_size,
                "master_port": self.master_port, "ok": self.ok, "end": self.end,
                "planned_step": self.planned,
                "cause": None if self.cause is None else _failure_json(self.cause),
                "resumed_from": self.resumed_from, "checkpoint": self.checkpoint,
                "checkpoint_paths": self.checkpoint_paths,
                "downtime_s": None if self.downtime is None else round(self.downtime, 3),
                "started_at": self.started_at, "ended_at": self.ended_at,
                "dropped": self.dropped, "dropped_why": self.dropped_why,
                "replaced": self.replaced, "readmitted": self.readmitted, "warm": self.warm}


def _failure_json(f: Failure) -> dict[str, Any]:
    return {"host": f.host, "rank": f.rank, "kind": f.kind.value, "message": f.message,
            "fix": f.fix, "known": f.known, "meaning": f.meaning, "exit_code": f.exit_code,
            "at": f.at, "last_lines": f.last_lines, "facts": f.facts, "code": f.code,
            "fields": f.problem.fields}


def signame(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"
