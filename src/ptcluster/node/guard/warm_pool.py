"""The guard's way to a warm pool (``run --warm``): its key, and the pool itself, started where
none of that key runs (ARCHITECTURE.md, "The warm path").

Standard library only; a part of the guard (shipped by ``remote.bootstrap``).
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import threading
import time

from ptcluster.node.guard.link import StopRequest
from ptcluster.node.guard.proctree import set_subreaper
from ptcluster.node.guard.tmpdirs import user_tmp
from ptcluster.node.sharing.safefile import private_dir
from ptcluster.node.warm.protocol import (
    HELD,
    HOLD,
    HOLD_FD_VAR,
    LOCK_FD_VAR,
    POOL_BOOT,
    POOL_FILE,
    READY,
    WARM_DIR,
    hold_key,
    namespaces,
    paths,
    pool_env,
    pool_key,
    receive,
    send,
)
from ptcluster.node.wire import GuardConfig

START_WITHIN = 300.0
"""Seconds a new pool has to import torch and its ``warm_imports`` and say it is ready."""
BEFORE_READY = 40.0
"""Seconds a guard waits for a new pool of ``run --warm`` before it says ``ready`` (below the
head's ready timeout, 60 s by default): one still importing then is left to start, for the
next run; this run's ranks start cold."""


class WarmError(Exception):
    """No pool for this guard's ranks: why (the guard starts them cold and says so)."""


def pool_files(cfg: GuardConfig, env: dict[str, str], python: str) -> dict[str, str]:
    """The files (``warm.protocol.paths``) of the pool for the ranks' key on this node: this
    user's, or the job's own on this node (``warm["job"]``: its id and host in the key)."""
    warm = cfg.get("warm") or {}
    environment = cfg.get("environment") or {}
    job_names = [k for k in (cfg.get("env") or {}) if not k.startswith("PTCLUSTER_")]
    job = ",job:" + job_mark(cfg) if warm.get("job") else ""
    name, _ = pool_key(python, str(environment.get("digest") or ""),
                       str(environment.get("torch") or ""), list(warm.get("imports") or []),
                       env, job_names, namespaces() + job)
    try:
        folder = private_dir(os.path.join(user_tmp(), WARM_DIR))
    except OSError as exc:
        raise WarmError(f"its folder: {exc.strerror or exc}") from None
    return paths(folder, name)


def job_mark(cfg: GuardConfig) -> str:
    """The job and node a job's pool is for (``JOB@HOST``: in its key and its record)."""
    return f"{cfg['job_id']}@{(cfg.get('warm') or {}).get('job')}"


def pool_socket(cfg: GuardConfig, env: dict[str, str], python: str, tmpdir: str,
                stop: StopRequest) -> tuple[str, socket.socket | None]:
    """The socket of this user's pool for the ranks' key on this node: a live one, or one
    started now (under the key's lock: two guards start one pool); and the connection on which
    this guard holds it (``warm.protocol.HOLD``: no idle end until it is closed; None: a pool
    that does not know ``hold``, an older ptcluster's)."""
    warm = cfg.get("warm") or {}
    files = pool_files(cfg, env, python)
    try:
        lock = hold_key(files["lock"], BEFORE_READY)
    except BlockingIOError:
        raise WarmError("a pool of this key is starting (another run's), still importing: the "
                        "next run's ranks come from it") from None
    try:
        live, held = hold(files["sock"])
        if live:
            return files["sock"], held
        for stale in (files["sock"], files["record"]):
            if os.path.lexists(stale):
                os.unlink(stale)
        mine, its = socket.socketpair()
        try:
            start_pool(python, files["sock"], float(warm["idle"]),
                       list(warm.get("imports") or []), pool_env(env),
                       os.path.join(tmpdir, POOL_FILE), stop, BEFORE_READY, lock, its.fileno())
        except BaseException:
            mine.close()
            raise
        finally:
            its.close()
        return files["sock"], mine
    finally:
        os.close(lock)


def hold(path: str) -> tuple[bool, socket.socket | None]:
    """(whether a pool listens at ``path``, the connection on which this guard holds it now:
    ``warm.protocol.HOLD``, None where it does not answer ``held``)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return False, None
    try:
        send(sock, {"kind": HOLD})
        reply, fds = receive(sock)
    except OSError:
        reply, fds = None, []
    for fd in fds:
        os.close(fd)
    if reply is None or reply.get("kind") != HELD:
        sock.close()
        return True, None  # (an older pool: used as before, unheld)
    return True, sock


def start_pool(python: str, sock: str, idle: float, imports: list[str], env: dict[str, str],
               program: str, stop: StopRequest, within: float = START_WITHIN,
               lock: int = -1, held: int = -1) -> None:
    """A pool out of this guard's tree: its first process exits at once, while the guard is no
    subreaper (no rank of it runs yet), so init adopts the pool; then its ``ready`` line, for
    ``within`` s (a pool still importing then goes on: WarmError, this guard's ranks cold);
    ``lock``, the key's, is the pool's to hold until it listens; ``held``, its end of the
    socket pair on which the guard holds it (``protocol.HOLD_FD_VAR``)."""
    set_subreaper(False)
    try:
        proc = pool_process(python, sock, idle, 0, imports, env, program, lock, held)
        proc.wait()
    finally:
        set_subreaper(True)
    ready(proc, stop, within)


def pool_process(python: str, sock: str, idle: float, owner: int, imports: list[str],
                 env: dict[str, str], program: str, lock: int = -1,
                 held: int = -1) -> subprocess.Popen[bytes]:
    """The pool program started (``warm.pool``; ``owner``: 0, or the guard's pid for a job's
    pool, which stays its child), in a session of its own; with the key's ``lock`` (a
    descriptor it holds until it listens: ``protocol.LOCK_FD_VAR``) and the socket its guard
    holds it on (``held``: ``protocol.HOLD_FD_VAR``)."""
    given = {name: fd for name, fd in ((LOCK_FD_VAR, lock), (HOLD_FD_VAR, held)) if fd >= 0}
    return subprocess.Popen(
        [python, "-u", "-c", POOL_BOOT, program, sock, str(idle), str(owner), *imports],
        env={**env, **{name: str(fd) for name, fd in given.items()}}, cwd="/",
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True, pass_fds=tuple(given.values()))


def ready(proc: subprocess.Popen[bytes], stop: StopRequest | threading.Event,
          within: float = START_WITHIN) -> None:
    """Its ``ready`` line read within ``within`` s; else WarmError (what it said)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + within
    said = read_ready(proc.stdout.fileno(), stop, deadline)
    proc.stdout.close()
    if said.startswith(READY + " "):
        return
    if time.monotonic() >= deadline and within < START_WITHIN:
        raise WarmError(f"a pool is starting, still importing after {within:.0f} s: the next "
                        "run's ranks come from it")
    raise WarmError(said or "the pool ended before it was ready")


def read_ready(fd: int, stop: StopRequest | threading.Event, deadline: float) -> str:
    """The pool's ``ready``/``error`` line (what it printed before, as context for an error),
    read until ``deadline`` (monotonic)."""
    data = b""
    while time.monotonic() < deadline and not stop.is_set():
        if not select.select([fd], [], [], 0.2)[0]:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
        for line in data.decode(errors="replace").splitlines():
            if line.startswith((READY + " ", "error ")) and data.endswith(b"\n"):
                return line if line.startswith(READY) else \
                    "the pool could not start: " + line[6:]
    tail = data.decode(errors="replace").strip().splitlines()[-3:]
    return " | ".join(tail)[-500:] if tail else ""
