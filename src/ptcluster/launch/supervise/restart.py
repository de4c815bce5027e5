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
  deadline: their ranks may still run) or refused by their health gate (``node.facts.health``: too
  few GPUs, a nearly full disk, too little memory) are dropped (when fewer than
  ``min_nodes`` would remain, the job gives up), and so is a node whose rank or guard was the
  root cause of two attempts, while ``min_nodes`` remain without it;
- no progress: a job that reports its checkpoints (``checkpoint_saved``/``resumed_from`` of
  ``ptcluster.node.rank.api``) gives up when an attempt ends without a checkpoint newer
  than the step it started from — it would only fail the same way again (exit 3). An attempt
  whose cause was a node that is now dropped is exempt: the next one runs on other hardware.
  A job that never reports checkpoints gets plain ``max_restarts`` restarts.
- spares (``spares:`` of the cluster file): each dropped node, in rank order, has its place
  taken by the next spare that has not run yet (``Decision.replace``), which counts toward
  ``min_nodes`` as the node did; the spare runs with its own slots. Its health gate and start
  are the next attempt's, as for every node: a spare refused there, unreachable or lost
  before any rank started failed to join (``failed_join``): it is dropped like a node, the
  next spare (or the shrink rule) applies, and that attempt is not counted as a restart
  (each spare fails to join once at most, so this ends);
- re-admission (issue 45 item 2, at the next restart): a node dropped because it was lost
  (``GONE``) that answers again, its guard of then gone (``returned``), is taken back first,
  into a place the job lost, never past the file's ``size`` nodes (while a spare holds the
  place, it waits as a spare); not one that was the cause of two attempts (said in the
  reason). One taken back that fails to join is dropped again and not counted; that failure
  is a strike of its own, so it is tried at most twice.
- a planned restart (``run --readmit``, ``supervise.readmit``): an attempt the head stopped at
  a checkpoint every rank saved to take back nodes that answer again (``returned``) is always
  followed by one that takes them back, into the places the job lost; it is not a failure, not
  counted against ``max_restarts`` and not judged by the no-progress rule.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ptcluster.errors import Problem
from ptcluster.launch.result import AttemptRecord, Failure, FailureKind
from ptcluster.node.problems import Declared

NODE_LOSS = (FailureKind.LOST, FailureKind.START, FailureKind.UNHEALTHY)
"""Failure kinds that mean the node itself is gone or unusable: it is left out of the next
attempt."""
GONE = (FailureKind.LOST, FailureKind.START)
"""Of those, a node that stopped answering (or never did): one that answers again later may be
taken back (``returned``). One its health gate refused is not: it never stopped answering,
and only its gate (the next attempt's) could say it is well again."""

NO_RESTARTS_LEFT = Declared(
    "run.no-restarts-left", "the restarts allowed are used up",
    "no restarts left ({used} of {most} used)",
    "fix what the root cause says, then run again (or allow more: --max-restarts)")
TOO_FEW_NODES = Declared(
    "run.too-few-nodes", "too few nodes would remain for a restart",
    "only {left} node(s) would remain after dropping {dropped}{spares}; --min-nodes is "
    "{min_nodes}",
    "bring the dropped nodes back or add spares (spares: in the cluster file), or lower "
    "--min-nodes")
NO_PROGRESS = Declared(
    "run.no-progress", "an attempt saved no newer checkpoint",
    "gave up: no progress (attempt {attempt} saved no checkpoint {since})",
    "the job failed again before its next checkpoint: fix what the root cause says (a "
    "restart would only fail the same way; exit 3)")
GAVE_UP = (NO_RESTARTS_LEFT, TOO_FEW_NODES, NO_PROGRESS)
"""Why a failed job is not restarted though restarts were asked for (``summary.json``'s
``gave_up``, with its code and fields)."""


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
    replace: tuple[tuple[str, str], ...] = ()
    """(node, spare) for each node of ``drop`` whose place a spare takes."""
    readmit: tuple[str, ...] = ()
    """Nodes lost earlier that answer again, taken back into the next attempt."""
    no_progress: bool = False
    stopped: bool = False
    """The job was stopped, it did not fail (ended from outside, or a stop request after the
    attempt had ended): the result counts as interrupted."""
    gave_up: Problem | None = None
    """Why no further attempt, as its declared problem (``GAVE_UP``; ``reason`` is its what)."""


