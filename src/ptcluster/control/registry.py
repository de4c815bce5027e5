"""The heads that run on this machine, per user: a job id -> its run directory (``ptcluster kill``).

While its control socket listens, a job's head keeps ``JOB_ID.json`` (``{job_id, run_dir, host,
pid}``) in ``$XDG_STATE_HOME/ptcluster/heads/`` (default ``~/.local/state/ptcluster/heads/``), and
removes it when the socket closes; ``ptcluster kill JOB`` reads it to reach that head's socket
(``RUN_DIR/control.sock``) instead of each node's guard.

Why a per-user registry and not the job's lease record: the head need not be a node (nothing of
the job is leased on its machine), and the lease directory is shared by every user, so a record
there naming a socket could be planted by anyone; a directory of one's own cannot.

Why it is safe: the directory is the user's own and nobody else's to write (owner-only, mode
0700, checked on every open: anything else is refused and ``kill`` goes through the guards); its
two last parts are opened without following symlinks, and each entry is opened ``O_NOFOLLOW``,
must be a regular file of this user's, is written under a new name (``O_EXCL``, 0600) and renamed
over (``node.sharing.records``: the records the node's leases keep too). Root reads root's own
registry only: root ends another user's job through the guards (a socket path another user chose
is never connected to as root).

An entry outlives a head killed by SIGKILL: ``kill`` takes a dead socket for "not here" (and
removes the entry), and a new head removes the entries of this machine's dead heads.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ptcluster.node.sharing.records import alive, read_record, unlink, valid_job_id, write_record
from ptcluster.node.sharing.safefile import unsafe_dir

_SUFFIX = ".json"


@dataclass(frozen=True)
class HeadEntry:
    """A job's head as it registered itself."""

    job_id: str
    run_dir: Path
    """Absolute: the control socket is ``run_dir / control.sock``."""
    host: str
    """The machine the head runs on (a home directory may be shared between machines)."""
    pid: int

    @property
    def here(self) -> bool:
        return self.host == socket.gethostname()


def directory() -> Path:
    """Where this user's heads register (``$XDG_STATE_HOME`` when it is an absolute path, as
    the XDG base directory rules say, else ``~/.local/state``)."""
    base = os.environ.get("XDG_STATE_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".local" / "state"
    return root / "ptcluster" / "heads"


def register(job_id: str, run_dir: Path) -> None:
    """Say that this process is ``job_id``'s head, running in ``run_dir``. OSError when the
    registry cannot be made or is not this user's alone (``safefile.unsafe_dir`` says why)."""
    if not valid_job_id(job_id):
        raise OSError(errno.EINVAL, f"job id {job_id[:40]!r} cannot name a registry entry")
    record = {"job_id": job_id, "run_dir": str(Path(run_dir).absolute()),
              "host": socket.gethostname(), "pid": os.getpid()}
    fd = _open_dir(create=True)
    try:
        _forget_dead(fd)
        write_record(job_id + _SUFFIX, record, 0o600, dir_fd=fd,
                     tmp=f".{job_id}.{os.getpid()}.tmp")
    finally:
        os.close(fd)


def unregister(job_id: str) -> None:
    """Remove ``job_id``'s entry if this process wrote it (never another head's)."""
    _remove(job_id, lambda entry: entry.here and entry.pid == os.getpid())


def find(job_id: str) -> HeadEntry | None:
    """``job_id``'s head as registered by this user (on this machine or, with a shared home,
    another: see ``HeadEntry.here``), or None."""
    if not valid_job_id(job_id):
        return None
    try:
        fd = _open_dir(create=False)
    except OSError:
        return None
    try:
        return _read(fd, job_id + _SUFFIX)
    finally:
        os.close(fd)


def running_here() -> list[HeadEntry]:
    """This user's heads that run on this machine now (``monitor --serve`` asks each for its
    job's figures); none when the registry is missing or not this user's alone."""
    try:
        fd = _open_dir(create=False)
    except OSError:
        return []
    try:
        found = [_read(fd, name) for name in sorted(os.listdir(fd))
                 if name.endswith(_SUFFIX) and not name.startswith(".")]
    finally:
        os.close(fd)
    return [e for e in found if e is not None and e.here and alive(e.pid)]


def forget(entry: HeadEntry) -> None:
    """Remove a stale entry (its head is gone) unless a new head has replaced it meanwhile."""
    _remove(entry.job_id, lambda found: found == entry)


def _remove(job_id: str, which: Callable[[HeadEntry], bool]) -> None:
    try:
        fd = _open_dir(create=False)
    except OSError:
        return
    try:
        entry = _read(fd, job_id + _SUFFIX)
        if entry is not None and which(entry):
            unlink(job_id + _SUFFIX, fd)
    finally:
        os.close(fd)


def _open_dir(create: bool) -> int:
    """An fd of the registry: ``ptcluster`` and ``heads`` opened without following a symlink,
    ``heads`` checked to be this user's alone."""
    path = directory()
    base = path.parent.parent
    if create:
        base.mkdir(parents=True, exist_ok=True)
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in (path.parent.name, path.name):
            if create:
                try:
                    os.mkdir(part, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass
            sub = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=fd)
            os.close(fd)
            fd = sub
        why = unsafe_dir(os.fstat(fd), others=0o077)
        if why:
            raise OSError(errno.EPERM, f"{path} {why}")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _read(fd: int, name: str) -> HeadEntry | None:
    got = read_record(name, dir_fd=fd, limit=65536)
    if got is None or got[1] != os.getuid():
        return None
    record = got[0]
    if not isinstance(record, dict):
        return None
    try:
        entry = HeadEntry(job_id=str(record["job_id"]), run_dir=Path(record["run_dir"]),
                          host=str(record["host"]), pid=int(record["pid"]))
    except (ValueError, KeyError, TypeError):
        return None
    ok = entry.pid > 0 and entry.run_dir.is_absolute() and name == entry.job_id + _SUFFIX
    return entry if ok else None


def _forget_dead(fd: int) -> None:
    """Remove the entries of this machine's heads that are gone (killed by SIGKILL)."""
    for name in os.listdir(fd):
        if not name.endswith(_SUFFIX) or name.startswith("."):
            continue
        entry = _read(fd, name)
        if entry is not None and entry.here and not alive(entry.pid):
            unlink(name, fd)
