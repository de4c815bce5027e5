"""The running head's door for other terminals: a Unix socket in the run directory (0600).

``ptcluster stacks`` connects to ``RUN_DIR/control.sock``, sends one JSON request line
(``{"cmd": "stacks"}``) and reads one JSON answer line. Only the owner can connect (the file
mode; the peer's uid is checked as well). The socket is bound and reached through the directory's
file descriptor, so a run directory deeper than a socket path may be (108 bytes) still works.

Given the job's id, the server also registers its run directory in this user's registry of
heads (``launch.heads``) while it listens: that is how ``ptcluster kill JOB`` finds it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ptcluster.control import registry as heads
from ptcluster.errors import PtclusterError
from ptcluster.launch.rundir import RunDir

log = logging.getLogger(__name__)
Handler = Callable[[dict[str, Any]], dict[str, Any]]


class ControlError(PtclusterError):
    """The running job cannot be asked (not running, or no answer)."""


class ControlServer:
    """Serves requests on its own threads; ``handler(request) -> answer`` may block (a stacks
    collection takes a few seconds) but never holds up the job: the runner's loop does the work
    and the handler only waits for it."""

    def __init__(self, run_dir: Path, handler: Handler, job_id: str | None = None) -> None:
        self.path = RunDir(run_dir).control_socket
        self.handler = handler
        self.job_id = job_id
        self.unregistered = ""
        """Why the job could not be registered (``launch.heads``), "" when it was or none was
        asked for: ``ptcluster kill`` then goes through the guards."""
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # never a moment with the socket open to others
        try:
            _with_dir(self.path, lambda short: self.sock.bind(short))
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


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (the kernel's word)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def ask(run_dir: Path, request: dict[str, Any], timeout: float = 30.0,
        owner: int | None = None) -> dict[str, Any]:
    """Send one request to the head running in ``run_dir``; its answer. With ``owner``, the
    head must run as that uid (a socket of anyone else is not asked)."""
    path = RunDir(run_dir).control_socket
    if not path.exists():
        raise ControlError(f"no job is running in {run_dir} (no {path.name})",
                           "give the run directory of a running job (see ./ptcluster-runs)")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            _with_dir(path, lambda short: s.connect(short))
        except (ConnectionRefusedError, FileNotFoundError):
            raise ControlError(f"the job of {run_dir} is no longer running (its head is gone)",
                               "give the run directory of a running job") from None
        if owner is not None and peer_uid(s) != owner:
            raise ControlError(f"{path} is served by uid {peer_uid(s)}, not by uid {owner}",
                               "give the run directory of your own job")
        try:
            s.sendall(json.dumps(request).encode() + b"\n")
            line = s.makefile("rb").readline()
        except TimeoutError:
            raise ControlError(f"the head of {run_dir} did not answer in {timeout:.0f} s",
                               "try again; the job itself is not affected") from None
        except (ConnectionResetError, BrokenPipeError):
            line = b""  # (closed before or after our request: we are not its owner)
    if not line:
        raise ControlError(f"the head of {run_dir} closed the connection without an answer",
                           "try again while the job runs")
    answer = json.loads(line)
    if not isinstance(answer, dict):
        raise ControlError(f"the head of {run_dir} gave a bad answer", "report this bug")
    return answer


def running_jobs(runs: Path) -> list[Path]:
    """The run directories under ``runs`` whose head still listens, newest first."""
    found = sorted((p for p in runs.glob("*") if RunDir(p).control_socket.exists()),
                   key=lambda p: p.stat().st_mtime, reverse=True) if runs.is_dir() else []
    return [p for p in found if alive(p)]


def alive(run_dir: Path) -> bool:
    """Whether a head still listens in ``run_dir`` (a head killed with SIGKILL leaves its
    socket file behind)."""
    path = RunDir(run_dir).control_socket
    if not path.exists():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            _with_dir(path, lambda short: s.connect(short))
        except OSError:
            return False
    return True


def _with_dir(path: Path, act: Callable[[str], None]) -> None:
    """``act`` on ``path`` named through an fd of its directory (a short name for any depth)."""
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        act(f"/proc/self/fd/{fd}/{path.name}")
    finally:
        os.close(fd)
