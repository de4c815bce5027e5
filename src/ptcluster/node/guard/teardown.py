"""Ending the job: wait for torchrun (or a stop), then SIGTERM it and SIGKILL what is left, by
process tree, never by name.

Standard library only; a part of the guard (shipped by ``remote.bootstrap``). The guard is a
child subreaper, so workers that torchrun leaves behind are re-parented to it and found by
walking /proc from its own pid (``guard.proctree``).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from typing import Protocol

from ptcluster.node.guard.link import StopRequest
from ptcluster.node.guard.proctree import descendants, reap_others, signal_tree

LOOK_EVERY = 0.1
"""Seconds between two looks at a stop request (and at orphans to reap) while torchrun runs."""


class Child(Protocol):
    """What the guard starts its ranks through: torchrun's ``Popen``, or the ranks of a warm
    pool (``guard.warm_ranks.WarmRanks``: ``kill_all`` too, and a ``wake_fd``)."""

    pid: int

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...


def wait_child(child: Child, stop: StopRequest) -> int | None:
    """Until torchrun ends or a stop is asked; its exit status, or None if stopped. Where the
    kernel gives a pidfd (Linux 5.3, Python 3.9), torchrun's end wakes the guard at once, as a
    stop does: a look every ``LOOK_EVERY`` s alone added 50 ms on average to every job's end."""
    pidfd = _pidfd(child.pid) if isinstance(child, subprocess.Popen) else \
        getattr(child, "wake_fd", None)
    try:
        while True:
            code = child.poll()
            reap_others(child.pid)
            if code is not None:
                return code
            if pidfd is None:
                if stop.wait(LOOK_EVERY):
                    return None
                continue
            if stop.is_set():
                return None
            select.select([pidfd, stop.wake_fd], [], [], LOOK_EVERY)
    finally:
        if pidfd is not None and isinstance(child, subprocess.Popen):
            os.close(pidfd)


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` ends, or None where there is none."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        return None
    try:
        return int(pidfd_open(pid))
    except OSError:  # (an older kernel: ENOSYS; the child already reaped: ESRCH)
        return None


def teardown(child: Child | None, grace: float, spare: int = 0) -> int | None:
    """SIGTERM torchrun (it forwards to its workers), then SIGKILL what is left: the guard's
    tree, and a warm pool's ranks of this guard (not its descendants: their ``kill_all``);
    but ``spare``, the job's warm pool (the guard's child that forked none of its ranks:
    ``guard.job_pool``), which the guard ends or hands on itself."""
    if child is None:
        return None
    if child.poll() is None:
        try:
            child.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace
        while child.poll() is None and time.monotonic() < deadline:
            reap_others(child.pid)
            time.sleep(0.05)
    kill_all = getattr(child, "kill_all", None)
    for _ in range(50):
        pooled = bool(kill_all()) if kill_all is not None else False
        if not descendants(os.getpid(), spare) and not pooled:
            break
        signal_tree(os.getpid(), signal.SIGKILL, spare)
        reap_others(child.pid)
        time.sleep(0.05)
    return child.poll()
