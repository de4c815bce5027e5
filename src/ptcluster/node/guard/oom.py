"""Out of memory: the kernel's OOM kills of a rank's tree, and systemd-oomd's (``OomWatch``,
one of ``guard.machine.MachineWatch``'s watches).

Standard library only; a part of the guard (shipped by ``remote.bootstrap``).

It notes the node's OOM-kill count (``/proc/vmstat`` ``oom_kill``) when the job starts, and each
rank's memory group's (cgroup v2 ``memory.events``, v1 ``memory.oom_control``: both readable
without privilege) when it first sees the group. The machine watch collects the pids of each
rank's process tree on every heartbeat: the kernel's victim is gone when we look. When a rank
ends with a failure, it reads the counters again and, where they rose and it can, the kernel's
own account of each kill (the lines ``parse`` is given from the kernel's log). A kill is the
rank's only when its victim's pid was one of its tree's, never by name (torch's processes are
all called ``pt_main_thread``). The rank's ``rexit`` frame carries what was found
(``wire.OomFacts``); the head words it.
"""

import os
import re
import signal
import time
from collections.abc import Callable
from typing import TypedDict

from ptcluster.node.facts.kernel_log import LOG_JOURNAL, journal_readable, oomd_kills, within
from ptcluster.node.guard.proctree import RankTrees
from ptcluster.node.guard.schedstat import cgroup_mounts
from ptcluster.node.wire import OomFacts, OomVictim

LOG_WAIT = 1.0
"""Seconds the guard waits at most for the kernel's account of a kill it counted (the line is
written just after the signal; journald copies it a moment later)."""
KILLED = re.compile(r"(?:Memory cgroup out of memory|Out of memory)(?: \([a-z_]+\))?: "
                    r"Kill(?:ed)? process (\d+) \((.*)\)( total-vm:.*| score .*|)$")
"""The kernel's line for each victim (mm/oom_kill.c: ``%s: Killed process %d (%s) total-vm:…,
anon-rss:…kB, file-rss:…kB, shmem-rss:…kB, UID:…``; older kernels ``Kill process N (x)``), at
the start of the record only (a control group's name in another line is free text: review M2);
the name is the longest before what follows it (a ``comm`` may hold ``)``)."""
RSS = re.compile(r"(anon|file|shmem)-rss:(\d+)kB")
UID = re.compile(r"UID:(\d+)")


class MemGroup(TypedDict):
    """A rank's memory group as first seen: its counter file, the count there, its limit."""

    file: str
    base: int
    limit: int | None


class KillWhy(TypedDict, total=False):
    """A kill's ``oom-kill:`` line: why (``CONSTRAINT_*``) and which groups."""

    constraint: str
    memcg: str
    task_memcg: str


class KernelKill(KillWhy):
    """One victim of the kernel's OOM killer, as its log lines say (:meth:`OomWatch.parse`)."""

    pid: int
    comm: str
    rss: int
    """Bytes."""
    uid: int | None


