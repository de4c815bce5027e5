"""Ending the job: wait for torchrun (or a stop), then SIGTERM it and SIGKILL what is left, by
process tree, never by name.

Standard library only; a part of the guard (shipped by ``remote.bootstrap``). The guard is a
child subreaper, so workers that torchrun leaves behind are re-parented to it and found by
walking /proc from its own pid (``guard.proctree``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

from ptcluster.node.guard.link import StopRequest
from ptcluster.node.guard.proctree import descendants, reap_others, signal_tree


def wait_child(child: subprocess.Popen[bytes], stop: StopRequest) -> int | None:
    """Until torchrun ends or a stop is asked; its exit status, or None if stopped."""
    while True:
        code = child.poll()
        reap_others(child.pid)
        if code is not None:
            return code
        if stop.wait(0.1):
            return None


def teardown(child: subprocess.Popen[bytes] | None, grace: float) -> int | None:
    """SIGTERM torchrun (it forwards to its workers), then SIGKILL what is left."""
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
    for _ in range(50):
        if not descendants(os.getpid()):
            break
        signal_tree(os.getpid(), signal.SIGKILL)
        reap_others(child.pid)
        time.sleep(0.05)
    return child.poll()
