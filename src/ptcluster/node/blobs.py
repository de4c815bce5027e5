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
from collections.abc import Callable
from typing import BinaryIO

from ptcluster.node.problems import Declared

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


def write_problem(path: str, exc: OSError, full: Declared) -> dict:
    """Why ``path`` cannot be written, sent: ``full`` (fields path, free, error) for a full
    disk, else ``file.unwritable``."""
    if exc.errno in FULL:
        return full.sent(path=path, free=free_bytes(os.path.dirname(path)), error=exc)
    return UNWRITABLE.sent(path=path, error=exc.strerror or exc)


def part_name(final: str) -> str:
    folder, name = os.path.split(final)
    return os.path.join(folder, f"{PART_PREFIX}{name}-{secrets.token_hex(4)}")


def receive(stdin: BinaryIO, sha: str, size: int, final: str, full: Declared,
            mode: int = 0o600, tee: Callable[[bytes], None] | None = None) -> dict | None:
    """Exactly ``size`` bytes from ``stdin``, stored as ``final`` when their digest is ``sha``:
    None then, else the problem, sent (``Declared.sent``: ``{code, what, fix, fields}``; the
    temp file removed, an older ``final`` kept); ``full`` says a full disk. Each
    block goes to ``tee`` too (the relay's next node) as it arrives. Raises EOFError when the
    stream ended short (the head is gone)."""
    tmp = part_name(final)
    h, left, out, problem, placed = hashlib.sha256(), size, None, None, False
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
