"""The running head's door for other terminals, server side: the control socket and what
answers its requests (the client side and the request kinds: ``control.protocol``).

The socket is served on its own threads; a request that needs the job's state (stacks, the
straggler figures) is handed to the head's loop as an :class:`Ask` and waited for, so the loop
alone touches that state, and nothing here holds up the job. Given the job's id, the server
also registers its run directory in this user's registry of heads (``control.registry``) while
it listens: that is how ``ptcluster kill JOB`` finds it.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from ptcluster.control import registry as heads
from ptcluster.control.protocol import (
    KILL_SIGNALS,
    Answer,
    JobFacts,
    Request,
    StacksAnswer,
    StragglerAnswer,
    at_short_path,
    kind_of,
    peer_uid,
)
from ptcluster.launch.supervise.straggler import Report
from ptcluster.node.wire import KILLED_BY
from ptcluster.rundir import RunDir

log = logging.getLogger(__name__)
Handler = Callable[[dict[str, Any]], dict[str, Any]]
ASK_SECONDS = 4.0
"""How long the control socket waits for the loop's straggler figures (``monitor`` asks with a
5 s timeout of its own)."""
STACKS_SECONDS = 20.0
"""How long a ``stacks`` request waits for the loop's collection (it takes <= ``STACKS_WAIT``)."""


class ControlServer:
    """Serves requests on its own threads; ``handler(request) -> answer`` may block (a stacks
    collection takes a few seconds) but never holds up the job: the runner's loop does the work
    and the handler only waits for it."""

    def __init__(self, run_dir: Path, handler: Handler, job_id: str | None = None) -> None:
        self.path = RunDir(run_dir).control_socket
        self.handler = handler
        self.job_id = job_id
        self.unregistered = ""
        """Why the job could not be registered (``control.registry``), "" when it was or none was
        asked for: ``ptcluster kill`` then goes through the guards."""
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # never a moment with the socket open to others
        try:
            at_short_path(self.path, lambda short: self.sock.bind(short))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        self.sock.listen(8)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="control", daemon=True)
        self._thread.start()
        if job_id is not None:
            try:
                heads.register(job_id, run_dir)
            except OSError as exc:
                self.unregistered = f"{exc.strerror or exc}"
                if exc.filename:
                    self.unregistered = f"{exc.filename}: {self.unregistered}"

    def close(self) -> None:
        self._closed.set()
        if self.job_id is not None and not self.unregistered:
            heads.unregister(self.job_id)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            self.path.unlink()
        except OSError:
            pass

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                if peer_uid(conn) not in (os.getuid(), 0):
                    return
                conn.settimeout(10.0)
                line = conn.makefile("rb").readline(65536)
                if not line.strip():
                    return  # a look whether we are alive (``alive``), not a request
                request = json.loads(line)
                answer = self.handler(request if isinstance(request, dict) else {})
            except Exception as exc:  # noqa: BLE001 - the asker gets the reason, the job goes on
                log.debug("control request failed", exc_info=True)
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            try:
                conn.sendall(json.dumps(answer).encode() + b"\n")
            except OSError:
                pass



@dataclass(frozen=True)
class Ask:
    """From the control socket's thread to the head's loop: collect the stacks (``what``
    ``Request.STACKS``) or take the straggler report's figures (``Request.STRAGGLER``), and
    answer on ``reply`` (unless the asker gave up, at ``until``, monotonic clock)."""

    what: str
    reply: queue.Queue[Answer]
    until: float


class HeadDoor:
    """What answers the control socket's requests for a running job (``answer`` is the
    server's handler, called on its threads).

    ``post`` hands an :class:`Ask` to the head's loop; ``stop(reason)`` is the head's
    thread-safe ``request_stop``. The loop keeps ``looping`` and ``figures`` up to date:
    between attempts and during a teardown the last figures are answered at once."""

    def __init__(self, job_id: str, post: Callable[[Ask], None],
                 stop: Callable[[str], None]) -> None:
        self.job_id = job_id
        self.post = post
        self.stop = stop
        self.looping = False
        """Whether the loop runs (and answers an ``Ask``)."""
        self.figures: tuple[int, Report | None] = (-1, None)
        """(the straggler watch's version, its figures) as last built by the loop."""
        self.killed_by = ""
        """Who ended the job through the control socket (``ptcluster kill``), if anyone did."""
        self.job: JobFacts = {}
        """The running attempt's ``{attempt, world_size, nodes}`` (set by the loop as each
        attempt starts), answered beside the straggler figures (``monitor --serve``)."""

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        kind = kind_of(request)
        if kind == Request.STACKS:
            return cast(dict[str, Any], self.stacks())
        if kind == Request.KILL:
            return self._kill(request)
        if kind == Request.STRAGGLER:
            return cast(dict[str, Any], self.straggler())
        return {"ok": False, "error": f"unknown request {kind[:40]!r}"}

    def stacks(self, timeout: float = STACKS_SECONDS) -> StacksAnswer:
        """Every rank's stacks, collected by the loop (the job goes on), and the straggler
        report's figures."""
        answer = cast(StacksAnswer, self._ask(Request.STACKS, timeout))
        if not answer.get("ok", True):
            return answer
        return {**answer, "straggler": self.straggler().get("straggler")}

    def straggler(self) -> StragglerAnswer:
        """The straggler report's current figures. From the loop while it runs (built when
        asked: those of 8192 ranks take ~80 ms), else at once, as the last loop left them."""
        if not self.looping:
            return {"ok": True, "straggler": self.figures[1], "job": JobFacts(**self.job)}
        answer = cast(StragglerAnswer, self._ask(Request.STRAGGLER, ASK_SECONDS))
        return {**answer, "job": JobFacts(**self.job)}

    def _ask(self, what: str, timeout: float) -> Answer:
        """The loop's answer to ``what``, built there from its own state."""
        reply: queue.Queue[Answer] = queue.Queue(maxsize=1)
        self.post(Ask(what, reply, time.monotonic() + timeout))
        try:
            return reply.get(timeout=timeout)
        except queue.Empty:
            return {"ok": False, "error": f"no {what} report within {timeout:.0f} s"}

    def _kill(self, request: dict[str, Any]) -> dict[str, Any]:
        """``ptcluster kill`` (the owner or root: the control socket checked who): stop the job
        in order everywhere, as on Ctrl-C, with the asker named as the cause; KILL is the
        hurried stop of a second Ctrl-C (no waiting for the nodes)."""
        job_id, signame = request.get("job_id"), request.get("signal") or "TERM"
        if job_id != self.job_id:
            return {"ok": False, "error": f"this head runs job {self.job_id}, not "
                                          f"{str(job_id)[:40]}"}
        if signame not in KILL_SIGNALS:
            return {"ok": False, "error": f"unknown signal {str(signame)[:20]!r}"}
        by = request.get("by")
        by = by if isinstance(by, dict) else {}
        host, user = (str(by.get(k) or "?")[:100] for k in ("host", "user"))
        self.killed_by = self.killed_by or KILLED_BY.format(host=host, user=user)
        for _ in range(2 if signame == "KILL" else 1):
            self.stop(self.killed_by)
        return {"ok": True, "job_id": self.job_id, "pid": os.getpid()}
