"""``run --readmit``: a node lost earlier that answers again, fit, is taken back by a planned
restart at the next checkpoint that every rank has saved: pure, no clock of its own.

Which step is safe: the job's ranks report their checkpoints (``ptcluster.checkpoint_saved``,
which ``ptcluster.checkpoint.save`` calls on every node once the step is complete there, as the
reference trainer does from each node's local rank 0) one by one and at their own pace. A
restart at the newest step any one rank reported could find another node without it, and the
next attempt would resume from an older step there (or disagree). So the head keeps, per rank,
the steps it reported (the last ``KEPT``), and the step it restarts at is the newest one that
**every node of the attempt** reported, from each of its ranks that reports at all
(``common_step``): a node whose ranks never report holds the planned restart back (it would not
know which step it resumes from); a job that reports from one rank of the whole job only
(rank 0 saving for everyone to a shared disk) never gets a planned restart, and the returned
node is taken back at the next failure's restart instead.

When: the head must have seen the returned node healthy first (``Readmissions.back``: the
probe's answer with its health gate's verdict), and the step must be newer than the newest
common one when it did (the *next* checkpoint: the work since is then at most one checkpoint
interval, lost anyway by the stop). The ranks are stopped through the usual stop path (the
head's ``stop`` to every guard); the attempt's outcome is ``Outcome.PLANNED_RESTART``, and
``restart.decide`` always follows it with an attempt that takes the node back, not counted
against ``--max-restarts``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping

KEPT = 64
"""Steps kept per rank: enough for a node that reports many steps behind the others."""


class CheckpointReports:
    """Every rank's reported checkpoint steps in one attempt (the last ``KEPT`` of each), and
    ``common_step`` kept up to date as they come: a report costs the work of its own node
    (its ranks' steps intersected), not of the whole job, so a checkpoint's reports from 1024
    nodes cost 1024 small updates, not 1024 scans of every node."""

    def __init__(self) -> None:
        self._steps: dict[str, dict[int, deque[int]]] = {}
        self._done: dict[str, set[int]] = {}
        """Per node: the steps each of its reporting ranks reported."""
        self._nodes_done: dict[int, int] = {}
        """Per step: how many nodes have it done."""

    def add(self, host: str, rank: int, step: int) -> None:
        steps = self._steps.setdefault(host, {}).setdefault(rank, deque(maxlen=KEPT))
        if step in steps:
            return
        steps.append(step)
        before = self._done.get(host, set())
        now = set.intersection(*(set(s) for s in self._steps[host].values()))
        self._done[host] = now
        for gone in before - now:
            self._nodes_done[gone] -= 1
            if not self._nodes_done[gone]:
                del self._nodes_done[gone]
        for new in now - before:
            self._nodes_done[new] = self._nodes_done.get(new, 0) + 1

    def common_step(self, nodes: int) -> int | None:
        """``common_step`` of the reports for an attempt of ``nodes`` nodes (every report
        comes from one of them)."""
        return max((s for s, n in self._nodes_done.items() if n >= nodes), default=None)


def common_step(reports: Mapping[str, Mapping[int, set[int]]]) -> int | None:
    """The newest step every node of ``reports`` (host -> rank -> steps it reported) saved:
    reported by each of the node's ranks that reported any; None when there is none (a node
    with no report at all, or no step they all share)."""
    shared: set[int] | None = None
    for ranks in reports.values():
        if not ranks:
            return None
        mine = set.intersection(*(set(s) for s in ranks.values()))
        shared = mine if shared is None else shared & mine
    return max(shared) if shared else None


class Readmissions:
    """The nodes waiting to be taken back by a planned restart and the step it waits past."""

    def __init__(self) -> None:
        self._after: dict[str, int] = {}
        """Each node seen back and fit, with the common step then (-1: none yet)."""
        self.step: int | None = None
        """The step of the planned restart once it is due (the attempt then stops)."""
        self.at: float | None = None
        """When it became due (head wall clock): the start of its downtime."""

    @property
    def waiting(self) -> tuple[str, ...]:
        """The nodes seen back, in the order they came back."""
        return tuple(self._after)

    def back(self, host: str, common: int | None) -> bool:
        """``host`` answers again and is fit: wait for a checkpoint newer than ``common``.
        Whether it is news (not already waiting, and no planned restart due yet)."""
        if host in self._after or self.step is not None:
            return False
        self._after[host] = -1 if common is None else common
        return True

    def due(self, common: int | None, at: float = 0.0) -> int | None:
        """The step to restart at, when ``common`` (the newest step every rank saved) is newer
        than it was when the first waiting node came back; None: not yet. Once due (``at``:
        now), it stays the step."""
        if self.step is None and self._after and common is not None and \
                common > min(self._after.values()):
            self.step, self.at = common, at
        return self.step


def said_back(hosts: Iterable[str], step: int) -> str:
    """The console's words for a planned restart that is due."""
    who = list(hosts)
    one = len(who) == 1
    return (f"{', '.join(who)} {'is' if one else 'are'} back: a planned restart at step {step} "
            f"(the checkpoint every rank saved) takes {'it' if one else 'them'} back "
            "(--readmit; not counted as a restart)")
