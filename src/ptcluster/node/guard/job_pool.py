"""A job's own warm pool on this node (``--max-restarts``, issue 45): started by the first
attempt's guard once its ranks run, held by each attempt's guard in turn, from which the next
attempt's ranks are forked (ARCHITECTURE.md, "The warm path": restarts).

Standard library only; a part of the guard (shipped by ``remote.bootstrap``). The pool is this
guard's child (``PR_SET_PDEATHSIG``: it dies with it, SIGKILL included) until the guard hands it
on (``keep``: restarts are left, and the job did not end well or by the head's going); a guard
that holds a pool it did not start holds its ``own`` connection, whose end (the guard's, however
it ends) ends the pool. The forks themselves are ``run --warm``'s (``guard.warm_ranks``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time

from ptcluster.node.guard.warm_pool import (
    WarmError,
    job_mark,
    pool_files,
    pool_process,
    ready,
)
from ptcluster.node.rank_wire import ATTEMPT_VAR, MAX_RESTARTS_VAR
from ptcluster.node.sharing.records import read_record
from ptcluster.node.warm.pools import folder
from ptcluster.node.warm.protocol import (
    KEEP,
    KEPT,
    OWN,
    OWNED,
    POOL_FILE,
    namespaces,
    pool_env,
    receive,
    send,
)
from ptcluster.node.wire import GuardConfig

ANSWER_WITHIN = 5.0
"""Seconds the pool has to answer ``own`` or ``keep`` (it takes milliseconds)."""
READY_WAIT = 5.0
"""At the guard's end with restarts left: how long after the job's end (its ranks', or the
head's stop) it waits for a pool still importing (the job failed early) before it hands it on,
else ends it: the next attempt starts cold then. Within the head's stop deadline (8 s) with
room for the exit frame."""


class JobPool:
    """This job's pool on this node, as one guard holds it: ``claim`` the one a former attempt
    kept, or ``start`` one (in the background: the ranks start meanwhile); ``end`` hands it on
    or ends it."""

    def __init__(self, cfg: GuardConfig, env: dict[str, str], python: str) -> None:
        self.files = pool_files(cfg, env, python)
        self.mark = job_mark(cfg)
        self.owner: socket.socket | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        """The pool, where this guard started it (its child)."""
        self.thread: threading.Thread | None = None
        self.give_up = threading.Event()
        self.failed = ""

    @property
    def pid(self) -> int:
        """The pool's pid where it is this guard's child (the teardown spares it), else 0."""
        return self.proc.pid if self.proc is not None else 0

    def claim(self) -> str:
        """The socket of the pool a former attempt kept, held by this guard now; WarmError
        where there is none (or it refuses)."""
        self.owner = own(self.files["sock"], self.mark)
        return self.files["sock"]

    def start(self, cfg: GuardConfig, env: dict[str, str], python: str, tmpdir: str) -> None:
        """The pool, this guard's child at ``JOB_POOL_NICE``, started in a thread: held once
        ready (the next attempt's ranks come from it)."""
        warm = cfg.get("warm") or {}
        for stale in (self.files["sock"], self.files["record"]):
            if os.path.lexists(stale):
                os.unlink(stale)
        self.proc = pool_process(python, self.files["sock"], float(warm["idle"]), os.getpid(),
                                 list(warm.get("imports") or []), pool_env(env),
                                 os.path.join(tmpdir, POOL_FILE))
        self.thread = threading.Thread(target=self._ready, daemon=True, name="job-pool")
        self.thread.start()

    def _ready(self) -> None:
        assert self.proc is not None
        try:
            ready(self.proc, self.give_up)
            self.claim()
        except (WarmError, OSError) as exc:
            self.failed = str(exc)
            self.kill()

    def end(self, keep: bool, since: float = 0.0) -> bool:
        """Hand the pool on to the next attempt's guard (``keep``; a pool still importing
        waited for until ``READY_WAIT`` after ``since``, the job's end), or end it; either way
        this guard holds it no longer. True: it was handed on (the guard's exit frame says so:
        ``kept_pool``)."""
        if keep and self.thread is not None:
            self.thread.join(max(0.0, since + READY_WAIT - time.time()))
        self.give_up.set()
        if self.thread is not None:
            self.thread.join(ANSWER_WITHIN)
        kept = keep and self.owner is not None and self._keep()
        if self.owner is not None:
            self.owner.close()  # (not kept: the pool ends, with whatever it forked)
            self.owner = None
        if not kept:
            self.kill()
        return kept

    def _keep(self) -> bool:
        assert self.owner is not None
        try:
            self.owner.settimeout(ANSWER_WITHIN)
            send(self.owner, {"kind": KEEP})
            reply, fds = receive(self.owner)
        except OSError:
            return False
        for fd in fds:
            os.close(fd)
        return reply is not None and reply.get("kind") == KEPT

    def kill(self) -> None:
        """Where the pool is this guard's child: its end (at once where it is not held: its
        files go with it), SIGKILL if it is still there after ``ANSWER_WITHIN``, reaped."""
        if self.proc is None:
            return
        try:
            self.proc.wait(ANSWER_WITHIN if self.owner is None and self.thread is not None
                           and not self.thread.is_alive() and not self.failed else 0)
        except subprocess.TimeoutExpired:
            pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        for path in (self.files["sock"], self.files["record"]):  # (also after a SIGKILL
            # that came before: the guard's teardown on its own failure)
            if os.path.lexists(path):
                os.unlink(path)


def own(path: str, mark: str) -> socket.socket:
    """The ``own`` connection to the job's pool at ``path`` (``mark``: the job and node, in
    its record); WarmError where none answers or it refuses."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(ANSWER_WITHIN)
    try:
        sock.connect(path)
        send(sock, {"kind": OWN, "job": mark})
        reply, fds = receive(sock)
    except OSError as exc:
        sock.close()
        raise WarmError("none was kept by the last attempt" if isinstance(
            exc, (FileNotFoundError, ConnectionRefusedError)) else str(exc)) from None
    for fd in fds:
        os.close(fd)
    if reply is None or reply.get("kind") != OWNED:
        sock.close()
        raise WarmError(str((reply or {}).get("why") or "it did not answer"))
    sock.settimeout(None)
    return sock


def let_go(cfg: GuardConfig) -> None:
    """The pool a former attempt of this job kept on this node (its record's ``job``), ended
    now: this guard refused, so no rank of this attempt comes from it here."""
    mark, where = job_mark(cfg), folder()
    try:
        names = [n for n in os.listdir(where) if n.startswith("pool-") and n.endswith(".json")]
    except OSError:
        return
    for name in names:
        got = read_record(os.path.join(where, name), owners=(os.getuid(),))
        record = got[0] if got is not None else None
        if isinstance(record, dict) and record.get("job") == mark and \
                record.get("place") == namespaces():
            try:
                own(os.path.join(where, name[:-len(".json")] + ".sock"), mark).close()
            except WarmError:
                pass


def attempt_of(cfg: GuardConfig, name: str = ATTEMPT_VAR) -> int:
    """This attempt's number (0: the first), or ``name``'s value of the plan's environment."""
    try:
        return int((cfg.get("env") or {}).get(name, "0"))
    except ValueError:
        return 0


def restarts_left(cfg: GuardConfig) -> bool:
    """Whether another attempt may follow this one (``PTCLUSTER_ATTEMPT`` below
    ``PTCLUSTER_MAX_RESTARTS``)."""
    return attempt_of(cfg) < attempt_of(cfg, MAX_RESTARTS_VAR)
