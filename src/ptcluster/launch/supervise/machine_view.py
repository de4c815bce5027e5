"""What the machine saw of a rank's death, in words: the kernel's OOM killer, the GPU driver's
Xids, a full disk.

Pure: the guard's facts (``wire.OomFacts`` and ``wire.XidFacts`` in a rank's exit,
``wire.DiskFacts`` in its error, ``node.guard.machine``) in, a message and its fix out.
``verdict.judge_rank`` asks; the supervisor words an Xid that no rank died of as a warning."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ptcluster.launch.result import signame
from ptcluster.node import wire

FULL_ERRNOS = (28, 122)
"""ENOSPC, EDQUOT: what a full filesystem (or quota) raises."""
WORKER_DIED = ("is killed by signal: Killed", "exited unexpectedly")
"""torch's DataLoader, when one of its workers was SIGKILLed (the rank's own exception: its
text differs between torch versions and with the moment the loader notices)."""
LOG_HOW = ("To see the kernel's account: `sudo dmesg | grep -i 'killed process'` on {host} (or "
           "`journalctl -k` there, for members of group adm where journald runs)")


@dataclass(frozen=True)
class Named:
    """A rank's end as the machine explains it."""

    message: str
    fix: str
    kind: str
    """A ``result.FailureKind`` value: ``oom``, ``gpu`` or ``disk``."""
    facts: dict[str, Any] = field(default_factory=dict)


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
    oomd = oom.get("oomd")
    if oomd:
        return Named(f"killed by systemd-oomd, which ended the whole control group "
                     f"{oomd.get('group') or '?'} on {host} (due to {oomd.get('why') or '?'}); "
                     "the kernel's own out-of-memory killer did not run",
                     f"{_fix(host, oom)}; or run the job outside the slice systemd-oomd "
                     "watches (its ManagedOOMMemoryPressure=), or raise that slice's "
                     "ManagedOOMMemoryPressureLimit=", "oom", {"oom": dict(oom)})
    how = ("killed by SIGKILL" if code == -signal.SIGKILL else
           "ended without an exit status" if code is None else
           f"killed by {signame(-code)}" if code < 0 else f"exited with code {code}")
    if victims:
        return Named(_victims_said(host, code, victims, oom, raised, how), _fix(host, oom),
                     "oom", {"oom": dict(oom)})
    if oom.get("log"):
        return None
    if code not in (None, -signal.SIGKILL) and not _worker_died(raised):
        return None
    counts = f"the node's OOM-kill count rose by {oom.get('node_kills', 0)}"
    if oom.get("group_kills"):
        counts += f", its memory group's by {oom.get('group_kills')}"
        if oom.get("group_limit"):
            counts += f", a group limited to {size(oom.get('group_limit', 0))}"
    message = (f"{how}{f' ({raised})' if raised else ''}, and the kernel's out-of-memory "
               f"killer ran on {host} while it did ({counts}); the kernel's log is not "
               "readable here to name its victim")
    return Named(message, f"{_fix(host, oom)}. {LOG_HOW.format(host=host)}", "oom",
                 {"oom": dict(oom)})


def _victims_said(host: str, code: int | None, victims: list[wire.OomVictim],
                  oom: wire.OomFacts, raised: str, how: str) -> str:
    first = victims[0]
    main = [v for v in victims if v.get("main")]
    whose = "" if main else ("its DataLoader worker, " if _worker_died(raised) else
                             "a process of its tree, ")
    said = f"{whose}pid {first.get('pid')}, {first.get('comm') or '?'}"
    if first.get("tied") == "group":  # (no look saw it: how sure, said)
        said = (f"probably {said}: it lived between two of the guard's looks, tied to the rank "
                "by its user and memory group in the kernel's record")
    if first.get("rss"):
        said += f", {size(first.get('rss', 0))} resident"
    more = f" and {len(victims) - 1} more of its processes" if len(victims) > 1 else ""
    room = _room(host, oom, first)
    message = f"killed by the kernel's out-of-memory killer ({said}{more}; {room})"
    if not main:
        message += f"; the rank then {how}{f' ({raised})' if raised else ''}"
    return message


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


