"""The running head's door for other terminals, client side: the request kinds and ``ask``.

``ptcluster stacks`` connects to the run directory's control socket (``RunDir.control_socket``),
sends one JSON request line (``{"cmd": "stacks"}``: a :class:`Request` kind) and reads one JSON
answer line. Only the owner can connect (the file mode; the peer's uid is checked as well), and
the asker asks only its own heads: the run directory must be its own, not writable by others,
its socket its own, and the process serving it must run as the asker (always: no caller can
forget it). The socket is bound and reached through the directory's file descriptor, so a run
directory deeper than a socket path may be (108 bytes) still works, and what is reached is in
the directory checked. The head's side is ``control.server``.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict, cast

from ptcluster.errors import PtclusterError
from ptcluster.launch.supervise.straggler import Report
from ptcluster.node.problems import Declared
from ptcluster.node.sharing import safefile
from ptcluster.rundir import RunDir


class Request:
    """Every request kind (``"cmd"``) a head answers: the one place they are spelled."""

    STACKS = "stacks"
    """Every rank's stacks, collected now (the job goes on), and the straggler figures:
    ``{ok, report, lines, saved, straggler}``."""
    STRAGGLER = "straggler"
    """The straggler report's current figures (``monitor``) and the running attempt's number,
    world size and nodes: ``{ok, straggler, job: {attempt, world_size, nodes}}``."""
    KILL = "kill"
    """End the job, as Ctrl-C does: ``{cmd, job_id, signal, by: {host, user}}`` -> ``{ok,
    job_id, pid}`` (the owner or root only)."""


CMD = "cmd"
"""The field of a request that holds its kind."""
KILL_SIGNALS = ("TERM", "INT", "KILL")
"""What a ``kill`` request may ask: TERM and INT stop in order, KILL hurries (a second Ctrl-C)."""


def kind_of(request: dict[str, Any]) -> str:
    """A request's kind (a :class:`Request` member when the asker speaks this protocol)."""
    return str(request.get(CMD))


def stacks_request() -> dict[str, Any]:
    return {CMD: Request.STACKS}


def straggler_request() -> dict[str, Any]:
    return {CMD: Request.STRAGGLER}


class JobFacts(TypedDict, total=False):
    """The running attempt (none before the first starts)."""

    attempt: int
    world_size: int
    nodes: int


class StragglerAnswer(TypedDict, total=False):
    """A head's answer to ``Request.STRAGGLER`` (``control.server.HeadDoor.straggler``)."""

    ok: bool
    straggler: Report | None
    """None before the loop built any figures."""
    job: JobFacts
    error: str
    """Why not (``ok`` false)."""


class StacksAnswer(TypedDict, total=False):
    """A head's answer to ``Request.STACKS``: the loop's collection
    (``launch.stacks.collector.StackCollector.finish``) with the straggler figures
    (``control.server.HeadDoor.stacks``)."""

    ok: bool
    report: dict[str, Any]
    """``StackReport.to_json()``: every rank's stacks, grouped."""
    lines: list[str]
    """The report as the terminal shows it."""
    saved: str
    """Where its text was saved (the run directory's ``stacks-*.txt``)."""
    straggler: Report | None
    error: str
    """Why not (``ok`` false)."""


Answer = StacksAnswer | StragglerAnswer
"""What the head's loop answers an ``Ask`` with (``control.server``)."""


def ask_stacks(run_dir: Path, timeout: float = 30.0) -> StacksAnswer:
    """Every rank's stacks from the head running in ``run_dir`` (``ask``'s checks: its own
    head, which built the answer from these types)."""
    return cast(StacksAnswer, ask(run_dir, stacks_request(), timeout=timeout))


def ask_straggler(run_dir: Path, timeout: float) -> StragglerAnswer:
    """The straggler figures of the head running in ``run_dir`` (``ask``'s checks: its own
    head, which built the answer from these types)."""
    return cast(StragglerAnswer, ask(run_dir, straggler_request(), timeout=timeout))


def kill_request(job_id: str, signame: str, by: dict[str, str]) -> dict[str, Any]:
    """Ask the head of ``job_id`` to end it with ``signame`` (:data:`KILL_SIGNALS`); ``by``
    names the asker (``host``, ``user``) for the job's summary."""
    return {CMD: Request.KILL, "job_id": job_id, "signal": signame, "by": by}


class ControlError(PtclusterError):
    """The running job cannot be asked (not running, or no answer): ``TABLE``'s problems."""


NO_JOB = Declared(
    "control.no-job", "no job runs in that run directory", "no job is running in {run_dir} "
    "(no {socket})", "give the run directory of a running job (see ./ptcluster-runs)")