class OomWatch:
    """One job's view of the kernel's OOM kills on this node (see the module's docstring)."""

    def __init__(self, ranks: RankTrees, read_log: Callable[[], None]) -> None:
        """``ranks``: the ranks' trees (shared with the machine watch, under its lock);
        ``read_log``: reads the kernel's log into ``parse`` (the machine watch's)."""
        self.ranks = ranks
        self.lock = ranks.lock
        self.read_log = read_log
        self.node_base = vmstat_oom_kills()
        own = memory_group(os.getpid())
        count = group_oom_kills(own[0]) if own is not None else None
        self.inherited: MemGroup | None = None if own is None or count is None else \
            {"file": own[0], "base": count, "limit": own[1]}
        """The guard's own memory group and its count now, before any rank exists: what a rank
        inherits unless it moves. A rank first seen in it counts from here, not from when its
        start record came (a rank killed in its first moments, before the guard looked, had
        its kill counted in the base: ``group_kills`` 0 on a loaded CI machine)."""
        self.since = time.time()
        self.log = ""
        """Where the kernel's log is read ("" where it cannot): the machine watch says."""
        self.groups: dict[int, MemGroup] = {}
        """Per rank: its memory group's counter file, the count first seen there, its limit."""
        self.unified: dict[int, str] = {}
        """Per rank: its control group in the unified (v2) hierarchy, where it has one (what
        systemd-oomd names when it kills)."""
        self.kills: list[KernelKill] = []
        """The kernel's victims since the job started (read so far)."""
        self.pending: dict[int, KillWhy] = {}
        """Per pid: the ``oom-kill:`` line's facts, until its ``Killed process`` line comes."""
        self.waited = 0
        """The node's count the log was last waited for in vain (``victims``)."""
        self.mem: tuple[int, int] | None = None
        """(available, total) bytes of the node's memory at the last look."""

    def note_group(self, rank: int, pid: int) -> None:
        """The memory group ``pid`` is in now, with its count (a group first seen counts from
        there: a rank may move itself into another)."""
        unified = unified_group(pid)
        if unified:
            with self.lock:
                self.unified[rank] = unified
        found = memory_group(pid)
        with self.lock:
            known = self.groups.get(rank)
            if found is None:  # (gone already: it was where it started, the guard's group)
                if known is None and self.inherited is not None:
                    self.groups[rank] = self.inherited.copy()
                return
            path, limit = found
            if known is None and self.inherited is not None \
                    and self.inherited["file"] == path:
                self.groups[rank] = self.inherited.copy()
            elif known is None or known["file"] != path:
                count = group_oom_kills(path)
                if count is not None:
                    self.groups[rank] = {"file": path, "base": count, "limit": limit}

    def after_exit(self, rank: int, code: int | None) -> OomFacts | None:
        """The OOM facts of a rank that ended with ``code`` (None: without an exit record):
        None when no counter rose (or the rank succeeded)."""
        if code == 0:
            return None
        now = vmstat_oom_kills()
        node = now - self.node_base if now is not None and self.node_base is not None else 0
        group = self.groups.get(rank)
        in_group = 0
        if group is not None:
            count = group_oom_kills(group["file"])
            in_group = count - group["base"] if count is not None else 0
        if node <= 0 and in_group <= 0:
            return self.oomd_said(rank, code)
        facts: OomFacts = {"node_kills": node, "group_kills": in_group, "log": self.log}
        if group is not None:
            facts["group"] = os.path.dirname(group["file"])
            if group["limit"]:
                facts["group_limit"] = group["limit"]
        if self.mem is not None:
            facts["mem_available"], facts["mem_total"] = self.mem
        facts["victims"] = self.victims(rank, node) if self.log else []
        if node > 0 and not self.kills:
            # The node counted kills its log does not show (journald not running, a
            # container's own /dev/kmsg): say what is known, not "none of its processes".
            facts["log"] = ""
        return facts

    def oomd_said(self, rank: int, code: int | None) -> OomFacts | None:
        """A SIGKILLed rank no kernel counter explains: did systemd-oomd kill its control group
        (or one above it)? Only where its journal is readable; None otherwise."""
        if code not in (None, -signal.SIGKILL) or not journal_readable():
            return None
        group = self.unified.get(rank, "")
        if group in ("", "/"):  # (the root group: nothing oomd manages)
            return None
        killed = [(cg, why) for cg, why in oomd_kills(self.since) if within(group, cg)]
        if not killed:
            return None
        facts: OomFacts = {"node_kills": 0, "group_kills": 0, "log": LOG_JOURNAL,
                           "victims": [], "oomd": {"group": killed[-1][0],
                                                    "why": killed[-1][1]}}
        if self.mem is not None:
            facts["mem_available"], facts["mem_total"] = self.mem
        return facts

    def victims(self, rank: int, counted: int) -> list[OomVictim]:
        """The kernel's victims in the rank's tree. Until the log has as many kills as the
        node counted (``counted``), it waits for them, ``LOG_WAIT`` s at most and once per
        count: a rank whose tree was not hit then costs nothing (the others of a job ended by
        an OOM kill), nor does a log that never shows them."""
        deadline = time.monotonic() + LOG_WAIT
        while True:
            self.read_log()
            with self.lock:
                tree = self.ranks.trees.get(rank, set())
                mine = [victim(k, "tree", k["pid"] == self.ranks.roots.get(rank))
                        for k in self.kills if k["pid"] in tree] or self.tied_by_group(rank)
                told = len(self.kills)
            if mine or told >= counted or counted <= self.waited:
                return mine[:4]
            if time.monotonic() >= deadline:
                self.waited = counted  # waited once for these: the next rank does not
                return mine[:4]
            time.sleep(0.05)

    def tied_by_group(self, rank: int) -> list[OomVictim]:
        """Victims no look saw in any rank's tree (a process that lived less than a heartbeat:
        a DataLoader worker killed as it started), tied to ``rank`` by what the kernel's record
        still holds: the same user as the guard's and the rank's own memory group (under
        ``lock``). Less sure than a tree (``tied: group``): a process of the same user in the
        same group that was not the rank's would be named too; never the root group (the whole
        node's)."""
        group = self.groups.get(rank)
        if group is None:
            return []
        where = group_path(os.path.dirname(group["file"]))
        seen = set().union(*self.ranks.trees.values()) if self.ranks.trees else set()
        return [victim(k, "group", False) for k in self.kills
                if k["pid"] not in seen and k.get("uid") == os.getuid()
                and where not in ("", "/") and k.get("task_memcg") == where]

    def parse(self, line: str) -> None:
        """One line of the kernel's log (under ``lock``): a kill's two lines, kept once."""
        if line.startswith("oom-kill:"):  # the line before: why (CONSTRAINT_NONE: the node's
            # memory, CONSTRAINT_MEMCG: a memory group's limit) and which group
            said = dict(kv.partition("=")[::2] for kv in line.split("oom-kill:", 1)[1].split(","))
            if said.get("pid", "").isdigit():
                self.pending[int(said["pid"])] = {"constraint": said.get("constraint", ""),
                                                  "memcg": said.get("oom_memcg", ""),
                                                  "task_memcg": said.get("task_memcg", "")}
            return
        m = KILLED.match(line)
        if m is None:
            return
        pid = int(m.group(1))
        rss = sum(int(kb) for _, kb in RSS.findall(m.group(3))) * 1024
        uid = UID.search(m.group(3))
        kill: KernelKill = {"pid": pid, "comm": m.group(2), "rss": rss,
                            **self.pending.pop(pid, KillWhy()),
                            "uid": int(uid.group(1)) if uid else None}
        if kill not in self.kills:
            self.kills.append(kill)


