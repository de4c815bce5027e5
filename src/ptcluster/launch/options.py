"""The runner's knobs: :class:`RunOptions`, the inputs of a run besides its plan.

Pure data (the plan reads it for the guard's config, the supervisor for its timers); what a run
produced is ``launch.result``. The guard's own timing defaults are written once, in
``node.wire``, and taken from there.
"""

from __future__ import annotations

from dataclasses import dataclass

from ptcluster.launch.supervise.straggler import DEFAULT_THRESHOLD
from ptcluster.node import wire

BEATS_PER_SECOND = 512
"""Heartbeats the head sends (and takes) a second in all, each way, once the cluster is large:
each one costs it a write or a read and a decode (~50 us here), so 1024 nodes beating every
second cost ~10 % of a core for liveness alone. Past ``BEATS_PER_SECOND`` nodes the interval
grows with the cluster instead (torch elastic's rendezvous keeps alive every 5 s)."""
OUTPUT_WRITES_PER_SECOND = BEATS_PER_SECOND
"""Writes of output the head is sized to read a second from all nodes together, whatever the
ranks print: each guard holds its ranks' lines ``nodes / OUTPUT_WRITES_PER_SECOND`` s and
writes them at once (``node.guard.outbox``; 16 ms on 8 nodes, 2 s on 1024), or with its next
heartbeat, whichever comes first."""


SILENT_BEATS = 4
"""The fewest heartbeats a side may miss before it gives the other up (``heartbeat_for``)."""
CHECK_EVERY = 0.2
"""Seconds between two runs of the head's checks over every node (silence, hangs, the
teardown's steps: ``launch.attempt``'s loop)."""


