"""The guard<->pool boundary: a pool's key, its files, and the messages on its socket.

Standard library only; shipped with both ends (the guard, the pool program it hands on) and with
``pools`` (``ps``, ``warm stop``). ARCHITECTURE.md ("The warm path") says how it fits.

A pool lives in ``warm/`` of the guard's private per-user directory (``guard.tmpdirs``), named
by its key: ``pool-KEY.sock`` (its socket), ``pool-KEY.json`` (its record: pid, key facts,
started, idle since), ``pool-KEY.lock`` (held by a guard while it starts one; removed, under
it, with the pool's other files when the pool ends: ``hold_key``, ``drop_key``), ``pool-KEY.log``
(what the pool itself wrote after it was ready). A message is 4 bytes of length (big endian),
then that much JSON; descriptors travel with a message's first bytes (``SCM_RIGHTS``).
"""

from __future__ import annotations

import array
import errno
import fcntl
import hashlib
import json
import os
import socket
import struct
import time
from collections.abc import Sequence
from typing import TypedDict

WARM_DIR = "warm"
"""The pools' folder in the user's private temp directory of the guards."""
KEY_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "LD_", "MALLOC_", "PYTHON", "LC_", "TORCH_")
KEY_NAMES = ("LANG", "LANGUAGE")
"""What C libraries and Python read while torch loads: part of a pool's key, as the rank has them
(with the job's ``env:``), and in the pool's environment."""
JOB_PREFIXES = ("PTCLUSTER_", "MASTER_", "TORCHELASTIC_", "PET_", "SSH_")
"""Variables of one job or one connection, never part of a pool's environment or key."""
POOL_BOOT = ("import sys,os;sys.path[:]=[p for p in sys.path if p not in('','.')];"
             "p=sys.argv.pop(1);f=open(p);s=f.read();f.close();"
             "exec(compile(s,'ptcluster-pool','exec'))")
"""``python -u -c POOL_BOOT FILE SOCKET IDLE [MODULE...]``: the pool program from the file the
guard wrote (its path taken off ``sys.argv`` first), as ``rank_wire.SHIM_BOOT`` runs the shim."""
POOL_FILE = "pool.py"
"""The pool program's name among the guard's handed files (named after its module)."""
READY = "ready"
FORK, PID, STATUS, REFUSED = "fork", "pid", "status", "refused"
"""Message kinds (``kind`` of the JSON): the guard's ``fork``; the pool's ``pid`` (with the
rank's pidfd), its ``status`` (the wait status as ``Popen.returncode`` gives it) and ``refused``
(``why``)."""
OWN, OWNED, KEEP, KEPT = "own", "owned", "keep", "kept"
"""A job's pool (``--max-restarts``): the guard that holds it sends ``own`` on a connection it
keeps for its life (``owned``, or ``refused`` where another guard holds it); that connection's
end ends the pool, unless its guard sent ``keep`` first (answered ``kept``): then the pool waits
its idle seconds for the next attempt's guard."""
HOLD, HELD = "hold", "held"
"""A user's pool (``run --warm``): a guard that will fork its ranks from it holds it from its
``ready`` to its ``go`` on a connection it opened with ``hold`` (answered ``held``), or on the
socket it gave a pool it started (``HOLD_FD_VAR``); while any is held the pool never ends by
its idle timeout, and the end of each such connection (the ranks forked, or the guard gone)
starts its idle clock again. Unlike ``own``, its end never ends the pool."""


class Message(TypedDict, total=False):
    """A message on a pool's socket: ``kind`` and the keys of that kind (one type for every
    kind: a connection's first message may be either of the guard's, ``fork`` or ``own``)."""

    kind: str
    # fork (guard -> pool: ``guard.warm_ranks.WarmRanks.start`` writes it, ``warm.become`` reads
    # it in the forked rank): the rank to become, as a cold rank would start
    cwd: str
    umask: int
    rlimits: dict[str, list[int]]
    """``{RLIMIT_NAME: [soft, hard]}``, the guard's."""
    ignored: list[int]
    """The signals a cold rank starts with ignored."""
    cgroups: list[list[str]]
    """``[line of /proc/self/cgroup, its group's cgroup.procs]``: the pool moves the rank there."""
    env: dict[str, str]
    argv: list[str]
    """``sys.argv`` of the rank (``-c CHILD_FLAG TARGET...``)."""
    # pid (pool -> guard, with the rank's pidfd)
    pid: int
    # status (pool -> guard): the rank's wait status as ``Popen.returncode`` gives it
    code: int
    # refused (pool -> guard)
    why: str
    # own (guard -> pool): ``JOB@HOST``, the job whose pool it is
    job: str


class PoolRecord(TypedDict, total=False):
    """A pool's record (``pool-KEY.json``: ``warm.pool.Pool.write_record`` writes it,
    ``warm.pools.listed`` reads it)."""

    pid: int
    idle_since: float | None
    """None: ranks of it run now."""
    ranks: int
    idle: float
    """Seconds it stays idle before it ends."""
    python: str
    torch: str
    started: float
    imports: list[str]
    place: str
    """Its namespaces (:func:`namespaces`)."""
    job: bool | str
    """A job's pool: ``JOB@HOST`` once a guard owns it (True before)."""


JOB_POOL_NICE = 10
"""The nice value of a job's pool while it imports (the first attempt's ranks run meanwhile)."""
MAX_MESSAGE = 4 << 20
"""A message's largest size (a rank's environment and argv)."""


def key_env(env: dict[str, str], job_names: list[str]) -> dict[str, str]:
    """The part of a rank's environment that is in the pool's key: the variables read while
    torch loads, and those of the job's ``env:`` (``job_names``)."""
    return {k: v for k, v in env.items()
            if (k.startswith(KEY_PREFIXES) or k in KEY_NAMES or k in job_names)
            and not k.startswith(JOB_PREFIXES)}