HEAD_GONE = Declared(
    "control.head-gone", "the job's head is gone",
    "the job of {run_dir} is no longer running (its head is gone)",
    "give the run directory of a running job")
NOT_ASKED = Declared(
    "control.not-asked", "the job's control socket could not be reached", "{why}: not asked",
    "give the run directory of your own job")
NOT_OWNER = Declared(
    "control.not-owner", "the control socket is another user's",
    "{socket} is served by uid {uid}, not by uid {owner}",
    "give the run directory of your own job")
NO_ANSWER = Declared(
    "control.no-answer", "the job's head did not answer in time",
    "the head of {run_dir} did not answer in {timeout} s",
    "try again; the job itself is not affected")
CLOSED = Declared(
    "control.closed", "the job's head closed the connection without an answer",
    "the head of {run_dir} closed the connection without an answer",
    "try again while the job runs")
BAD_ANSWER = Declared(
    "control.bad-answer", "the job's head gave a bad answer",
    "the head of {run_dir} gave a bad answer", "report this bug")
TABLE = (NO_JOB, HEAD_GONE, NOT_ASKED, NOT_OWNER, NO_ANSWER, CLOSED, BAD_ANSWER)
"""Why a running job's head could not be asked (``stacks``, ``kill``, ``warm``)."""


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (the kernel's word)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def ask(run_dir: Path, request: dict[str, Any], timeout: float = 30.0,
        owner: int | None = None) -> dict[str, Any]:
    """Send one request to the head running in ``run_dir``; its answer. The run directory,
    its socket and the head must be ``owner``'s (default: ours): a socket of anyone else is
    not asked, and nothing of theirs is read."""
    owner = os.getuid() if owner is None else owner
    path = RunDir(run_dir).control_socket
    if not path.exists():
        raise ControlError.of(NO_JOB, run_dir=run_dir, socket=path.name)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            at_short_path(path, lambda short: s.connect(short), owner)
        except (ConnectionRefusedError, FileNotFoundError):
            raise ControlError.of(HEAD_GONE, run_dir=run_dir) from None
        except OSError as exc:  # (not ours, not a socket, no directory)
            raise ControlError.of(NOT_ASKED, why=exc.strerror or exc) from None
        if peer_uid(s) != owner:
            raise ControlError.of(NOT_OWNER, socket=path, uid=peer_uid(s), owner=owner)
        try:
            s.sendall(json.dumps(request).encode() + b"\n")
            line = s.makefile("rb").readline()
        except TimeoutError:
            raise ControlError.of(NO_ANSWER, run_dir=run_dir, timeout=f"{timeout:.0f}") from None
        except (ConnectionResetError, BrokenPipeError):
            line = b""  # (closed before or after our request: we are not its owner)
    if not line:
        raise ControlError.of(CLOSED, run_dir=run_dir)
    answer = json.loads(line)
    if not isinstance(answer, dict):
        raise ControlError.of(BAD_ANSWER, run_dir=run_dir)
    return answer


def running_jobs(runs: Path) -> list[Path]:
    """The run directories under ``runs`` whose head still listens, newest first."""
    found = sorted((p for p in runs.glob("*") if RunDir(p).control_socket.exists()),
                   key=lambda p: p.stat().st_mtime, reverse=True) if runs.is_dir() else []
    return [p for p in found if alive(p)]


def alive(run_dir: Path) -> bool:
    """Whether a head of ours still listens in ``run_dir`` (a head killed with SIGKILL leaves
    its socket file behind; another user's run directory or socket is not looked at)."""
    path = RunDir(run_dir).control_socket
    if not path.exists():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            at_short_path(path, lambda short: s.connect(short), os.getuid())
        except OSError:
            return False
    return True


def at_short_path(path: Path, act: Callable[[str], None], owner: int | None = None) -> None:
    """``act`` on ``path`` named through an fd of its directory (a short name for any depth).
    The directory must be ``owner``'s (default: ours) and writable by no one else, and a
    ``path`` that exists a socket of ``owner``'s (PermissionError else)."""
    owner = os.getuid() if owner is None else owner
    fd = safefile.open_dir(str(path.parent), others=0o022, follow=True, uid=owner)
    try:
        try:
            st = os.lstat(path.name, dir_fd=fd)
        except FileNotFoundError:
            st = None
        if st is not None and (not stat.S_ISSOCK(st.st_mode) or st.st_uid != owner):
            raise PermissionError(f"{path} is not a socket of uid {owner}")
        act(f"/proc/self/fd/{fd}/{path.name}")
    finally:
        os.close(fd)