def _gave_up(entry: Declared, drop: tuple[str, ...], why: tuple[tuple[str, str], ...],
             no_progress: bool = False, **values: object) -> Decision:
    problem = Problem.of(entry, None, **values)
    return Decision(False, problem.what, drop, why=why, no_progress=no_progress,
                    gave_up=problem)


def decide(policy: RestartPolicy | None, attempts: Sequence[AttemptRecord],
           failures: Sequence[Failure], interrupted: bool, cut_off: Sequence[str] = (), *,
           ended_by: str = "", stop_requested: bool = False,
           spares: Sequence[str] = (), returned: Sequence[str] = (),
           size: int = 0) -> Decision:
    """After ``attempts[-1]`` ended: restart or not. ``policy``: None when no restarts were
    asked for; ``failures``: all of the attempt's failures; ``interrupted``: it was stopped by
    a request while it ran; ``cut_off``: nodes given up on at the stop deadline, whose ranks may
    still run; ``ended_by``: who ended it from outside, if anyone did; ``stop_requested``: a
    stop was asked for (also after the attempt had ended); ``spares``: the spares that have not
    run yet, in file order; ``returned``: nodes of the file lost earlier that answer again now
    (``lost.answering_again``); ``size``: the cluster file's number of nodes, which a job never
    grows past."""
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
    if planned(last):
        return _planned(attempts, returned, size, stop_requested)
    drop, why, replace, readmit, not_back = _places(policy, attempts, failures, cut_off,
                                                    spares, returned, size)
    left = len(last.hosts) - len(drop) + len(replace) + len(readmit)
    used = restarts_used(attempts)
    if used >= policy.max_restarts:
        return _gave_up(NO_RESTARTS_LEFT, drop, why, used=used, most=policy.max_restarts)
    if left < policy.min_nodes:
        said = ", ".join(f"{h} ({w})" for h, w in why)
        none = "; no spare left" if spares or any(a.replaced for a in attempts) else ""
        return _gave_up(TOO_FEW_NODES, drop, why, left=left, dropped=said, spares=none,
                        min_nodes=policy.min_nodes)
    reports = any(a.checkpoint is not None or a.resumed_from is not None for a in attempts)
    cause_dropped = last.cause is not None and last.cause.host in drop \
        and last.cause.kind in NODE_LOSS
    if reports and not cause_dropped:
        start = start_step(attempts)
        if last.checkpoint is None or (start is not None and last.checkpoint <= start):
            since = "since it started" if start is None else f"after step {start}"
            return _gave_up(NO_PROGRESS, drop, why, True, attempt=last.number, since=since)
    if stop_requested:  # Ctrl-C after the attempt had ended
        return Decision(False, "stopped by the user: not restarted", drop, stopped=True,
                        why=why)
    return Decision(True, _going_on(attempts, policy, used, why, dict(replace), readmit,
                                    not_back), drop, why=why, replace=replace, readmit=readmit)


def _places(policy: RestartPolicy, attempts: Sequence[AttemptRecord],
            failures: Sequence[Failure], cut_off: Sequence[str], spares: Sequence[str],
            returned: Sequence[str], size: int) -> tuple[
                tuple[str, ...], tuple[tuple[str, str], ...], tuple[tuple[str, str], ...],
                tuple[str, ...], tuple[str, ...]]:
    """Who leaves and who fills the places of the next attempt: (drop, why, replace, readmit,
    not taken back). Lost, refused and twice-failed nodes leave; nodes lost earlier that
    answer again are taken back first (never past ``size`` places, the cluster file's nodes;
    not one that failed twice), then spares take the dropped nodes' places."""
    hosts = attempts[-1].hosts
    lost = {f.host for f in failures if f.kind in NODE_LOSS and f.host in hosts} | \
        {h for h in cut_off if h in hosts}
    strikes = Counter(a.cause.host for a in attempts if a.cause is not None)
    twice = {h for h in hosts if strikes[h] >= 2} - lost
    back = [h for h in returned if h not in hosts and strikes[h] < 2]
    free = [s for s in spares if s not in hosts]
    room = max(size, len(hosts)) - len(hosts)  # places left empty by earlier drops
    if len(hosts) - len(lost | twice) + min(len(back) + len(free), room + len(lost | twice)) \
            < policy.min_nodes:
        twice = set()  # a node that failed twice is kept rather than end the job
    drop = tuple(h for h in hosts if h in lost | twice)
    readmit = tuple(back[:room + len(drop)])
    # (nodes taken back fill the places empty before, then the dropped ones'; spares the rest;
    # what is left after them shrinks the job)
    replace = tuple(zip(drop[max(0, len(readmit) - room):], free, strict=False))
    return (drop, tuple((h, _why(h, failures, twice)) for h in drop), replace, readmit,
            tuple(h for h in returned if h not in hosts and strikes[h] >= 2))


