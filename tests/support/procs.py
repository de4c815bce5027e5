"""Find processes of a job: torchrun and the ranks carry PTCLUSTER_JOB_ID in their env; the
node's guard (and the head's ssh client to it) carry the job id in their command line."""

from __future__ import annotations

import os
import time


def job_processes(job_id: str, wait: float = 0.0) -> list[tuple[int, str]]:
    """(pid, cmdline) of live processes whose environment holds PTCLUSTER_JOB_ID=job_id, or
    whose command line ends with the job id (the guard's tag: ``... BOOTSTRAP guard JOB``).

    With ``wait``, polls until none are left or the time is up (processes in teardown).
    """
    needle = f"PTCLUSTER_JOB_ID={job_id}".encode()
    tags = (b"\0" + job_id.encode(), b" " + job_id.encode())  # a guard's last word (or ssh's)
    deadline = time.monotonic() + wait
    while True:
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = f.read().split(b"\0")
                with open(f"/proc/{entry}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    raw = f.read()
                cmd = raw.replace(b"\0", b" ").decode(errors="replace")[:200]
            except OSError:
                continue
            tagged = raw.rstrip(b"\0").endswith(tags)
            if (needle in env or tagged) and state != b"Z":
                found.append((int(entry), cmd))
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)
