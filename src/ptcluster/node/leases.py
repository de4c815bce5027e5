"""Leases: one of a node's resources (a rendezvous port; GPUs next) held by one job.

Standard library only (part of the guard). A lease is an exclusive ``flock`` on a file in
:data:`LEASE_DIR`, a sticky, world-writable directory (like ``/tmp``: every user can create files
in it, none can remove or replace another's). The kernel releases a ``flock`` when the last
descriptor of the open file closes, that is when the guard ends however it ends (SIGKILL, a
crash): no lease outlives its job. The files are cleaned up too, so that a box that runs jobs
for months does not gather one per job: a holder removes its lock file and record while it still
holds the lock, and a guard that starts removes the files of leases nobody holds (its user's;
root: anyone's). Removing a lock file that another process has opened but not yet locked is
safe because a lease counts only when the locked file is still the one at the path (checked
after the lock is taken, else taken again), the usual rule for lock files that get unlinked.

Who holds a lease is written beside it, in a file the holder owns (``NAME.UID.json``,
world-readable, never a secret): the lock file itself may have been created by another user, and
a file of another user can be locked (opened read-only) but not written. Safety against files
planted by other users: every open is ``O_NOFOLLOW`` and the lock must be a regular file; the
holder's file is written under a new name (``O_EXCL``) and renamed over, which replaces a planted
symlink instead of following it (``node.records``: the records the heads' registry keeps too).
"""

import errno
import fcntl
import os
import pwd
import socket
import stat
import time

from ptcluster.node.records import alive, read_record, unlink, write_record  # inlined

LEASE_DIR = "/run/lock/ptcluster"
_LOCK = ".lock"
RECORD_MODE = 0o644
"""A holder's record is world-readable (a umask of 077 must not hide who holds a lease)."""


class Lease:
    """A lease held by this process: released by :meth:`release` or when the process ends."""

    def __init__(self, fd: int, name: str, info_path: str, lock_path: str = "") -> None:
        self.fd, self.name, self.info_path, self.lock_path = fd, name, info_path, lock_path

    def release(self) -> None:
        """The record and the lock file go (while the lock is still held), then the lock."""
        if self.fd < 0:
            return
        for path in (self.info_path, self.lock_path):
            try:
                if path and (path == self.info_path or _same_file(self.fd, path)):
                    os.unlink(path)
            except OSError:  # (another user's lock file, in a sticky directory: it stays)
                pass
        os.close(self.fd)
        self.fd = -1


class Leasing:
    """Takes this job's leases; or, where the lease directory cannot be made or used (no
    /run/lock, say), stands in without them, and says why in ``off``: the job then runs as it
    did before leases, unchecked against other jobs (refusing every job there would be worse)."""

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory
        self.off: str | None = None
        try:
            sweep(ensure_dir(directory))
        except OSError as exc:
            self.off = f"{directory or LEASE_DIR}: {exc.strerror or exc}"

    def take(self, resource: str, info: dict) -> Lease | None:
        if self.off:
            return Lease(-1, lease_name(resource), "")
        return take(resource, info, self.directory)

    def holder(self, resource: str) -> dict | None:
        return None if self.off else holder(resource, self.directory)


def lease_name(resource: str) -> str:
    """The file name of a resource's lease on this node: with the hostname, so that nodes that
    happen to share a lock directory (a shared /run in containers) never share a lease."""
    return f"{resource}@{socket.gethostname()}"


def ensure_dir(directory: str | None = None) -> str:
    """The lease directory, made sticky and world-writable (mode 1777) where it is missing."""
    directory = directory or LEASE_DIR
    try:
        os.mkdir(directory, 0o1777)
        os.chmod(directory, 0o1777)  # mkdir's mode passes through the umask
    except FileExistsError:
        pass
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(errno.ENOTDIR, f"{directory} is not a directory")
    if st.st_uid not in (0, os.getuid()) and not st.st_mode & stat.S_ISVTX:
        raise OSError(errno.EPERM, f"{directory} belongs to uid {st.st_uid} and is not sticky: "
                                   "another user could replace the leases in it")
    return directory


def _open_lock(directory: str, name: str, create: bool) -> int:
    path = os.path.join(directory, name + _LOCK)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    fd = os.open(path, flags, 0o444)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path} is not a regular file")
    if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) != 0o444:
        os.fchmod(fd, 0o444)  # (the mode passed through the umask: others must open it too)
    return fd


