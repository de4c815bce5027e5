"""What the machine saw when a rank died: the kernel's out-of-memory killer, the GPU driver.

Standard library only; a part of the guard (shipped by ``remote.bootstrap``).

Out of memory. ``MachineWatch`` notes the node's OOM-kill count (``/proc/vmstat`` ``oom_kill``)
when the job starts, and each rank's memory group's (cgroup v2 ``memory.events``, v1
``memory.oom_control``: both readable without privilege) when it first sees the group. On every
heartbeat it collects the pids of each rank's process tree: the kernel's victim is gone when we
look. When a rank ends with a failure, it reads the counters again and, where they rose and it
can, the kernel's own account of each kill: ``/dev/kmsg`` (root: opened at the job's start and
read without blocking, so only records written since) or ``journalctl -k`` (groups adm,
systemd-journal, wheel). A kill is the rank's only when its victim's pid was one of its tree's,
never by name (torch's processes are all called ``pt_main_thread``). The rank's ``rexit`` frame
carries what was found (``wire.OomFacts``); the head words it.

GPU errors. The same log carries the NVIDIA driver's Xids (``node.facts.gpu_errors``). The guard
reads it on every heartbeat while ranks run (``/dev/kmsg``: only what is new; ``journalctl``:
every ``JOURNAL_EVERY`` s; where neither is readable, NVML's Xid events, which name no process,
on a thread of their own), names each Xid's GPU (its PCI address -> index, NVML or nvidia-smi)
and its rank (the driver's ``pid=``, matched in the ranks' trees), and sends it to the head at
once (``Kind.XID``: a warning while the job lives); a rank that then fails carries the Xids of
its tree, or of the job's GPUs where the driver named no process, in its ``rexit`` (``xids``).
The disk facts of a rank's ENOSPC are ``guard.disk``'s.
"""

import os
import re
import signal
import threading
import time
from typing import Any

