"""The guard's temp directories: one per job, under a parent that is this user's alone.

Standard library only; a part of the guard (shipped by ``remote.bootstrap``). ``$TMPDIR``
(``/tmp``) is every user's: anyone can plant a ``ptcluster-…`` entry there, with a FIFO or a
link where a guard expects its pid file, and swap a folder for a link while a guard walks it.
So a job's directory lives in ``$XDG_RUNTIME_DIR/ptcluster-UID`` where that is this user's
(``/run/user/UID``: no one else can make it first), else ``$TMPDIR/ptcluster-UID``: a
directory of this user's with mode 700 (made, or checked where it exists: a real directory,
ours, closed to others); the cleanup of the directories SIGKILLed guards leave walks only
that parent, reads each pid file as a
regular file of ours (capped: never a link, never a FIFO waited on) and removes through
descriptors (``node.sharing.safefile``). Nothing outside the parent, nothing of another user's,
is ever looked at, let alone removed.
"""

from __future__ import annotations

import os
import tempfile

from ptcluster.node.guard.proctree import listdir
from ptcluster.node.guard.refusal import TMP_UNUSABLE, refuse
from ptcluster.node.sharing.records import alive
from ptcluster.node.sharing.safefile import (
    create_new,
    private_dir,
    read_regular,
    remove_tree,
    unsafe_dir,
)

PID_FILE = "guard.pid"
"""In each job's directory: the pid of the guard that made it (gone: the directory is stale)."""


def user_tmp() -> str:
    """This user's parent of the guards' job directories, made where missing. GuardError when
    what has its name is not a directory of ours closed to others (another user made it first:
    only they, or root, can remove it)."""
    path = os.path.join(runtime_dir() or tempfile.gettempdir(), f"ptcluster-{os.getuid()}")
    try:
        return private_dir(path)
    except OSError as exc:
        raise refuse(TMP_UNUSABLE, error=exc.strerror or exc, path=path) from None


def runtime_dir() -> str | None:
    """``$XDG_RUNTIME_DIR`` (``/run/user/UID``, made by logind, which no one else can make
    first) where it is a real directory of this user's closed to others; else None (L9)."""
    path = os.environ.get("XDG_RUNTIME_DIR", "")
    try:
        st = os.lstat(path) if path.startswith("/") else None
    except OSError:
        return None
    return path if st is not None and not unsafe_dir(st, others=0o077) else None


def remove_stale(parent: str) -> None:
    """Remove the job directories in ``parent`` whose guard is gone (SIGKILL leaves them):
    those whose pid file, a regular file of ours, names no live process."""
    uid = os.getuid()
    for name in listdir(parent):
        path = os.path.join(parent, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            got = read_regular(PID_FILE, 32, dir_fd=fd, owners=(uid,))
        finally:
            os.close(fd)
        try:
            pid = int(got[0].strip()) if got else 0
        except ValueError:
            continue
        if pid and not alive(pid):
            remove_tree(path)


def job_dir(parent: str, job_id: str, handed: dict[str, str]) -> str:
    """A new private directory for the job in ``parent`` (mkdtemp: 0700), with the guard's pid
    and the rank programs it hands on: the ranks get the shim's path, never code, in their
    env."""
    tmpdir = tempfile.mkdtemp(prefix=job_id + "-", dir=parent)
    for name, text in {PID_FILE: str(os.getpid()), **handed}.items():
        with os.fdopen(create_new(os.path.join(tmpdir, name), 0o600), "w") as f:
            f.write(text)
    return tmpdir
