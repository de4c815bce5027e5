"""A warm pool: one interpreter that has imported torch (and the cluster file's ``warm_imports``),
forking ranks for this user's guards on this node (``run --warm``; ARCHITECTURE.md, "The warm
path").

Run by a guard as ``python -u -c POOL_BOOT FILE SOCKET IDLE OWNER [MODULE...]``
(``warm.protocol``) with the rank environment less the job's variables. A user's pool (``OWNER``
0) forks once at its start (the guard waits for the first process, so the pool is not the
guard's descendant); a job's pool (``--max-restarts``: ``OWNER`` the guard's pid) stays the
guard's child, dies with it (``PR_SET_PDEATHSIG``) and imports at low priority in a thread of
its own (the main thread, whose priority its ranks inherit, keeps the guard's), then lives as
long as a guard of its job holds it (``warm.protocol.OWN``). It imports, listens on
``SOCKET`` and says ``ready {pid, torch}`` (or ``error TEXT``) on its stdout; then, single
threaded, on one selector: a ``fork`` request (only from its own uid: ``SO_PEERCRED``) forks a
rank (``warm.become``; moved into the guard's control groups before it may run), answered with
its pid and pidfd, later with its wait status; a guard's connection that closes under a running
rank kills the rank's session; ``SIGTERM`` (``warm stop``) takes the socket away at once and ends
the pool when its ranks have; ``IDLE`` seconds with no rank, no request and no guard that holds
it (``warm.protocol.HOLD``: from its ``ready`` to its ``go``) end it. It is a child
subreaper (a rank's orphans stay in its tree, in the rank's session) and never touches CUDA.

torch and the standard library only; handed on by the guard, loaded as a rank program is.
"""

from __future__ import annotations

import importlib
import json
import os
import selectors
import signal
import socket
import sys
import threading
import time
from typing import Any

from ptcluster.node.rank_wire import SHIM_BOOT
from ptcluster.node.warm.become import PR_SET_PDEATHSIG, become, die_with
from ptcluster.node.warm.protocol import (
    FORK,
    HELD,
    HOLD,
    HOLD_FD_VAR,
    JOB_POOL_NICE,
    KEEP,
    KEPT,
    OWN,
    OWNED,
    PID,
    READY,
    REFUSED,
    STATUS,
    Message,
    PoolRecord,
    drop_key,
    let_key_go,
    namespaces,
    peer_uid,
    receive,
    send,
)

PR_SET_CHILD_SUBREAPER = 36
LOOK_EVERY = 1.0


class Rank:
    """One forked rank: its pid, pidfd and the guard's connection for it."""

    def __init__(self, pid: int, pidfd: int, conn: socket.socket) -> None:
        self.pid, self.pidfd, self.conn = pid, pidfd, conn
        self.orphaned = False