def _fix(host: str, oom: wire.OomFacts) -> str:
    victims = oom.get("victims") or []
    if any(v.get("constraint") == "CONSTRAINT_MEMCG" for v in victims) or \
            (not victims and oom.get("group_kills") and oom.get("group_limit")):
        return ("the job needs more memory than its memory group allows: raise the limit (a "
                "scheduler's --mem, the container's memory) or use less: fewer ranks or "
                "DataLoader workers per node, a smaller batch or model")
    return (f"use less memory on {host}: fewer ranks or DataLoader workers per node, a smaller "
            "batch or model, or a node with more memory; check what else runs there "
            "(`ptcluster monitor`)")


def disk_named(host: str, errno: int | None, disk: wire.DiskFacts | None,
               raised: str) -> Named | None:
    """A rank whose code raised ENOSPC or EDQUOT: its filesystem, with free and total space as
    its guard saw them; None for any other error."""
    if errno not in FULL_ERRNOS:
        return None
    what = "quota" if errno == 122 else "filesystem"
    if disk and disk.get("mount"):
        where = (f"{disk.get('mount')} ({disk.get('fstype') or '?'}) on {host} now has "
                 f"{size(disk.get('free', 0))} free of {size(disk.get('total', 0))}")
        message = f"{raised}; the {what} is full: {where}"
        fix = (f"free space on {host}'s {disk.get('mount')}, or write the files (the "
               "checkpoint directory) to a larger filesystem; a checkpoint written to a "
               "temporary file and renamed (as the reference trainer does) leaves the one "
               "saved before intact: resume from it (`--resume`)")
    else:
        full = (disk or {}).get("full") or []
        named = ", ".join(f"{f.get('mount')} ({f.get('fstype') or '?'}) {size(f.get('free', 0))}"
                          f" free of {size(f.get('total', 0))}" for f in full)
        message = f"{raised}; the {what} is full" + (
            f" (nearly full on {host}: {named})" if named else
            " (the error named no file, and no filesystem of the node is nearly full now)")
        fix = f"free space on {host} (`df -h` there), or write to a larger filesystem"
    return Named(message, fix, "disk", {"disk": dict(disk or {})})


def xid_said(host: str, xid: wire.XidFacts) -> str:
    """One Xid as a line: the GPU, the node, whose process, what it means, what to do."""
    gpu = xid.get("gpu")
    where = f"GPU {gpu} on {host}" if gpu is not None else \
        f"the GPU at PCI {xid.get('pci') or '?'} on {host}"
    at = xid.get("clock") or ""
    whose = ""
    if xid.get("rank") is not None:
        whose = f", in rank {xid.get('rank')}'s process {xid.get('pid')}"
    elif xid.get("pid"):
        whose = f", in process {xid.get('pid')} ({xid.get('name') or '?'}: not one of the job's)"
    return (f"{where} reported Xid {xid.get('xid')}{f' at {at}' if at else ''}"
            f"{whose}: {xid.get('meaning') or '?'}; what to do: {xid.get('fix') or '?'}")


def xid_named(host: str, how: str, xids: Sequence[wire.XidFacts]) -> Named | None:
    """A rank that failed after the GPU driver wrote an Xid for one of its processes or one of
    the job's GPUs on its node: the Xid is the cause (the rank's own CUDA or NCCL error is
    what it saw of it)."""
    if not xids:
        return None
    first = next((x for x in xids if x.get("fatal")), xids[0])
    more = f" (and {len(xids) - 1} more Xid(s))" if len(xids) > 1 else ""
    message = f"{how}, after {xid_said(host, first).split('; what to do: ')[0]}{more}"
    return Named(message, first.get("fix") or "see NVIDIA's Xid catalog", "gpu",
                 {"xids": [dict(x) for x in xids]})
