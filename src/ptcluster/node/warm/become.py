"""In a rank forked from a pool, before the shim runs the user's program: become what a cold rank
would be (ARCHITECTURE.md, "The warm path").

Standard library only; part of the pool program (``warm.pool``), run in its forked child. A cold
rank is ``python -u -c SHIM_BOOT --ptcluster-child TARGET`` started by the shim in its own process
group, with the guard's rlimits, umask, fds 0-2 and ignored signals (everything else at its
default: exec resets a handler) and the rank's environment and working directory; then Python's
own start: SIGINT to ``KeyboardInterrupt``, SIGPIPE and SIGXFSZ ignored, fresh random seeds.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import random
import resource
import signal
import sys

from ptcluster.node.warm.protocol import Message

PR_SET_PDEATHSIG = 1
PYTHON_IGNORES = (signal.SIGPIPE, signal.SIGXFSZ)
"""What a Python interpreter ignores from its start (and ``subprocess`` gives back at exec)."""


def die_with(parent: int) -> None:
    """SIGKILL when ``parent`` (the pool) ends; gone already: end now (an orphan never runs)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(137)


def take_fds(fds: list[int], go: int) -> None:
    """The rank's stdin, stdout and stderr on 0-2; wait for the pool's go (it moved us into the
    guard's control groups); every other descriptor closed."""
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    if os.read(go, 1) != b"g":  # the pool refused this rank, or is gone
        os._exit(137)
    os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def set_limits(limits: dict[str, list[int]]) -> None:
    """The guard's rlimits, each as a cold rank inherits it."""
    for name, (soft, hard) in limits.items():
        which = getattr(resource, name, None)
        if isinstance(which, int) and resource.getrlimit(which) != (soft, hard):
            resource.setrlimit(which, (soft, hard))


def set_signals(ignored: list[int]) -> None:
    """Every signal at its default but those a cold rank inherits ignored, then Python's own."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.SIG_IGN if int(sig) in ignored else signal.SIG_DFL)
        except (OSError, ValueError):  # (glibc's own real-time signals)
            pass
    if int(signal.SIGINT) not in ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in PYTHON_IGNORES:
        signal.signal(sig, signal.SIG_IGN)


def reseed() -> None:
    """Fresh seeds where a cold start draws them: ``random``, numpy's global generator if the
    pool imported numpy (torch's CPU generator starts from its fixed default either way)."""
    random.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        try:
            numpy_random.seed()
        except Exception:  # noqa: BLE001, S110 - a numpy without it: nothing to reseed
            pass


def become(request: Message, fds: list[int], go: int, parent: int,
           path: list[str], main_keys: set[str]) -> None:
    """All of it, in the order that keeps the rank from running as anything else."""
    die_with(parent)
    os.setsid()  # its own session and group (a cold rank: its own group)
    take_fds(fds, go)
    set_limits(request.get("rlimits") or {})
    os.umask(int(request.get("umask", 0o022)))
    os.chdir(str(request["cwd"]))
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in (request.get("env") or {}).items()})
    set_signals([int(s) for s in request.get("ignored") or []])
    sys.path[:] = path
    sys.path_importer_cache.clear()
    importlib.invalidate_caches()
    reseed()
    sys.argv = [str(a) for a in request["argv"]]
    main = sys.modules["__main__"].__dict__
    for key in [k for k in main if k not in main_keys]:
        del main[key]
