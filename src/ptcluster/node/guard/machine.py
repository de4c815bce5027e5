"""What the machine saw when a rank died: the kernel's out-of-memory killer, the GPU driver, a
full disk (``MachineWatch``, the guard's one view of them).

Standard library only; a part of the guard (shipped by ``remote.bootstrap``).

The machine watch keeps what its watches share: each rank's process tree
(``proctree.RankTrees``, collected on every heartbeat: the kernel's victim is gone when we
look) and the kernel's log, read from the job's start: ``/dev/kmsg`` (root: opened at the
job's start and read without blocking, so only records written since) or ``journalctl -k``
(groups adm, systemd-journal, wheel; every ``JOURNAL_EVERY`` s while ranks run). It gives each
line to the watch it is for:

* ``guard.oom.OomWatch``: out of memory (the kernel's OOM kills of a rank's tree, by the
  node's and the memory groups' counters and the log's account of each kill;
  systemd-oomd's kills);
* ``guard.xids.XidWatch``: the GPU driver's Xids, tied to a GPU and a rank (NVML's Xid events
  where the log is not readable);

and a rank's ENOSPC gets ``guard.disk``'s facts of its filesystem.
"""

import os
import time
from typing import Any

from ptcluster.node.facts.kernel_log import (
    LOG_JOURNAL,
    LOG_KMSG,
    journal_readable,
    open_kmsg,
    read_journal,
    read_kmsg,
)
from ptcluster.node.guard.disk import FULL_ERRNOS, disk_facts
from ptcluster.node.guard.oom import KernelKill, MemGroup, OomWatch, memory_group
from ptcluster.node.guard.proctree import RankTrees
from ptcluster.node.guard.schedstat import meminfo
from ptcluster.node.guard.xids import XidWatch
from ptcluster.node.rank_wire import RankError
from ptcluster.node.wire import DiskFacts, OomFacts, OomVictim, XidFacts

__all__ = ["JOURNAL_EVERY", "MachineWatch", "memory_group"]  # (memory_group: a test's)

JOURNAL_EVERY = 5.0
"""Seconds between two reads of the journal for Xids while ranks run (a ``journalctl`` each;
``/dev/kmsg`` is read on every heartbeat: a read of what is new costs nothing)."""


class MachineWatch:
    """One job's view of what the machine did to its ranks (see the module's docstring)."""

    def __init__(self, gpus: list[int] | None = None, nvml: Any = None) -> None:
        """``nvml``: NVML to take Xid events from (a test's recorded answers; by default the
        driver's library, only where the kernel's log is not readable)."""
        self.ranks = RankTrees()
        self.lock = self.ranks.lock
        self.oom = OomWatch(self.ranks, self.read_log)
        self.since = self.oom.since
        self.kmsg = open_kmsg(at_end=True)
        self.log = LOG_KMSG if self.kmsg is not None else \
            LOG_JOURNAL if journal_readable() else ""
        """Where this guard reads the kernel's log ("" where it cannot)."""
        self.oom.log = self.log
        self.journal_read = 0.0
        self.xid = XidWatch(self.ranks, self.look, gpus, nvml,
                            events=not self.log or nvml is not None)

    @property
    def trees(self) -> dict[int, set[int]]:
        return self.ranks.trees

    @trees.setter
    def trees(self, trees: dict[int, set[int]]) -> None:
        self.ranks.trees = trees

    @property
    def groups(self) -> dict[int, MemGroup]:
        return self.oom.groups

    @property
    def inherited(self) -> MemGroup | None:
        return self.oom.inherited

    @property
    def kills(self) -> list[KernelKill]:
        return self.oom.kills

    @property
    def xids(self) -> list[XidFacts]:
        return self.xid.xids

    def started(self, rank: int, pid: int, shim_pid: int) -> None:
        """A rank's program started (its pid, its shim's)."""
        self.ranks.started(rank, pid, shim_pid)
        self.oom.note_group(rank, pid)

    def scan(self, roots: dict[int, int]) -> None:
        """Every heartbeat while ranks run: each rank's tree (``roots``: rank -> its program's
        pid), its memory group, the node's memory, the kernel's log."""
        self.ranks.scan(roots)
        for rank, root in roots.items():
            self.oom.note_group(rank, root)
        mem = meminfo()
        if mem.get("MemTotal") and "MemAvailable" in mem:
            self.oom.mem = (mem["MemAvailable"] * 1024, mem["MemTotal"] * 1024)
        if self.kmsg is not None or (self.log and time.monotonic() - self.journal_read
                                     >= JOURNAL_EVERY):
            self.read_log()

    def read_log(self) -> None:
        """The kernel's lines written since the job started (or since the last read)."""
        if self.kmsg is not None:
            records = read_kmsg(self.kmsg)
        else:
            records = read_journal(self.since)
            self.journal_read = time.monotonic()
            self.oom.kills = []  # journalctl gives every line since the start again
        with self.lock:
            for at, line in records:
                self.parse(line, at)

    def parse(self, line: str, at: float = 0.0) -> None:
        """One line of the kernel's log (under ``lock``), to the watch it is for."""
        if line.startswith("NVRM: Xid"):  # (each at the start of the record: M2)
            self.xid.line(line, at)
        else:
            self.oom.parse(line)

    def look(self) -> None:
        """The kernel's log now, not at the next heartbeat: a rank's exit, the last one's."""
        if self.log:
            self.read_log()

    def after_exit(self, rank: int, code: int | None) -> OomFacts | None:
        """The OOM facts of a rank that ended with ``code`` (``OomWatch.after_exit``)."""
        return self.oom.after_exit(rank, code)

    def tied_by_group(self, rank: int) -> list[OomVictim]:
        return self.oom.tied_by_group(rank)

    def new_xids(self) -> list[XidFacts]:
        """The Xids seen since the last call (the link sends each to the head)."""
        return self.xid.new_xids()

    def xids_of(self, rank: int) -> list[XidFacts]:
        """A failed rank's Xids (``XidWatch.xids_of``)."""
        return self.xid.xids_of(rank)

    def after_error(self, body: RankError) -> DiskFacts | None:
        """The disk facts of a rank's error record that says its filesystem was full."""
        if body.get("errno") not in FULL_ERRNOS:
            return None
        return disk_facts(str(body.get("filename") or ""))

    def close(self) -> None:
        self.xid.close()
        if self.kmsg is not None:
            os.close(self.kmsg)
            self.kmsg = None
