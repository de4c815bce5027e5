"""Whether a failed attempt of a job is restarted, and on which nodes: a pure function.

``run --max-restarts N [--min-nodes M]`` restarts the *whole* job, driven by the head: every node
is torn down as for any failure, then the next attempt starts with a fresh rendezvous over the
nodes that remain, ranks renumbered. (torchrun's own ``--max-restarts`` restarts only its node's
workers and cannot bring a static rendezvous back: pytorch#146371; its counter is per node:
pytorch#108158.) The rules, in order:

- an attempt that succeeded, that was ended from outside (Slurm: scancel, the time limit,
  preemption), or that the user stopped (Ctrl-C, SIGTERM, also after it had ended) is never
  restarted;
- at most ``max_restarts`` restarts;
- nodes that were lost (silent, channel closed, could not start, or not ended by the stop
  deadline: their ranks may still run) or refused by their health gate (``node.health``: too
  few GPUs, a nearly full disk, too little memory) are dropped (when fewer than
  ``min_nodes`` would remain, the job gives up), and so is a node whose rank or guard was the
  root cause of two attempts, while ``min_nodes`` remain without it;
- no progress: a job that reports its checkpoints (``checkpoint_saved``/``resumed_from`` of
  ``ptcluster.node.rank.api``) gives up when an attempt ends without a checkpoint newer
  than the step it started from — it would only fail the same way again (exit 3). An attempt
  whose cause was a node that is now dropped is exempt: the next one runs on other hardware.
  A job that never reports checkpoints gets plain ``max_restarts`` restarts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ptcluster.launch.result import AttemptRecord, Failure, FailureKind

NODE_LOSS = (FailureKind.LOST, FailureKind.START, FailureKind.UNHEALTHY)
"""Failure kinds that mean the node itself is gone or unusable: it is left out of the next
attempt."""


@dataclass(frozen=True, kw_only=True)
class RestartPolicy:
    """What ``--max-restarts`` and ``--min-nodes`` allow."""

    max_restarts: int = 0
    """Whole-job restarts after a failure (0: a failure ends the job)."""
    min_nodes: int = 1
    """Fewest nodes a restarted attempt may run on (nodes are dropped when lost)."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.min_nodes < 1:
            raise ValueError(f"min_nodes must be >= 1, got {self.min_nodes}")


@dataclass(frozen=True)
class Decision:
    restart: bool
    reason: str
    """Why the job goes on or ends ("" for a success or a stop)."""
    drop: tuple[str, ...] = ()
    """Nodes left out from now on."""
    why: tuple[tuple[str, str], ...] = ()
    """(node, why it is left out) for each of ``drop``."""
    no_progress: bool = False
    stopped: bool = False
    """The job was stopped, it did not fail (ended from outside, or a stop request after the
    attempt had ended): the result counts as interrupted."""


def decide(policy: RestartPolicy | None, attempts: Sequence[AttemptRecord],
           failures: Sequence[Failure], interrupted: bool, cut_off: Sequence[str] = (), *,
           ended_by: str = "", stop_requested: bool = False) -> Decision:
    """After ``attempts[-1]`` ended: restart or not. ``policy``: None when no restarts were
    asked for; ``failures``: all of the attempt's failures; ``interrupted``: it was stopped by
    a request while it ran; ``cut_off``: nodes given up on at the stop deadline, whose ranks may
    still run; ``ended_by``: who ended it from outside, if anyone did; ``stop_requested``: a
    stop was asked for (also after the attempt had ended)."""
    last = attempts[-1]
    if last.ok:
        return Decision(False, "")
    if ended_by:
        return Decision(False, "" if policy is None else "ended from outside: not restarted",
                        stopped=True)
    if policy is None:
        return Decision(False, "")
    if interrupted:
        return Decision(False, "stopped by the user: not restarted")
    if policy.max_restarts == 0:
        return Decision(False, "")
    hosts = last.hosts
    lost = {f.host for f in failures if f.kind in NODE_LOSS and f.host in hosts} | \
        {h for h in cut_off if h in hosts}
    blamed = Counter(a.cause.host for a in attempts
                     if a.cause is not None and a.cause.host in hosts)
    twice = {h for h, n in blamed.items() if n >= 2} - lost
    if len(hosts) - len(lost | twice) < policy.min_nodes:
        twice = set()  # a node that failed twice is kept rather than end the job
    drop = tuple(h for h in hosts if h in lost | twice)
    why = tuple((h, _why(h, failures, twice)) for h in drop)
    left = len(hosts) - len(drop)
    used = len(attempts) - 1
    if used >= policy.max_restarts:
        return Decision(False, f"no restarts left ({used} of {policy.max_restarts} used)", drop,
                        why=why)
    if left < policy.min_nodes:
        said = ", ".join(f"{h} ({w})" for h, w in why)
        return Decision(False, f"only {left} node(s) would remain after dropping {said}; "
                               f"--min-nodes is {policy.min_nodes}", drop, why=why)
    reports = any(a.checkpoint is not None or a.resumed_from is not None for a in attempts)
    cause_dropped = last.cause is not None and last.cause.host in drop \
        and last.cause.kind in NODE_LOSS
    if reports and not cause_dropped:
        start = start_step(attempts)
        if last.checkpoint is None or (start is not None and last.checkpoint <= start):
            since = "since it started" if start is None else f"after step {start}"
            return Decision(False, f"gave up: no progress (attempt {last.number} saved no "
                                   f"checkpoint {since})", drop, no_progress=True, why=why)
    if stop_requested:  # Ctrl-C after the attempt had ended
        return Decision(False, "stopped by the user: not restarted", drop, stopped=True,
                        why=why)
    kept = f" without {', '.join(f'{h} ({w})' for h, w in why)}" if drop else ""
    return Decision(True, f"restart {used + 1} of {policy.max_restarts}{kept}", drop, why=why)


def _why(host: str, failures: Sequence[Failure], twice: set[str]) -> str:
    """Why ``host`` is left out: unhealthy (what its gate found), lost, or failed twice."""
    if host in twice:
        return "failed twice"
    for f in failures:
        if f.host == host and f.kind is FailureKind.UNHEALTHY:
            return f"unhealthy: {f.message}"
    return "lost"


def start_step(attempts: Sequence[AttemptRecord]) -> int | None:
    """The step the last attempt started from: what it reported resuming from, else the newest
    checkpoint reported before it (None: from the beginning, as far as we know)."""
    last = attempts[-1]
    if last.resumed_from is not None:
        return last.resumed_from
    earlier = [a.checkpoint for a in attempts[:-1] if a.checkpoint is not None]
    return max(earlier, default=None)