def _same_file(fd: int, path: str) -> bool:
    """``fd`` is the file at ``path`` now (not one unlinked, or replaced, since it was opened)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _lock(directory: str, name: str, create: bool, mode: int) -> int | None:
    """The lock file of ``name``, locked (``mode``: ``LOCK_EX`` or ``LOCK_SH``, never
    waiting) and still the file at its path; None when another process holds it."""
    path = os.path.join(directory, name + _LOCK)
    for _ in range(10):
        fd = _open_lock(directory, name, create)
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError:
            os.close(fd)
            raise
        if _same_file(fd, path):
            return fd
        os.close(fd)  # its holder removed it as we opened it: a fresh one is at the path
    raise OSError(errno.EAGAIN, f"{path} keeps being replaced")


def sweep(directory: str) -> None:
    """Remove the files of leases that nobody holds (a holder killed before it could): the
    lock files this user may remove, and the records of holders that are gone."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return
    names = {e[:-len(_LOCK)] for e in entries if e.endswith(_LOCK)}
    uid = os.getuid()
    for name in names:
        path = os.path.join(directory, name + _LOCK)
        try:
            if uid != 0 and os.stat(path, follow_symlinks=False).st_uid != uid:
                continue  # (sticky: not ours to remove)
            fd = _lock(directory, name, create=False, mode=fcntl.LOCK_EX)
        except OSError:
            continue
        if fd is None:
            continue  # held
        try:
            for entry in entries:
                if entry.startswith(name + ".") and entry.endswith(".json"):
                    unlink(os.path.join(directory, entry))
            unlink(path)
        finally:
            os.close(fd)
    for entry in entries:  # records whose lock file is gone (kill's notes are not records)
        if entry.endswith(".json") and not entry.startswith("kill-") and \
                entry.rsplit(".", 2)[0] not in names:
            unlink(os.path.join(directory, entry))


def take(resource: str, info: dict, directory: str | None = None) -> Lease | None:
    """Lease ``resource`` for as long as this process lives; None when another holds it."""
    name = lease_name(resource)
    directory = ensure_dir(directory)
    fd = _lock(directory, name, create=True, mode=fcntl.LOCK_EX)
    if fd is None:
        return None
    info_path = os.path.join(directory, f"{name}.{os.getuid()}.json")
    record = {**info, "resource": resource, "node": socket.gethostname(), "pid": os.getpid(),
              "uid": os.getuid(),
              "user": info.get("user") or user_name(), "since": info.get("since", time.time())}
    try:
        write_record(info_path, record, RECORD_MODE)
    except OSError:  # who holds it is advice; the lock is the lease
        pass
    return Lease(fd, name, info_path, os.path.join(directory, name + _LOCK))


def kill_note(job_id: str, directory: str | None = None, uid: int | None = None) -> str:
    """Where ``ptcluster kill`` says who ended a job, for the job's guard on this node."""
    return os.path.join(directory or LEASE_DIR, f"kill-{job_id}@{socket.gethostname()}."
                                                f"{os.getuid() if uid is None else uid}.json")


def read_kill_notes(job_id: str, directory: str | None = None) -> dict:
    """The newest ``kill`` note for ``job_id`` on this node (removing the ones it may), or {}."""
    directory = directory or LEASE_DIR
    prefix = os.path.basename(kill_note(job_id, directory)).rsplit(".", 2)[0] + "."
    best: dict = {}
    try:
        entries = os.listdir(directory)
    except OSError:
        return {}
    for entry in entries:
        if not (entry.startswith(prefix) and entry.endswith(".json")):
            continue
        path = os.path.join(directory, entry)
        got = read_record(path)
        if got is None:
            continue
        note, writer = got
        unlink(path)
        if writer not in (0, os.getuid()):
            continue  # only who could signal this guard may say who did
        if isinstance(note, dict) and float(note.get("t", 0)) >= float(best.get("t", 0)):
            best = note
    return best


def user_name() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def holder(resource: str, directory: str | None = None) -> dict | None:
    """Who holds ``resource`` now ({} when held but not said by whom); None when it is free."""
    name = lease_name(resource)
    directory = directory or LEASE_DIR
    try:
        fd = _open_lock(directory, name, create=False)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None  # nobody holds it (our shared lock goes with the close)
    except BlockingIOError:
        pass
    finally:
        os.close(fd)
    return _said(directory, name)


def held_all(directory: str | None = None) -> list[dict]:
    """The record of every lease held on this node now (any user's): what ``ptcluster ps``
    lists. A lock file nobody holds is a lease that has ended, whatever its records say."""
    directory = directory or LEASE_DIR
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    out = []
    for entry in sorted(entries):
        if not entry.endswith(_LOCK):
            continue
        name = entry[:-len(_LOCK)]
        try:
            fd = _open_lock(directory, name, create=False)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            continue  # free
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
        record = _said(directory, name)
        if record:
            out.append(record)
    return out


def _said(directory: str, name: str) -> dict:
    """The newest holder's file of a held lease whose process is alive."""
    best: dict = {}
    for entry in os.listdir(directory):
        if not (entry.startswith(name + ".") and entry.endswith(".json")):
            continue
        got = read_record(os.path.join(directory, entry))
        record = got[0] if got else None
        if isinstance(record, dict) and alive(record.get("pid")) and \
                float(record.get("since", 0)) >= float(best.get("since", 0)):
            best = record
    return best


def describe(record: dict, memory: str | None = None) -> str:
    """``job 20261201-0930-ab12 (alice, python train.py, since 09:30, 31 GiB)``, from what is
    known; ``memory``: what its processes use of the resource (a GPU's memory), when known."""
    if not record:
        return "another job (its holder did not say who" + (f", {memory}" if memory else "") \
            + ")"
    since = time.strftime("%H:%M", time.localtime(float(record["since"]))) \
        if record.get("since") else "?"
    said = ", ".join(str(x) for x in (record.get("user"), record.get("command"),
                                      f"since {since}", memory, f"head {record.get('head')}"
                                      if record.get("head") else None) if x)
    return f"job {record.get('job_id', '?')} ({said})"