def planned(attempt: AttemptRecord) -> bool:
    """``attempt`` was stopped by a planned restart (``run --readmit``), nothing failed."""
    return attempt.planned is not None and attempt.cause is None and not attempt.ok


def _planned(attempts: Sequence[AttemptRecord], returned: Sequence[str], size: int,
             stop_requested: bool) -> Decision:
    """After a planned restart: the next attempt takes ``returned`` back (those that fit in
    the places the job lost; not one that failed twice); a stop asked meanwhile wins."""
    last = attempts[-1]
    if stop_requested:
        return Decision(False, "stopped by the user: not restarted", stopped=True)
    strikes = Counter(a.cause.host for a in attempts if a.cause is not None)
    room = max(0, size - len(last.hosts))
    back = tuple(h for h in returned if h not in last.hosts and strikes[h] < 2)[:room]
    said = ", ".join(back) or "no node"
    return Decision(True, f"planned restart at step {last.planned} (--readmit, not counted "
                          f"as a restart): {said} taken back", readmit=back)


def restarts_used(attempts: Sequence[AttemptRecord]) -> int:
    """The restarts the attempts so far used: every attempt after the first, but those that
    failed only because a node joining them did not come up (``failed_join``) and those that
    follow a planned restart (``planned``)."""
    return sum(not failed_join(attempts, i) and not planned(attempts[i - 1])
               for i in range(1, len(attempts)))


def failed_join(attempts: Sequence[AttemptRecord], i: int) -> bool:
    """Attempt ``i`` failed only because a spare that joined it did not come up: before any
    rank started, its root cause was a node loss (refused by its health gate, unreachable,
    lost) of a spare that the attempt before it put in a node's place. Not counted as a
    restart."""
    a = attempts[i]
    joined = set(attempts[i - 1].replaced.values()) | set(attempts[i - 1].readmitted) \
        if i > 0 else set()
    return (not a.ok and a.ranks_started_at is None and a.cause is not None
            and a.cause.host in joined and a.cause.kind in NODE_LOSS)


def _going_on(attempts: Sequence[AttemptRecord], policy: RestartPolicy, used: int,
              why: tuple[tuple[str, str], ...], replace: dict[str, str],
              readmit: tuple[str, ...], not_back: tuple[str, ...]) -> str:
    """The restart's reason: which restart, which spare takes whose place, who is left out,
    who is taken back."""
    swapped = [f"spare {replace[h]} replaces {h} ({w})" for h, w in why if h in replace]
    swapped += [f"{h} answers again: taken back" for h in readmit]
    swapped += [f"{h} answers again but failed twice: not taken back" for h in not_back]
    out = [f"{h} ({w})" for h, w in why if h not in replace]
    said = (": " + "; ".join(swapped) if swapped else "") + \
        (f"{';' if swapped else ''} without {', '.join(out)}" if out else "")
    last = attempts[-1]
    again = ""
    if last.cause is not None and failed_join(attempts, len(attempts) - 1):
        h = last.cause.host
        who = f"{h}, taken back," if h in attempts[-2].readmitted else f"spare {h}"
        again = f"{who} failed to join, not counted as a restart; "
    return f"{again}restart {used + 1} of {policy.max_restarts}{said}"


def _why(host: str, failures: Sequence[Failure], twice: set[str]) -> str:
    """Why ``host`` is left out: unhealthy (what its gate found), could not start, lost, or
    failed twice."""
    if host in twice:
        return "failed twice"
    for f in failures:
        if f.host == host and f.kind is FailureKind.UNHEALTHY:
            return f"unhealthy: {f.message}"
    if any(f.host == host and f.kind is FailureKind.START for f in failures) and \
            not any(f.host == host and f.kind is FailureKind.LOST for f in failures):
        return "could not start"  # (unreachable, not ready in time: a spare that cannot join)
    return "lost"


def start_step(attempts: Sequence[AttemptRecord]) -> int | None:
    """The step the last attempt started from: what it reported resuming from, else the newest
    checkpoint reported before it (None: from the beginning, as far as we know)."""
    last = attempts[-1]
    if last.resumed_from is not None:
        return last.resumed_from
    earlier = [a.checkpoint for a in attempts[:-1] if a.checkpoint is not None]
    return max(earlier, default=None)
