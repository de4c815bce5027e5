"""A full disk. When a rank's code raised ENOSPC or EDQUOT (the shim reports the errno and the
file), the guard stats that file's filesystem: its mount point, type, free and total space
(``wire.DiskFacts``, in the rank's ``rerror`` frame). With no file named, the nearly full
filesystems of the node.

Standard library only; a part of the guard (shipped by ``remote.bootstrap``).
"""

from __future__ import annotations

import errno
import os
import re

from ptcluster.node.wire import DiskFacts

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
"""What a full filesystem raises: no space left, the user's quota exceeded."""
PSEUDO_FS = frozenset({
    "proc", "sysfs", "cgroup", "cgroup2", "devpts", "mqueue", "debugfs", "tracefs", "securityfs",
    "pstore", "bpf", "configfs", "fusectl", "hugetlbfs", "autofs", "binfmt_misc", "nsfs",
    "squashfs", "iso9660", "ramfs", "devtmpfs", "efivarfs", "rpc_pipefs",
})
"""Filesystems that are never a job's full disk (always "full", or no blocks at all)."""
NEARLY_FULL = 0.02
"""A filesystem with less than this share free is named when a rank's ENOSPC named no file."""


def disk_facts(filename: str) -> DiskFacts | None:
    """The filesystem of ``filename`` (or of its nearest existing folder): ``{path, mount,
    fstype, source, free, total}``; with no file: ``{full: [...]}``, the nearly full ones."""
    if not filename:
        full = [f for f in (fs_facts(m) for m in mounts()) if f is not None and f["total"]
                and f["free"] < NEARLY_FULL * f["total"]]
        return {"full": full[:4]} if full else None
    path = os.path.abspath(filename)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    real = os.path.realpath(path)
    best = max((m for m in mounts() if real == m[0] or real.startswith(m[0].rstrip("/") + "/")),
               key=lambda m: len(m[0]), default=None)
    facts = fs_facts(best or (real, "", ""), at=path)
    if facts is not None:
        facts["path"] = filename
    return facts


def fs_facts(mount: tuple[str, str, str], at: str = "") -> DiskFacts | None:
    point, fstype, source = mount
    if fstype in PSEUDO_FS:
        return None
    try:
        st = os.statvfs(at or point)
    except OSError:
        return None
    return {"mount": point, "fstype": fstype, "source": source,
            "free": st.f_bavail * st.f_frsize, "total": st.f_blocks * st.f_frsize}


def mounts() -> list[tuple[str, str, str]]:
    """(mount point, type, source) of every mount this process sees (``mountinfo``)."""
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rest = left.split(), right.split()
                if len(fields) > 4 and len(rest) > 1:
                    point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)),
                                   fields[4])
                    out.append((point, rest[0], rest[1]))
    except OSError:
        pass
    return out