from ptcluster.node.facts.gpu_errors import (
    NvmlXids,
    describe_xid,
    gpu_indices,
    parse_xid,
    xid_fix,
)
from ptcluster.node.facts.kernel_log import (
    LOG_JOURNAL,
    LOG_KMSG,
    boot_wall,
    journal_readable,
    oomd_kills,
    open_kmsg,
    read_journal,
    read_kmsg,
    within,
)
from ptcluster.node.guard.disk import FULL_ERRNOS, disk_facts
from ptcluster.node.guard.proctree import children_map
from ptcluster.node.guard.schedstat import cgroup_mounts, meminfo

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
JOURNAL_EVERY = 5.0
"""Seconds between two reads of the journal for Xids while ranks run (a ``journalctl`` each;
``/dev/kmsg`` is read on every heartbeat: a read of what is new costs nothing)."""
MAX_XIDS = 64
"""Xids kept per job (a failing GPU repeats its line many times a second)."""
class MachineWatch:
    """One job's view of the kernel's OOM kills on this node (see the module's docstring)."""

    def __init__(self, gpus: list[int] | None = None, nvml: Any = None) -> None:
        """``nvml``: NVML to take Xid events from (a test's recorded answers; by default the
        driver's library, only where the kernel's log is not readable)."""
        self.lock = threading.Lock()
        self.node_base = vmstat_oom_kills()
        own = memory_group(os.getpid())
        count = group_oom_kills(own[0]) if own is not None else None
        self.inherited: dict[str, Any] | None = None if own is None or count is None else \
            {"file": own[0], "base": count, "limit": own[1]}
        """The guard's own memory group and its count now, before any rank exists: what a rank
        inherits unless it moves. A rank first seen in it counts from here, not from when its
        start record came (a rank killed in its first moments, before the guard looked, had
        its kill counted in the base: ``group_kills`` 0 on a loaded CI machine)."""
        self.since = time.time()
        self.kmsg = open_kmsg(at_end=True)
        self.log = LOG_KMSG if self.kmsg is not None else \
            LOG_JOURNAL if journal_readable() else ""
        """Where this guard reads the kernel's log ("" where it cannot)."""
        self.roots: dict[int, int] = {}
        """Per rank: its program's pid."""
        self.trees: dict[int, set[int]] = {}
        """Per rank: every pid its tree had (the shim, its program, their children)."""
        self.groups: dict[int, dict[str, Any]] = {}
        """Per rank: its memory group's counter file, the count first seen there, its limit."""
        self.unified: dict[int, str] = {}
        """Per rank: its control group in the unified (v2) hierarchy, where it has one (what
        systemd-oomd names when it kills)."""
        self.kills: list[dict[str, Any]] = []
        """The kernel's victims since the job started (read so far)."""
        self.pending: dict[int, dict[str, Any]] = {}
        """Per pid: the ``oom-kill:`` line's facts, until its ``Killed process`` line comes."""
        self.waited = 0
        """The node's count the log was last waited for in vain (``victims``)."""
        self.mem: tuple[int, int] | None = None
        """(available, total) bytes of the node's memory at the last look."""
        self.gpus = list(gpus or [])
        """The GPU indices this job was given here ([]: not known)."""
        self.xids: list[dict[str, Any]] = []
        """The driver's Xids since the job started, each with its GPU and rank where known."""
        self.unsent: list[dict[str, Any]] = []
        """Xids not yet sent to the head (``new_xids``)."""
        self.pci: dict[str, int] | None = None
        """PCI address -> GPU index (read at the first Xid)."""
        self.boot_wall = boot_wall()
        self.journal_read = 0.0
        self.events: NvmlXids | None = None
        self.events_thread: threading.Thread | None = None
        if not self.log or nvml is not None:
            try:
                self.events = NvmlXids(nvml)
            except (RuntimeError, AttributeError, OSError):
                self.events = None
        if self.events is not None:
            self.events_thread = threading.Thread(target=self.watch_events, daemon=True,
                                                  name="xid-events")
            self.events_thread.start()

    def started(self, rank: int, pid: int, shim_pid: int) -> None:
        """A rank's program started (its pid, its shim's)."""
        with self.lock:
            self.trees.setdefault(rank, set()).update(p for p in (pid, shim_pid) if p > 0)
            self.roots[rank] = pid
        self.note_group(rank, pid)

    def scan(self, roots: dict[int, int]) -> None:
        """Every heartbeat while ranks run: each rank's tree (``roots``: rank -> its program's
        pid), its memory group, the node's memory."""
        children = children_map()
        for rank, root in roots.items():
            tree, todo = [root], [root]
            while todo:
                kids = children.get(todo.pop(), [])
                tree += kids
                todo += kids
            with self.lock:
                self.trees.setdefault(rank, set()).update(tree)
            self.note_group(rank, root)
        mem = meminfo()
        if mem.get("MemTotal") and "MemAvailable" in mem:
            self.mem = (mem["MemAvailable"] * 1024, mem["MemTotal"] * 1024)
        if self.kmsg is not None or (self.log and time.monotonic() - self.journal_read
                                     >= JOURNAL_EVERY):
            self.read_log()

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
                    self.groups[rank] = dict(self.inherited)
                return
            path, limit = found
            if known is None and self.inherited is not None \
                    and self.inherited["file"] == path:
                self.groups[rank] = dict(self.inherited)
            elif known is None or known["file"] != path:
                count = group_oom_kills(path)
                if count is not None:
                    self.groups[rank] = {"file": path, "base": count, "limit": limit}

    def after_exit(self, rank: int, code: int | None) -> dict[str, Any] | None:
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
        facts: dict[str, Any] = {"node_kills": node, "group_kills": in_group, "log": self.log}
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

    def oomd_said(self, rank: int, code: int | None) -> dict[str, Any] | None:
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
        facts: dict[str, Any] = {"node_kills": 0, "group_kills": 0, "log": LOG_JOURNAL,
                                 "victims": [], "oomd": {"group": killed[-1][0],
                                                          "why": killed[-1][1]}}
        if self.mem is not None:
            facts["mem_available"], facts["mem_total"] = self.mem
        return facts

    def victims(self, rank: int, counted: int) -> list[dict[str, Any]]:
        """The kernel's victims in the rank's tree. Until the log has as many kills as the
        node counted (``counted``), it waits for them, ``LOG_WAIT`` s at most and once per
        count: a rank whose tree was not hit then costs nothing (the others of a job ended by
        an OOM kill), nor does a log that never shows them."""
        deadline = time.monotonic() + LOG_WAIT
        while True:
            self.read_log()
            with self.lock:
                tree = self.trees.get(rank, set())
                mine = [victim(k, "tree", k["pid"] == self.roots.get(rank))
                        for k in self.kills if k["pid"] in tree] or self.tied_by_group(rank)
                told = len(self.kills)
            if mine or told >= counted or counted <= self.waited:
                return mine[:4]
            if time.monotonic() >= deadline:
                self.waited = counted  # waited once for these: the next rank does not
                return mine[:4]
            time.sleep(0.05)

    def tied_by_group(self, rank: int) -> list[dict[str, Any]]:
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
        seen = set().union(*self.trees.values()) if self.trees else set()
        return [victim(k, "group", False) for k in self.kills
                if k["pid"] not in seen and k.get("uid") == os.getuid()
                and where not in ("", "/") and k.get("task_memcg") == where]

    def read_log(self) -> None:
        """The kernel's lines written since the job started (or since the last read)."""
        if self.kmsg is not None:
            records = read_kmsg(self.kmsg)
        else:
            records = read_journal(self.since)
            self.journal_read = time.monotonic()
            self.kills = []  # journalctl gives every line since the start again
        with self.lock:
            for at, line in records:
                self.parse(line, at)

    def parse(self, line: str, at: float = 0.0) -> None:
        if line.startswith("NVRM: Xid"):  # (each at the start of the record: M2)
            self.xid(line, at)
            return
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
        kill = {"pid": pid, "comm": m.group(2), "rss": rss, **self.pending.pop(pid, {}),
                "uid": int(uid.group(1)) if uid else None}
        if kill not in self.kills:
            self.kills.append(kill)

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

    def xid(self, line: str, at: float) -> None:
        """One Xid line (under ``lock``), kept once (the journal gives it again on every
        read)."""
        xid = parse_xid(line)
        if xid is None:
            return
        when = self.boot_wall + at if at and self.boot_wall else time.time()
        if not any(x["text"] == xid["text"] and abs(x["at"] - when) < 0.01 for x in self.xids):
            self.note_xid(xid, when)

    def note_xid(self, xid: dict[str, Any], when: float) -> None:
        """An Xid (under ``lock``): its GPU, its rank, what it means; queued for the head."""
        if len(self.xids) >= MAX_XIDS:
            return
        rank = next((r for r, tree in self.trees.items() if xid["pid"] and xid["pid"] in tree),
                    None)
        gpu = xid.get("gpu")
        if gpu is None:
            if self.pci is None:
                self.pci = gpu_indices()
            gpu = self.pci.get(xid["pci"])
        said = describe_xid(xid["xid"], xid["text"])
        found = {**xid, **said, "fix": xid_fix(said["action"], gpu), "at": when,
                 "clock": time.strftime("%H:%M:%S", time.localtime(when)), "gpu": gpu,
                 "rank": rank, "jobs_gpu": gpu is not None and gpu in self.gpus}
        self.xids.append(found)
        self.unsent.append(found)

    def new_xids(self) -> list[dict[str, Any]]:
        """The Xids seen since the last call (the link sends each to the head)."""
        with self.lock:
            out, self.unsent = self.unsent, []
        return out

    def look(self) -> None:
        """The kernel's log now, not at the next heartbeat: a rank's exit, the last one's."""
        if self.log:
            self.read_log()

    def xids_of(self, rank: int) -> list[dict[str, Any]]:
        """A failed rank's Xids: those the driver blamed on a process of its tree, and those of
        the job's GPUs that named no process of another rank."""
        self.look()
        with self.lock:
            tree = self.trees.get(rank, set())
            return [x for x in self.xids if x["pid"] in tree or
                    (x["rank"] is None and x["jobs_gpu"])][:4]

    def after_error(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The disk facts of a rank's error record that says its filesystem was full."""
        if body.get("errno") not in FULL_ERRNOS:
            return None
        return disk_facts(str(body.get("filename") or ""))

    def close(self) -> None:
        if self.events is not None:
            events, self.events = self.events, None
            if self.events_thread is not None:
                self.events_thread.join(timeout=2)  # (it waits a second at most)
            with self.lock:
                events.close()
        if self.kmsg is not None:
            os.close(self.kmsg)
            self.kmsg = None


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


def victim(kill: dict[str, Any], tied: str, main: bool) -> dict[str, Any]:
    """A kill as the rank's exit says it (``wire.OomVictim``): how it was tied to the rank."""
    keys = ("pid", "comm", "rss", "constraint", "memcg")
    return {**{k: kill[k] for k in keys if k in kill}, "main": main, "tied": tied}


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