def vmstat_oom_kills() -> int | None:
    """The node's OOM kills since boot (``/proc/vmstat``, kernel >= 4.13)."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def victim(kill: KernelKill, tied: str, main: bool) -> OomVictim:
    """A kill as the rank's exit says it: how it was tied to the rank."""
    out: OomVictim = {"pid": kill["pid"], "comm": kill["comm"], "rss": kill["rss"]}
    if "constraint" in kill:
        out["constraint"] = kill["constraint"]
    if "memcg" in kill:
        out["memcg"] = kill["memcg"]
    out["main"], out["tied"] = main, tied
    return out


def group_path(folder: str) -> str:
    """A memory group's folder as the kernel's records name it (``task_memcg=/a/b``): its path
    below the controller's mount; "" when it is under none."""
    for mount in cgroup_mounts("memory").values():
        if folder == mount:
            return "/"
        if folder.startswith(mount.rstrip("/") + "/"):
            return folder[len(mount.rstrip("/")):]
    return ""


def memory_group(pid: int) -> tuple[str, int] | None:
    """``pid``'s memory group: its OOM counter file and its limit (0: none or not readable)."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    mounts = cgroup_mounts("memory")
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(",") and "v1" in mounts:
            base = mounts["v1"] + path
            return base + "/memory.oom_control", read_int(base + "/memory.limit_in_bytes")
    for line in lines:
        if line.startswith("0::") and "v2" in mounts:
            base = mounts["v2"] + line[3:]
            if os.path.exists(base + "/memory.events"):
                return base + "/memory.events", read_int(base + "/memory.max")
    return None


def unified_group(pid: int) -> str:
    """``pid``'s control group in the unified hierarchy (``0::PATH`` of ``/proc/PID/cgroup``);
    "" where it has none."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    return line[3:].strip()
    except OSError:
        pass
    return ""


def group_oom_kills(path: str) -> int | None:
    """The ``oom_kill`` count of a memory group's counter file (v1 and v2 both say it so)."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def read_int(path: str) -> int:
    try:
        with open(path) as f:
            value = int(f.read().strip())
    except (OSError, ValueError):
        return 0
    return value if value < 1 << 60 else 0  # v1's "no limit" is a huge number