def pool_env(env: dict[str, str]) -> dict[str, str]:
    """The pool's own environment: the rank's, less what belongs to one job or connection."""
    return {k: v for k, v in env.items() if not k.startswith(JOB_PREFIXES)
            and k not in ("NCCL_DEBUG_FILE", "CUDA_VISIBLE_DEVICES")}


def pool_key(python: str, digest: str, torch: str, imports: list[str],
             env: dict[str, str], job_names: list[str],
             place: str = "") -> tuple[str, dict[str, object]]:
    """(the pool's name, the facts it is keyed by): any difference, another pool. ``place``:
    the namespaces the ranks run in (:func:`namespaces`)."""
    facts: dict[str, object] = {"python": python, "digest": digest, "torch": torch,
                                "imports": list(imports), "env": key_env(env, job_names),
                                "place": place}
    text = json.dumps(facts, sort_keys=True).encode()
    return hashlib.sha256(text).hexdigest()[:20], facts


def namespaces() -> str:
    """This process's network, mount, pid and UTS namespaces: a pool forks ranks only into its
    own (containers, or the testbed's nodes, may share a /tmp and so a pools' folder)."""
    found = []
    for kind in ("net", "mnt", "pid", "uts"):
        try:
            found.append(f"{kind}:{os.stat(f'/proc/self/ns/{kind}').st_ino}")
        except OSError:
            found.append(f"{kind}:?")
    return ",".join(found)


def paths(folder: str, name: str) -> dict[str, str]:
    """The files of pool ``name`` in ``folder``: sock, record, lock, log."""
    base = os.path.join(folder, "pool-" + name)
    return {"sock": base + ".sock", "record": base + ".json", "lock": base + ".lock",
            "log": base + ".log"}


LOCK_TRIES = 100
"""Locks :func:`hold_key` takes on a file removed before it held it, before it gives up."""
LOCK_FD_VAR = "PTCLUSTER_POOL_LOCK_FD"
"""In a new pool's environment: the descriptor of its key's lock, inherited from the guard
that started it and held until the pool listens (no second pool of the key starts while the
first imports, even once its guard stopped waiting for it)."""


HOLD_FD_VAR = "PTCLUSTER_POOL_HOLD_FD"
"""In a new user's pool's environment: the descriptor of one end of a socket pair whose other
end its guard keeps (the pool is held from its start: ``HOLD``; taken out of the environment
once it listens)."""


def hold_key(lock: str, within: float) -> int:
    """The key's lock file held (``flock``), its descriptor: for a guard that starts a pool of
    the key; OSError(EWOULDBLOCK) when not had within ``within`` s (a pool of the key that
    another guard started is still importing: it holds the lock until it listens). A pool's
    end removes the file under the lock (:func:`drop_key`), so a lock taken on a file no
    longer at ``lock`` holds nothing: dropped, and taken again on the new one."""
    deadline = time.monotonic() + within
    for _ in range(LOCK_TRIES):
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(0.05)
            if _same_file(fd, lock):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise OSError(errno.EAGAIN, f"{lock}: removed under each of {LOCK_TRIES} locks taken")


def let_key_go() -> None:
    """In a new pool, once it listens: the key's lock it inherited, closed (``LOCK_FD_VAR``:
    taken out of its environment too, never a rank's)."""
    fd = os.environ.pop(LOCK_FD_VAR, "")
    if fd.isdigit():
        try:
            os.close(int(fd))
        except OSError:
            pass


def drop_key(lock: str, files: Sequence[str]) -> None:
    """A pool's ``files`` that it leaves (its socket, its record) and the key's lock file,
    removed under that lock; all left where a guard holds it: the guard starts a new pool of
    this key, whose files those paths are then (it removes what is stale itself)."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if _same_file(fd, lock):
            for path in (*files, lock):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
    except OSError:
        pass  # (held: a guard starts a pool of this key)
    finally:
        os.close(fd)


def _same_file(fd: int, path: str) -> bool:
    try:
        there = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)


def send(sock: socket.socket, message: Message, fds: list[int] | None = None) -> None:
    """One message, with ``fds`` (SCM_RIGHTS) on its first bytes."""
    data = json.dumps(message).encode()
    data = struct.pack(">I", len(data)) + data
    if fds:
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                      array.array("i", fds))])
        data = data[sent:]
    if data:
        sock.sendall(data)


def receive(sock: socket.socket) -> tuple[Message | None, list[int]]:
    """One message and the descriptors that came with it; (None, fds) at EOF or on a message
    that is not one (its descriptors are still the caller's to close). Reads no byte past the
    message (the pool's ``pid`` and ``status`` may come back to back)."""
    fds: list[int] = []
    head = _exactly(sock, 4, fds)
    size = struct.unpack(">I", head)[0] if len(head) == 4 else MAX_MESSAGE + 1
    body = _exactly(sock, size, fds) if size <= MAX_MESSAGE else b""
    if len(body) != size:
        return None, fds
    try:
        message: Message = json.loads(body)  # (this user's guard's, or its pool's: as declared)
    except ValueError:
        return None, fds
    return (message if isinstance(message, dict) else None), fds


def _exactly(sock: socket.socket, size: int, fds: list[int]) -> bytes:
    data = b""
    while len(data) < size:
        chunk, anc, _, _ = sock.recvmsg(min(size - len(data), 1 << 20),
                                        socket.CMSG_SPACE(16 * 4))
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(raw[:len(raw) - len(raw) % got.itemsize])
                fds += list(got)
        if not chunk:
            break
        data += chunk
    return data


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a unix socket (``SO_PEERCRED``)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])