class Pool:
    def __init__(self, path: str, idle: float) -> None:
        self.path, self.idle = path, idle
        self.record = path[:-len(".sock")] + ".json"
        self.sel = selectors.DefaultSelector()
        self.listener: socket.socket | None = None
        self.ranks: dict[int, Rank] = {}
        self.last = time.monotonic()
        self.stopping = False
        self.wake_r, self.wake_w = os.pipe()
        self.facts: PoolRecord = {}
        self.owner: socket.socket | None = None
        """A job's pool: the connection of the guard that holds it (``warm.protocol.OWN``)."""
        self.holders: set[socket.socket] = set()
        """A user's pool: the connections of the guards that will fork from it
        (``warm.protocol.HOLD``): no idle end while there is one."""

    def listen(self) -> None:
        old = os.umask(0o177)  # (the folder is 0700 already; the socket too)
        try:
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.listener.bind(self.path)
        finally:
            os.umask(old)
        self.listener.listen(64)
        self.sel.register(self.listener, selectors.EVENT_READ, "listen")
        os.set_blocking(self.wake_w, False)
        self.sel.register(self.wake_r, selectors.EVENT_READ, "wake")
        signal.signal(signal.SIGTERM, lambda *_: os.write(self.wake_w, b"t"))

    def write_record(self, first: bool = False) -> None:
        """The record ``ps``, ``warm stop`` and prune read; a later one that cannot be written
        leaves the last in place; the ``first`` raises (a pool no one can list or stop is not
        started: its guard's ranks start cold, saying why)."""
        idle = None if self.ranks or self.holders else \
            time.time() - (time.monotonic() - self.last)
        record: PoolRecord = {**self.facts, "pid": os.getpid(), "idle_since": idle,
                              "ranks": len(self.ranks), "idle": self.idle}
        tmp = f"{self.record}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            os.rename(tmp, self.record)
        except OSError as exc:
            try:
                os.unlink(tmp)  # (a full disk: the empty file stays otherwise)
            except OSError:
                pass
            if first:
                raise OSError(f"its record cannot be written in "
                              f"{os.path.dirname(self.record)}: {exc.strerror}") from None

    def unlisten(self) -> None:
        """No more requests: the socket and the record go (``ps`` no longer lists it)."""
        if self.listener is not None:
            self.sel.unregister(self.listener)
            self.listener.close()
            self.listener = None
            drop_key(self.path[:-len(".sock")] + ".lock", (self.path, self.record))

    def serve(self) -> tuple[Message, list[int], int, int] | None:
        """Until the pool ends (None), or in a forked rank: its request, fds, go pipe, parent."""
        while self.ranks or not self.stopping:
            if not self.ranks and self.owner is None and not self.holders and \
                    time.monotonic() - self.last >= self.idle:
                break
            for key, _ in self.sel.select(LOOK_EVERY):
                got = self.event(key.data, key.fileobj)
                if got is not None:
                    return got
            self.reap_orphans()
        self.unlisten()
        return None

    def event(self, what: Any, obj: Any) -> tuple[Message, list[int], int, int] | None:
        if what == "listen" and self.listener is not None:
            conn, _ = self.listener.accept()
            self.last = time.monotonic()
            return self.request(conn)
        if what == "wake":
            os.read(self.wake_r, 64)
            self.stopping = True
            self.unlisten()
        elif what == "owner":
            self.owner_said()
        elif what == "holder":
            self.released(obj)
        elif isinstance(what, Rank) and obj is what.conn:  # the guard's end closed: its rank ends
            self.sel.unregister(what.conn)
            what.orphaned = True
            kill_session(what.pid)
        elif isinstance(what, Rank):
            self.ended(what)
        return None

    def request(self, conn: socket.socket) -> tuple[Message, list[int], int, int] | None:
        if peer_uid(conn) != os.getuid():  # another user (root too): never a rank of theirs
            conn.close()
            return None
        conn.settimeout(10.0)
        try:
            message, fds = receive(conn)
        except OSError:
            conn.close()
            return None
        if message is not None and message.get("kind") == OWN and not fds:
            self.own(conn, str(message.get("job") or "")[:300])
            return None
        if message is not None and message.get("kind") == HOLD and not fds:
            try:
                send(conn, {"kind": HELD})
            except OSError:
                conn.close()
                return None
            self.hold(conn)
            return None
        if message is None or message.get("kind") != FORK or len(fds) != 3:
            close_all(fds)
            conn.close()
            return None
        return self.fork(conn, message, fds)

    def fork(self, conn: socket.socket, message: Message,
             fds: list[int]) -> tuple[Message, list[int], int, int] | None:
        go_r, go_w = os.pipe()
        parent = os.getpid()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            os.close(go_w)
            self.forget(conn)
            return message, fds, go_r, parent
        os.close(go_r)
        close_all(fds)
        pidfd = os.pidfd_open(pid)
        why = move(pid, message.get("cgroups") or [])
        try:
            if why:
                os.close(go_w)
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                os.close(pidfd)
                send(conn, {"kind": REFUSED, "why": why})
                conn.close()
                return None
            os.write(go_w, b"g")
            os.close(go_w)
            send(conn, {"kind": PID, "pid": pid}, [pidfd])
        except OSError:  # the guard went while we forked: its rank goes too
            kill_session(pid)
        conn.setblocking(True)
        rank = Rank(pid, pidfd, conn)
        self.ranks[pid] = rank
        self.sel.register(conn, selectors.EVENT_READ, rank)
        self.sel.register(_FdObj(pidfd), selectors.EVENT_READ, rank)
        self.write_record()
        return None

    def own(self, conn: socket.socket, job: str) -> None:
        """A guard of the job (``job``: its id and node) holds this pool now (one at a
        time)."""
        try:
            send(conn, {"kind": REFUSED, "why": "another guard holds it"} if self.owner
                 else {"kind": OWNED})
        except OSError:
            conn.close()
            return
        if self.owner is not None:
            conn.close()
            return
        conn.setblocking(True)
        self.owner = conn
        self.sel.register(conn, selectors.EVENT_READ, "owner")
        if job and self.facts.get("job") != job:
            self.facts["job"] = job
            self.write_record()

    def hold(self, conn: socket.socket) -> None:
        """A guard holds this pool until ``conn`` ends (``warm.protocol.HOLD``)."""
        conn.setblocking(True)
        self.holders.add(conn)
        self.sel.register(conn, selectors.EVENT_READ, "holder")
        self.write_record()

    def released(self, conn: socket.socket) -> None:
        """A holder's connection ended (its ranks forked, or its guard gone; whatever else
        it says ends it too): the idle clock starts again."""
        self.sel.unregister(conn)
        conn.close()
        self.holders.discard(conn)
        self.last = time.monotonic()
        self.write_record()

    def owner_said(self) -> None:
        """``keep`` (the pool waits its idle seconds for the next attempt's guard, no longer
        its parent's to die with), or the end of the owner's connection: the pool's end."""
        assert self.owner is not None
        try:
            message, fds = receive(self.owner)
        except OSError:
            message, fds = None, []
        close_all(fds)
        kept = message is not None and message.get("kind") == KEEP
        if kept:
            ctypes_prctl(PR_SET_PDEATHSIG, 0)
            try:
                send(self.owner, {"kind": KEPT})
            except OSError:
                kept = False
        self.sel.unregister(self.owner)
        self.owner.close()
        self.owner = None
        self.last = time.monotonic()
        if not kept:  # its guard ended the job (or died): so does the pool, with what it forked
            self.stopping = True
            self.unlisten()
            for rank in self.ranks.values():
                kill_session(rank.pid)

    def forget(self, conn: socket.socket) -> None:
        """In a forked rank: the pool's descriptors closed through their objects (none of them
        may close a number the rank's program reuses later)."""
        self.sel.close()
        for sock in [self.listener, conn, self.owner, *self.holders,
                     *(r.conn for r in self.ranks.values())]:
            if sock is not None:
                sock.close()
        for fd in [self.wake_r, self.wake_w, *(r.pidfd for r in self.ranks.values())]:
            os.close(fd)
        self.ranks.clear()
        self.holders.clear()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def ended(self, rank: Rank) -> None:
        _, status = os.waitpid(rank.pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        kill_session(rank.pid)  # what it left in its session (Python's exit left none of its)
        self.sel.unregister(_FdObj(rank.pidfd))
        os.close(rank.pidfd)
        if not rank.orphaned:
            self.sel.unregister(rank.conn)
            try:
                send(rank.conn, {"kind": STATUS, "code": code})
            except OSError:
                pass
        rank.conn.close()
        del self.ranks[rank.pid]
        self.last = time.monotonic()
        self.write_record()

    def reap_orphans(self) -> None:
        """Reap what ranks left (we are their subreaper), never a rank before its pidfd says."""
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None or info.si_pid in self.ranks:
                return
            os.waitpid(info.si_pid, 0)


class _FdObj:
    """A bare descriptor as the selector's key (a pidfd), equal by its number."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _FdObj) and other.fd == self.fd

    def __hash__(self) -> int:
        return self.fd


def move(pid: int, groups: list[list[str]]) -> str:
    """``pid`` into each of the guard's control groups (``[its /proc/PID/cgroup line, the
    group's cgroup.procs]``) it is not in already: "" or why not."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            now = set(f.read().splitlines())
    except OSError as exc:
        return f"cannot read the rank's control groups: {exc.strerror or exc}"
    for line, path in groups:
        if line in now:
            continue
        try:
            with open(path, "w") as f:
                f.write(str(pid))
        except OSError as exc:
            return f"cannot move the rank into {os.path.dirname(path)}: {exc.strerror or exc}"
    return ""


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (a rank's: it is its leader)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getsid(int(entry)) == sid:
                os.kill(int(entry), signal.SIGKILL)
        except OSError:
            pass


def close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def ctypes_prctl(option: int, value: int) -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def load(imports: list[str], nice: int) -> Any:
    """torch (returned) and ``imports``; with ``nice``, in a thread of that priority (a
    thread's own on Linux: the main thread, and so every rank forked later, keeps its own).
    A module that must be imported on the main thread (one that calls ``signal.signal``: the
    thread's import raises ValueError) is imported there after it, at its own priority; any
    other failure is raised as it was."""
    left: list[str] = []
    raised: list[BaseException] = []

    def run() -> None:
        if nice:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        for name in ("torch", *imports):
            try:
                importlib.import_module(name)
            except ValueError:  # ("signal only works in main thread"): the main thread's
                left.append(name)
            except BaseException as exc:  # noqa: BLE001 - raised again in the main thread
                raised.append(exc)
                return

    if not nice:
        left.extend(("torch", *imports))
    else:
        thread = threading.Thread(target=run, name="pool-imports")
        thread.start()
        thread.join()
    if raised:
        raise raised[0]
    for name in left:
        importlib.import_module(name)
    return sys.modules["torch"]


def start(path: str, idle: float, imports: list[str], owner: int = 0) -> Pool:
    """Out of the starting guard's tree (``owner`` 0), or its child that dies with it (a job's
    pool: ``owner`` its pid); torch and ``imports`` loaded, listening; else a line ``error
    TEXT`` on stdout and exit 1."""
    if owner:
        die_with(owner)
    elif os.fork() > 0:
        os._exit(0)
    ctypes_prctl(PR_SET_CHILD_SUBREAPER, 1)
    pool = Pool(path, idle)
    try:
        torch = load(imports, JOB_POOL_NICE if owner else 0)
        pool.listen()
        pool.facts = {"python": sys.executable, "torch": str(torch.__version__),
                      "started": time.time(), "imports": imports, "place": namespaces()}
        if owner:
            pool.facts["job"] = True
        pool.write_record(first=True)
    except BaseException as exc:  # noqa: BLE001 - said to the guard, which starts cold
        if pool.listener is not None:  # (what it made: its socket, no record)
            for made in (path, pool.record):
                try:
                    os.unlink(made)
                except OSError:
                    pass
        print("error " + f"{type(exc).__name__}: {exc}"[:500], flush=True)
        os._exit(1)
    os.chdir("/")
    held = os.environ.pop(HOLD_FD_VAR, "")
    if held.isdigit():  # (its guard holds it from its start: no idle end before its go)
        try:
            pool.hold(socket.socket(fileno=int(held)))
        except OSError:
            pass
    pool.last = time.monotonic()  # (its imports were no idle time)
    let_key_go()  # (listening: a guard may find it now)
    said = READY + " " + json.dumps({"pid": os.getpid(), "torch": str(torch.__version__)})
    try:  # (unbuffered: nothing of it left to reach a rank's output later)
        os.write(1, (said + "\n").encode())
    except OSError:  # (its guard stopped waiting, warm_pool.BEFORE_READY: serve the next run)
        pass
    return pool


def main() -> None:
    path, idle, owner, imports = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    main_keys = {k for k in sys.modules["__main__"].__dict__ if k.startswith("__")}
    sys_path = list(sys.path)
    pool = start(path, idle, imports, owner)
    log = os.open(path[:-len(".sock")] + ".log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDWR)
    for fd, to in ((0, null), (1, null), (2, log)):
        os.dup2(to, fd)
    os.close(log)
    os.close(null)
    got = pool.serve()
    if got is None:
        said = path[:-len(".sock")] + ".log"
        if os.path.exists(said) and not os.path.getsize(said):
            os.unlink(said)  # (one with the pool's own trouble in it stays, to be read)
        os._exit(0)  # (torch's exit handlers: nothing of theirs to do in a pool)
    request, fds, go, parent = got
    become(request, fds, go, parent, sys_path, main_keys)
    code = compile(SHIM_BOOT, "<string>", "exec")
    exec(code, sys.modules["__main__"].__dict__)  # noqa: S102 - the shim, as `python -c` runs it
