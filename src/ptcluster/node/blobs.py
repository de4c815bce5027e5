"""Files received raw on a node channel, by digest: the node side of every program the head
ships files to (the project's environment's wheels, ``ptcluster push``'s data).

After a ``blob {sha256, size, ...}`` frame come exactly ``size`` raw bytes on the channel. They
are always all read (the channel stays in step), written to a temp name beside the final one,
verified by sha256 and only then renamed into place: nothing partial or damaged is ever under
its final name. A file that did not arrive is a declared problem (``TABLE``: ``file.*``, shared
by push and the environment's wheels; a full disk is the caller's own entry, its fix theirs),
sent as ``Declared.sent`` gives it. Standard library only; a part of the programs that use it.
"""

import errno
import hashlib
import os
import secrets
import socket
import time
from collections.abc import Callable
from typing import BinaryIO

from ptcluster.node.problems import Declared, Sent

CHUNK = 1 << 20
PART_PREFIX = ".ptcluster-part-"
"""The temp name's prefix (in the final file's folder): what a crash may leave, removed by the
next run."""
FULL = (errno.ENOSPC, errno.EDQUOT)

UNWRITABLE = Declared(
    "file.unwritable", "a file sent to a node cannot be written there",
    "cannot write {path}: {error}", "check that file system and its permissions")
CUT_SHORT = Declared(
    "file.cut-short", "the head's stream of a file ended early",
    "the head's stream ended {left} bytes short of {sha}", "run again")
DAMAGED = Declared(
    "file.damaged", "a file arrived with another sha256 than the head's",
    "{name} arrived with sha256 {got}, not {want} (damaged on the way, or the head's file "
    "changed while it was sent)", "run again")
TABLE = (UNWRITABLE, CUT_SHORT, DAMAGED)
"""Why a file sent to a node (push's data, the environment's wheels) is not stored there, beside
the caller's full disk (``push.disk-full``, ``venvs.disk-full``: fields path, free, error)."""


def free_bytes(path: str) -> int:
    """Bytes free to this user at ``path`` (-1 when unknown)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


def write_problem(path: str, exc: OSError, full: Declared) -> Sent:
    """Why ``path`` cannot be written, sent: ``full`` (fields path, free, error) for a full
    disk, else ``file.unwritable``."""
    if exc.errno in FULL:
        return full.sent(path=path, free=free_bytes(os.path.dirname(path)), error=exc)
    return UNWRITABLE.sent(path=path, error=exc.strerror or exc)


def part_name(final: str) -> str:
    """``final``'s temp name while it arrives, naming this program: its pid and host (a store
    that other programs write into too, on a home other machines may share: :func:`remove_parts`
    tells its own and this host's dead ones apart)."""
    folder, name = os.path.split(final)
    return os.path.join(folder, f"{PART_PREFIX}{_writer()}~{secrets.token_hex(4)}~{name}")


def _writer() -> str:
    return f"{os.getpid()}~{socket.gethostname()}"


def remove_parts(folder: str, dead_too: bool = False) -> None:
    """The temp files in ``folder`` of this program (as it ends), or of this host's programs
    that no longer run (``dead_too``: one killed mid-file left them); never a live program's,
    never another host's (a shared home: its pids are not this host's to judge)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    mine, host = _writer(), socket.gethostname()
    for name in names:
        said = name[len(PART_PREFIX):].split("~")
        if not (name.startswith(PART_PREFIX) and len(said) >= 4 and said[0].isdigit()):
            continue
        pid, writer = said[0], f"{said[0]}~{said[1]}"
        if writer != mine and not (dead_too and said[1] == host
                                   and not os.path.exists(f"/proc/{pid}")):
            continue
        try:
            os.unlink(os.path.join(folder, name))
        except OSError:
            pass


def receive(stdin: BinaryIO, sha: str, size: int, final: str, full: Declared,
            mode: int = 0o600, tee: Callable[[bytes], None] | None = None) -> Sent | None:
    """Exactly ``size`` bytes from ``stdin``, stored as ``final`` when their digest is ``sha``:
    None then, else the problem, sent (``Declared.sent``: ``{code, what, fix, fields}``; the
    temp file removed, an older ``final`` kept); ``full`` says a full disk. Each
    block goes to ``tee`` too (the relay's next node) as it arrives. Raises EOFError when the
    stream ended short (the head is gone)."""
    tmp = part_name(final)
    h, left, out, placed = hashlib.sha256(), size, None, False
    problem: Sent | None = None
    try:
        out = open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode), "wb")
    except OSError as exc:
        problem = write_problem(tmp, exc, full)
    try:
        while left:
            block = stdin.read(min(CHUNK, left))
            if not block:
                break
            left -= len(block)
            h.update(block)
            if tee is not None:
                tee(block)
            if out is not None and problem is None:
                try:
                    out.write(block)
                except OSError as exc:
                    problem = write_problem(tmp, exc, full)
        if out is not None:
            try:
                out.close()
            except OSError as exc:
                problem = problem or write_problem(tmp, exc, full)
        if left:
            problem = CUT_SHORT.sent(left=left, sha=sha[:12])
        elif problem is None and h.hexdigest() != sha:
            problem = DAMAGED.sent(name=os.path.basename(final), got=h.hexdigest()[:12],
                                   want=sha[:12])
        if problem is None:
            os.rename(tmp, final)
            placed = True
    finally:
        if not placed:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    if left:
        raise EOFError
    return problem


def pass_on(stream: BinaryIO, size: int, tee: Callable[[bytes], None]) -> None:
    """Exactly ``size`` bytes from ``stream``, each block to ``tee`` only (a file this node has
    already, on its way down the relay): nothing written here. Raises EOFError when short."""
    left = size
    while left:
        block = stream.read(min(CHUNK, left))
        if not block:
            raise EOFError
        left -= len(block)
        tee(block)


class HeadStream:
    """A node program's stdin (the head's channel), its reads marking when the program waits on
    the head and when a byte came: only a silence while it waits is the head's (while it writes
    a file, hashes or passes a block on down the relay, the time is this node's)."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.heard = time.monotonic()
        self.waiting = False

    def _wait(self, read: Callable[[int], bytes], size: int) -> bytes:
        self.waiting = True
        try:
            return read(size)
        finally:
            self.heard = time.monotonic()
            self.waiting = False

    def read(self, size: int = -1) -> bytes:
        return self._wait(self.raw.read, size)

    def readline(self, size: int = -1) -> bytes:
        return self._wait(self.raw.readline, size)

    def silent(self, seconds: float) -> bool:
        """The head has said nothing for ``seconds`` while this program waited on it."""
        return self.waiting and time.monotonic() - self.heard > seconds
