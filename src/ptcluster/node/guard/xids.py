"""GPU errors: the NVIDIA driver's Xids while a job runs (``XidWatch``, one of
``guard.machine.MachineWatch``'s watches).

Standard library only; a part of the guard (shipped by ``remote.bootstrap``).

The kernel's log carries the driver's Xids (``node.facts.gpu_errors``): the machine watch reads
it on every heartbeat while ranks run and gives each Xid line to ``line``; where the log is not
readable, NVML's Xid events (which name no process) come on a thread of their own. Each Xid gets
its GPU (its PCI address -> index, NVML or nvidia-smi) and its rank (the driver's ``pid=``,
matched in the ranks' trees), and goes to the head at once (``Kind.XID``: a warning while the
job lives); a rank that then fails carries the Xids of its tree, or of the job's GPUs where the
driver named no process, in its ``rexit`` (``xids``).
"""

import threading
import time
from collections.abc import Callable
from typing import Any

from ptcluster.node.facts.gpu_errors import (
    NvmlXids,
    Xid,
    describe_xid,
    gpu_indices,
    parse_xid,
    xid_fix,
)
from ptcluster.node.facts.kernel_log import boot_wall
from ptcluster.node.guard.proctree import RankTrees
from ptcluster.node.wire import XidFacts

MAX_XIDS = 64
"""Xids kept per job (a failing GPU repeats its line many times a second)."""


class XidWatch:
    """One job's view of the GPU driver's Xids on this node (see the module's docstring)."""

    def __init__(self, ranks: RankTrees, look: Callable[[], None], gpus: list[int] | None,
                 nvml: Any, events: bool) -> None:
        """``ranks``: the ranks' trees (shared with the machine watch, under its lock);
        ``look``: reads the kernel's log now (the machine watch's); ``events``: take NVML's
        Xid events (``nvml``: a test's recorded answers; by default the driver's library)."""
        self.ranks = ranks
        self.lock = ranks.lock
        self.look = look
        self.gpus = list(gpus or [])
        """The GPU indices this job was given here ([]: not known)."""
        self.xids: list[XidFacts] = []
        """The driver's Xids since the job started, each with its GPU and rank where known."""
        self.unsent: list[XidFacts] = []
        """Xids not yet sent to the head (``new_xids``)."""
        self.pci: dict[str, int] | None = None
        """PCI address -> GPU index (read at the first Xid)."""
        self.boot_wall = boot_wall()
        self.events: NvmlXids | None = None
        self.events_thread: threading.Thread | None = None
        if events:
            try:
                self.events = NvmlXids(nvml)
            except (RuntimeError, AttributeError, OSError):
                self.events = None
        if self.events is not None:
            self.events_thread = threading.Thread(target=self.watch_events, daemon=True,
                                                  name="xid-events")
            self.events_thread.start()

    def watch_events(self) -> None:
        """NVML's Xid events until ``close`` (a wait of at most a second at a time)."""
        while self.events is not None and not self.events.closed:
            try:
                found = self.events.wait(1000)
            except (RuntimeError, AttributeError, OSError):
                return
            with self.lock:
                for xid in found:
                    self.note_xid(xid, time.time())

    def line(self, line: str, at: float) -> None:
        """One Xid line (under ``lock``), kept once (the journal gives it again on every
        read)."""
        xid = parse_xid(line)
        if xid is None:
            return
        when = self.boot_wall + at if at and self.boot_wall else time.time()
        if not any(x["text"] == xid["text"] and abs(x["at"] - when) < 0.01 for x in self.xids):
            self.note_xid(xid, when)

    def note_xid(self, xid: Xid, when: float) -> None:
        """An Xid (under ``lock``): its GPU, its rank, what it means; queued for the head."""
        if len(self.xids) >= MAX_XIDS:
            return
        rank = next((r for r, tree in self.ranks.trees.items()
                     if xid["pid"] and xid["pid"] in tree), None)
        gpu = xid.get("gpu")
        if gpu is None:
            if self.pci is None:
                self.pci = gpu_indices()
            gpu = self.pci.get(xid["pci"])
        said = describe_xid(xid["xid"], xid["text"])
        found: XidFacts = {**xid, **said, "fix": xid_fix(said["action"], gpu), "at": when,
                 "clock": time.strftime("%H:%M:%S", time.localtime(when)), "gpu": gpu,
                 "rank": rank, "jobs_gpu": gpu is not None and gpu in self.gpus}
        self.xids.append(found)
        self.unsent.append(found)

    def new_xids(self) -> list[XidFacts]:
        """The Xids seen since the last call (the link sends each to the head)."""
        with self.lock:
            out, self.unsent = self.unsent, []
        return out

    def xids_of(self, rank: int) -> list[XidFacts]:
        """A failed rank's Xids: those the driver blamed on a process of its tree, and those of
        the job's GPUs that named no process of another rank."""
        self.look()
        with self.lock:
            tree = self.ranks.trees.get(rank, set())
            return [x for x in self.xids if x["pid"] in tree or
                    (x["rank"] is None and x["jobs_gpu"])][:4]

    def close(self) -> None:
        if self.events is not None:
            events, self.events = self.events, None
            if self.events_thread is not None:
                self.events_thread.join(timeout=2)  # (it waits a second at most)
            with self.lock:
                events.close()