@dataclass(kw_only=True)
class RunOptions:
    """Timing knobs of the runner (defaults suit real clusters and the testbed alike)."""

    ready_timeout: float = 60.0
    """Seconds for every node to connect and pass its checks before the launch is abandoned."""
    node_silence: float = 8.0
    """A node whose channel brings nothing (not even a heartbeat) for this long is lost; the
    head names it within ``lost_within`` of its last byte, so within 8.2 s of a cut link or a
    power loss (before 2026-12-04: 20 s, after ssh's keepalive gave up at 20 s).

    What it is made of: a guard beats every ``heartbeat_for(nodes)`` s (1 s up to 512 nodes,
    2 s at 1024) on a fixed schedule, from a thread that does nothing but the beat and the
    ranks' idle seconds it carries (``guard.link``: its other looks at /proc and at the
    kernel's log, a ``journalctl`` that may take seconds, are another thread's), and any byte
    of the node counts, output as well. So a live node is silent about one interval; 8 s is
    8 missed beats (4 at 1024 nodes: ``SILENT_BEATS``, the ceiling in ``heartbeat_for``).

    Why it does not fire on a live node under load: ranks that take every CPU, or a node
    capped to 25 % of one CPU (the testbed's straggler), delay the beat thread by scheduler
    periods (~0.1 s), not seconds; a head that falls behind its reading holds the channel
    (``remote.hub``: a held channel counts as heard), and the head of 1024 nodes reads on one
    thread at ~11 % of a core (``benchmarks/head_scale.py``); TCP resends a lost segment
    within ~1.4 s (three tries from Linux's 200 ms minimum timeout). ssh's own keepalive
    (``transport.SSH_DEFAULTS``: 12 s) stays behind this rule: a backstop, and what names a
    dead node on the channels without heartbeats."""
    heartbeat_interval: float = wire.HEARTBEAT_EVERY
    """Seconds between two heartbeats each way, head and guard, on clusters of up to
    ``BEATS_PER_SECOND`` nodes (``heartbeat_for``: longer on larger ones)."""
    guard_heartbeat_timeout: float = wire.HEARTBEAT_TIMEOUT
    """A guard that hears nothing from the head for this long ends its part of the job."""
    stop_grace: float = wire.STOP_GRACE
    """Seconds a guard gives torchrun to end its workers after SIGTERM before SIGKILL."""
    stop_deadline: float = 8.0
    """After stop, seconds before the head signals the channel of a guard that has not ended
    (SIGTERM; SIGKILL and giving up on the node 4 s later)."""
    deadline: float | None = None
    """Seconds after "go" before the whole job is ended as timed out (None: no limit)."""
    hang_timeout: float | None = None
    """Seconds without progress on every running rank before the job is called hung: every
    rank's stacks are collected, the straggler named, and the job ended (None: never)."""
    wait: float | None = None
    """``run --wait``: when nodes refuse only because other jobs hold their GPUs or port, try
    again every ``wait_poll`` s for at most this many seconds (inf: no limit; None: refuse)."""
    wait_poll: float = 5.0
    leases: bool = True
    """False (``run --no-leases``, unsafe): no node leases this job's GPUs, port or id, so other
    jobs are not kept off them and ``ps``/``kill`` do not see it; True: a node whose lease
    directory is missing or not root's refuses the job."""
    readmit: bool = False
    """``run --readmit``: a node lost in an earlier attempt that answers again, fit, is taken
    back by a planned restart at the next checkpoint every rank saved (not only at the next
    failure's restart): ``launch.readmit_watch``, ``supervise.readmit``."""
    warm: float | None = None
    """``run --warm`` (or ``warm:``): ranks come from this user's warm pool on each node, which
    ends after this many idle seconds (``node.guard.warm_ranks``); None: torchrun starts them."""
    warm_imports: tuple[str, ...] = ()
    """``warm_imports:``: what a warm pool imports besides torch (part of its key)."""
    restart_pool: bool = True
    """With ``--max-restarts`` (and not ``warm``): each node's guard keeps a pool of the job's
    own (``node.guard.job_pool``), from which the next attempt's ranks are forked where every
    node of the attempt has one (the head's ``go``: a spare that joins, a node taken back have
    none, and then every node's ranks start cold); False (``--cold``): torchrun starts every
    attempt's ranks."""
    pooled: bool = True
    """The ranks may come from the nodes' warm pools (where every node of an attempt has one);
    the runner sets False for the rest of the run once a node's pool failed at its fork after
    the others' had forked (``guard.pool-lost``): that attempt is launched again, all cold."""
    straggler_threshold: float = DEFAULT_THRESHOLD
    """A rank (or node) whose busy share (1 - the share of time its main thread sleeps) is this
    many times the other ranks' median, while they wait for it, is named the straggler
    (``launch.supervise.straggler``)."""

    requirements: str | None = None
    """The project's declared environment (``run --requirements``, else the cluster file's
    ``requirements:``): resolved, shipped and built on every node before any rank starts
    (``venvs.runenv``), and the ranks run in it. None: setup's interpreter. A path as
    a string, not a ``pathlib.Path``: the launch core reads these options and stays pure
    (``tests/unit/test_purity.py``)."""
    find_links: tuple[str, ...] = ()
    """Folders of wheels the head resolves ``requirements`` from instead of an index."""
    refresh: bool = False
    """Resolve ``requirements`` again even when its resolution is cached."""
    requirements_trusted: bool = False
    """The user vouches for the file (``--trust-cluster-file``): it may name another index,
    and a package without a wheel may be built from its source on the head."""

    @property
    def lost_within(self) -> float:
        """The most seconds from a node's last byte (so from its cut, which came after it) to
        the head naming it lost: ``node_silence``, then the next run of the checks."""
        return self.node_silence + CHECK_EVERY

    def heartbeat_for(self, nodes: int) -> float:
        """The heartbeat interval of a job on ``nodes`` nodes: ``heartbeat_interval``, or
        longer where that would exceed ``BEATS_PER_SECOND`` (1024 nodes: 2 s), but not made
        longer than a quarter of the time either side waits before it gives the other up
        (``SILENT_BEATS``: past 1024 nodes the head takes more beats a second rather than
        naming a lost node later)."""
        ceiling = min(self.guard_heartbeat_timeout, self.node_silence) / SILENT_BEATS
        return max(self.heartbeat_interval, min(nodes / BEATS_PER_SECOND, ceiling))

    def output_hold_for(self, nodes: int) -> float:
        """Seconds a guard of a job on ``nodes`` nodes may hold its ranks' output to write
        it in one go (see ``OUTPUT_WRITES_PER_SECOND``), at most a heartbeat: past 512 nodes
        the held output goes with the heartbeats, and output costs the head no read of its
        own."""
        return min(nodes / OUTPUT_WRITES_PER_SECOND, self.heartbeat_for(nodes))

    def __post_init__(self) -> None:
        for name in ("ready_timeout", "node_silence", "heartbeat_interval",
                     "guard_heartbeat_timeout", "stop_grace", "stop_deadline"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RunOptions.{name} must be > 0, got {getattr(self, name)}")
        if self.hang_timeout is not None and self.hang_timeout <= 0:
            raise ValueError(f"RunOptions.hang_timeout must be > 0 or None, got "
                             f"{self.hang_timeout}")
        if self.straggler_threshold <= 1.0:
            raise ValueError(f"RunOptions.straggler_threshold must be > 1, got "
                             f"{self.straggler_threshold}")
        if self.deadline is not None and self.deadline <= 0:
            raise ValueError(f"RunOptions.deadline must be > 0 or None, got {self.deadline}")
        if self.stop_deadline <= self.stop_grace + 2.0:
            raise ValueError("RunOptions.stop_deadline must exceed stop_grace by more than 2 s "
                             "(the guard's own teardown must fit before its channel is cut)")
        if self.node_silence < SILENT_BEATS * self.heartbeat_interval:
            raise ValueError(f"RunOptions.node_silence must be at least {SILENT_BEATS} "
                             "heartbeat intervals")
        if self.guard_heartbeat_timeout <= 2 * self.heartbeat_interval:
            raise ValueError("RunOptions.guard_heartbeat_timeout must exceed two heartbeat "
                             "intervals")
