"""What the machine saw of a rank's death, as declared problems (``TABLE``: ``run.*`` codes): the
kernel's OOM killer or systemd-oomd, the GPU driver's Xids, a full disk.

Pure: the guard's facts (``wire.OomFacts`` and ``wire.XidFacts`` in a rank's exit,
``wire.DiskFacts`` in its error, ``node.guard.machine``) in, a problem (its code and fields, and
the message and fix they fill in) out.
``verdict.judge_rank`` asks; the supervisor words an Xid that no rank died of as a warning."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ptcluster.errors import Problem
from ptcluster.launch.result import signame
from ptcluster.node import wire
from ptcluster.node.problems import Declared

FULL_ERRNOS = (28, 122)
"""ENOSPC, EDQUOT: what a full filesystem (or quota) raises."""
WORKER_DIED = ("is killed by signal: Killed", "exited unexpectedly")
"""torch's DataLoader, when one of its workers was SIGKILLed (the rank's own exception: its
text differs between torch versions and with the moment the loader notices)."""
LOG_HOW = ("To see the kernel's account: `sudo dmesg | grep -i 'killed process'` on {host} (or "
           "`journalctl -k` there, for members of group adm where journald runs)")


GROUP_FIX = ("the job needs more memory than its memory group allows: raise the limit (a "
             "scheduler's --mem, the container's memory) or use less: fewer ranks or "
             "DataLoader workers per node, a smaller batch or model")
NODE_FIX = ("use less memory on {host}: fewer ranks or DataLoader workers per node, a smaller "
            "batch or model, or a node with more memory; check what else runs there "
            "(`ptcluster monitor`)")
OOMD_FIX = ("; or run the job outside the slice systemd-oomd watches (its "
            "ManagedOOMMemoryPressure=), or raise that slice's ManagedOOMMemoryPressureLimit=")
OOMD = ("killed by systemd-oomd, which ended the whole control group {group} on {host} (due to "
        "{why}); the kernel's own out-of-memory killer did not run")
KILLED = "killed by the kernel's out-of-memory killer ({victim}{more}; {room}){then}"
COUNTED = ("{how}, and the kernel's out-of-memory killer ran on {host} while it did ({counts}); "
           "the kernel's log is not readable here to name its victim")
OOMD_NODE = Declared("run.oomd-killed", "systemd-oomd ended the rank's control group", OOMD,
                     NODE_FIX + OOMD_FIX)
OOMD_GROUP = Declared("run.oomd-killed-group",
                      "systemd-oomd ended the rank's control group (a limited memory group)",
                      OOMD, GROUP_FIX + OOMD_FIX)
OOM_NODE = Declared("run.oom-killed", "the kernel's out-of-memory killer killed the rank",
                    KILLED, NODE_FIX)
OOM_GROUP = Declared("run.oom-killed-group",
                     "the kernel's out-of-memory killer killed the rank in its memory group",
                     KILLED, GROUP_FIX)
OOM_COUNTED = Declared("run.oom-counted",
                       "the out-of-memory killer ran on the rank's node (its log unreadable)",
                       COUNTED, NODE_FIX + ". " + LOG_HOW)
OOM_COUNTED_GROUP = Declared(
    "run.oom-counted-group",
    "the out-of-memory killer ran in the rank's memory group (its log unreadable)",
    COUNTED, GROUP_FIX + ". " + LOG_HOW)
DISK_FULL = Declared(
    "run.disk-full", "the rank's filesystem is full",
    "{raised}; the {what} is full: {mount} ({fstype}) on {host} now has {free} free of {total}",
    "free space on {host}'s {mount}, or write the files (the checkpoint directory) to a larger "
    "filesystem; a checkpoint written to a temporary file and renamed (as the reference "
    "trainer does) leaves the one saved before intact: resume from it (`--resume`)")
DISK_FULL_UNNAMED = Declared(
    "run.disk-full-unnamed", "a filesystem of the rank's is full (the error named no file)",
    "{raised}; the {what} is full ({where})",
    "free space on {host} (`df -h` there), or write to a larger filesystem")
XID_SAID = "{where} reported Xid {xid}{at}{whose}: {meaning}"
"""An Xid the GPU driver wrote, as the head says it (a warning, or a rank's cause)."""
GPU_XID = Declared(
    "run.gpu-xid", "the GPU driver reported an Xid before the rank failed",
    "{how}, after " + XID_SAID + "{more}",
    "{fix} (Xid {xid} in NVIDIA's catalog: docs.nvidia.com/deploy/xid-errors)")
TABLE = (OOMD_NODE, OOMD_GROUP, OOM_NODE, OOM_GROUP, OOM_COUNTED, OOM_COUNTED_GROUP, DISK_FULL,
         DISK_FULL_UNNAMED, GPU_XID)
"""What the machine saw of a rank's death (``run.*`` codes: ``launch.problems`` gathers them
with the supervisor's)."""


@dataclass(frozen=True)
class Named:
    """A rank's end as the machine explains it: its declared problem (who None: the verdict's
    caller names the rank), kind and the node's facts."""

    problem: Problem
    kind: str
    """A ``result.FailureKind`` value: ``oom``, ``gpu`` or ``disk``."""
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def message(self) -> str:
        return self.problem.what

    @property
    def fix(self) -> str:
        return self.problem.fix or ""


def size(n: float) -> str:
    """Bytes for a human: ``11.2 GiB``, ``60.0 MiB``, ``0 B``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def oom_named(host: str, code: int | None, oom: wire.OomFacts, raised: str) -> Named | None:
    """The rank's end when the kernel's OOM killer did it; None when the facts do not say so
    (the log was read and names none of its processes, or only a count rose and the rank's end
    does not look like a kill: its own exception says otherwise)."""
    victims = oom.get("victims") or []
    if code not in (None, -signal.SIGKILL) and not _worker_died(raised):
        # tied by group alone: only when the rank's end says a process of its own died
        victims = [v for v in victims if v.get("tied") != "group"]
    group = _group_limited(oom)
    facts: dict[str, Any] = {"oom": dict(oom)}
    oomd = oom.get("oomd")
    if oomd:
        said = dict(group=oomd.get("group") or "?", why=oomd.get("why") or "?")
        return Named(Problem.of(OOMD_GROUP, None, host=host, **said) if group else
                     Problem.of(OOMD_NODE, None, host=host, **said), "oom", facts)
    how = ("killed by SIGKILL" if code == -signal.SIGKILL else
           "ended without an exit status" if code is None else
           f"killed by {signame(-code)}" if code < 0 else f"exited with code {code}")
    if raised:
        how += f" ({raised})"
    if victims:
        first = victims[0]
        main = any(v.get("main") for v in victims)
        victim = dict(victim=_victim_said(first, main, raised),
                      more=f" and {len(victims) - 1} more of its processes" if len(victims) > 1
                      else "", room=_room(host, oom, first),
                      then="" if main else f"; the rank then {how}")
        return Named(Problem.of(OOM_GROUP, None, **victim) if group else
                     Problem.of(OOM_NODE, None, host=host, **victim), "oom", facts)
    if oom.get("log"):
        return None
    if code not in (None, -signal.SIGKILL) and not _worker_died(raised):
        return None
    counts = f"the node's OOM-kill count rose by {oom.get('node_kills', 0)}"
    if oom.get("group_kills"):
        counts += f", its memory group's by {oom.get('group_kills')}"
        if oom.get("group_limit"):
            counts += f", a group limited to {size(oom.get('group_limit', 0))}"
    entry = OOM_COUNTED_GROUP if group else OOM_COUNTED
    return Named(Problem.of(entry, None, how=how, host=host, counts=counts), "oom", facts)


def _victim_said(first: wire.OomVictim, main: bool, raised: str) -> str:
    whose = "" if main else ("its DataLoader worker, " if _worker_died(raised) else
                             "a process of its tree, ")
    said = f"{whose}pid {first.get('pid')}, {first.get('comm') or '?'}"
    if first.get("tied") == "group":  # (no look saw it: how sure, said)
        said = (f"probably {said}: it lived between two of the guard's looks, tied to the rank "
                "by its user and memory group in the kernel's record")
    if first.get("rss"):
        said += f", {size(first.get('rss', 0))} resident"
    return said


def _worker_died(raised: str) -> bool:
    return "DataLoader worker" in raised and any(said in raised for said in WORKER_DIED)


def _room(host: str, oom: wire.OomFacts, victim: wire.OomVictim) -> str:
    """How much memory there was: the memory group's limit, or the node's."""
    if victim.get("constraint") == "CONSTRAINT_MEMCG":
        group = victim.get("memcg") or oom.get("group") or "?"
        limit = oom.get("group_limit")
        return f"its memory group {group} is limited to {size(limit)}" if limit else \
            f"its memory group {group} hit its limit"
    if oom.get("mem_total"):
        return (f"{host} had {size(oom.get('mem_available', 0))} of "
                f"{size(oom.get('mem_total', 0))} available at the guard's last look")
    return f"{host} ran out of memory"


def _group_limited(oom: wire.OomFacts) -> bool:
    """The memory group's limit, not the node's memory, is what ran out (its fix)."""
    victims = oom.get("victims") or []
    return any(v.get("constraint") == "CONSTRAINT_MEMCG" for v in victims) or bool(
        not victims and oom.get("group_kills") and oom.get("group_limit"))


def disk_named(host: str, errno: int | None, disk: wire.DiskFacts | None,
               raised: str) -> Named | None:
    """A rank whose code raised ENOSPC or EDQUOT: its filesystem, with free and total space as
    its guard saw them; None for any other error."""
    if errno not in FULL_ERRNOS:
        return None
    what = "quota" if errno == 122 else "filesystem"
    facts: dict[str, Any] = {"disk": dict(disk or {})}
    if disk and disk.get("mount"):
        return Named(Problem.of(DISK_FULL, None, raised=raised, what=what, host=host,
                                mount=disk.get("mount"), fstype=disk.get("fstype") or "?",
                                free=size(disk.get("free", 0)),
                                total=size(disk.get("total", 0))), "disk", facts)
    full = (disk or {}).get("full") or []
    named = ", ".join(f"{f.get('mount')} ({f.get('fstype') or '?'}) {size(f.get('free', 0))}"
                      f" free of {size(f.get('total', 0))}" for f in full)
    where = f"nearly full on {host}: {named}" if named else \
        "the error named no file, and no filesystem of the node is nearly full now"
    return Named(Problem.of(DISK_FULL_UNNAMED, None, raised=raised, what=what, where=where,
                            host=host), "disk", facts)


def _xid_parts(host: str, xid: wire.XidFacts) -> dict[str, object]:
    """The fields of ``XID_SAID``: the GPU, the node, whose process, what it means."""
    gpu = xid.get("gpu")
    whose = ""
    if xid.get("rank") is not None:
        whose = f", in rank {xid.get('rank')}'s process {xid.get('pid')}"
    elif xid.get("pid"):
        whose = f", in process {xid.get('pid')} ({xid.get('name') or '?'}: not one of the job's)"
    return dict(where=f"GPU {gpu} on {host}" if gpu is not None else
                f"the GPU at PCI {xid.get('pci') or '?'} on {host}",
                xid=xid.get("xid"), at=f" at {xid.get('clock')}" if xid.get("clock") else "",
                whose=whose, meaning=xid.get("meaning") or "?")


def xid_said(host: str, xid: wire.XidFacts) -> str:
    """One Xid as a line: the GPU, the node, whose process, what it means, what to do."""
    return f"{XID_SAID.format(**_xid_parts(host, xid))}; what to do: {xid.get('fix') or '?'}"


def xid_named(host: str, how: str, xids: Sequence[wire.XidFacts]) -> Named | None:
    """A rank that failed after the GPU driver wrote an Xid for one of its processes or one of
    the job's GPUs on its node: the Xid is the cause (the rank's own CUDA or NCCL error is
    what it saw of it)."""
    if not xids:
        return None
    first = next((x for x in xids if x.get("fatal")), xids[0])
    more = f" (and {len(xids) - 1} more Xid(s))" if len(xids) > 1 else ""
    return Named(Problem.of(GPU_XID, None, how=how, more=more,
                            fix=first.get("fix") or "no action is known here for it",
                            **_xid_parts(host, first)),
                 "gpu", {"xids": [dict(x) for x in xids]})
