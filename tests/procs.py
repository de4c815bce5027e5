"""Find processes of a job by the PTCLUSTER_JOB_ID every one of them carries in its env."""

from __future__ import annotations

import os
import time


def job_processes(job_id: str, wait: float = 0.0) -> list[tuple[int, str]]:
    """(pid, cmdline) of live processes whose environment holds PTCLUSTER_JOB_ID=job_id.

    With ``wait``, polls until none are left or the time is up (processes in teardown).
    """
    needle = f"PTCLUSTER_JOB_ID={job_id}".encode()
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
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
            except OSError:
                continue
            if needle in env and state != b"Z":
                found.append((int(entry), cmd))
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)
