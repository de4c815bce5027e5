"""Find processes of a job: torchrun and the ranks carry PTCLUSTER_JOB_ID in their env; the
node's guard (and the head's ssh client to it) carry the job id in their command line; the
job's own warm pool (``node.guard.job_pool``) and the ranks it forked (their /proc environment
is the pool's) by the pool's record, which names the job (``JOB@HOST``) once a guard holds it,
and as descendants of the others."""

from __future__ import annotations

import json
import os
import time

POOL_MARK = b"ptcluster-pool"
"""In every warm pool's command line, and so its forked ranks' (``warm.protocol.POOL_BOOT``)."""


def job_processes(job_id: str, wait: float = 0.0) -> list[tuple[int, str]]:
    """(pid, cmdline) of live processes whose environment holds PTCLUSTER_JOB_ID=job_id, or
    whose command line ends with the job id (the guard's tag: ``... BOOTSTRAP guard JOB``),
    and of their descendants (a job's pool and the ranks it forked).

    With ``wait``, polls until none are left or the time is up (processes in teardown).
    """
    needle = f"PTCLUSTER_JOB_ID={job_id}".encode()
    tags = (b"\0" + job_id.encode(), b" " + job_id.encode())  # a guard's last word (or ssh's)
    deadline = time.monotonic() + wait
    while True:
        found, parent, cmds = set(), {}, {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = f.read().split(b"\0")
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    raw = f.read()
            except OSError:
                continue
            if fields[0] == b"Z":
                continue
            pid = int(entry)
            parent[pid], cmds[pid] = int(fields[1]), raw
            if needle in env or raw.rstrip(b"\0").endswith(tags) or \
                    (POOL_MARK in raw and pool_job(raw).startswith(f"{job_id}@")):
                found.add(pid)
        for pid in parent:  # (descendants: up the tree to a found process)
            up, seen = parent[pid], 0
            while up > 1 and up not in found and seen < 64:
                up, seen = parent.get(up, 0), seen + 1
            if up in found:
                found.add(pid)
        if not found or time.monotonic() >= deadline:
            return sorted((pid, cmds[pid].replace(b"\0", b" ").decode(errors="replace")[:200])
                          for pid in found)
        time.sleep(0.1)


def pool_job(cmdline: bytes) -> str:
    """The job a warm pool (or a rank it forked: the same command line) is kept for, from the
    record beside its socket (``python -u -c BOOT PROGRAM SOCKET ...``); "" for none."""
    args = cmdline.split(b"\0")
    try:
        with open(args[5].decode()[:-len(".sock")] + ".json") as f:
            job = json.load(f).get("job")
    except (IndexError, OSError, ValueError, AttributeError):
        return ""
    return job if isinstance(job, str) else ""


def is_rank(pid: int) -> bool:
    """A rank: LOCAL_RANK in its environment (torchrun started it), or a process a warm pool
    forked (its command line the pool's, as is its parent's)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            if b"\0LOCAL_RANK=" in b"\0" + f.read():
                return True
        with open(f"/proc/{pid}/stat", "rb") as f:
            ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        with open(f"/proc/{pid}/cmdline", "rb") as f, open(f"/proc/{ppid}/cmdline", "rb") as g:
            return POOL_MARK in f.read() and POOL_MARK in g.read()
    except OSError:
        return False
