"""Leases: one of a node's resources (a rendezvous port; GPUs next) held by one job.

Standard library only (part of the guard). A lease is an exclusive ``flock`` on a file named
``ptcluster-*`` in :data:`LEASE_DIR`, ``/run/lock`` itself: the system's lock directory (where
serial-port locks have always lived, ``LCK..ttyS0``), which Debian and Ubuntu make at every boot
(systemd-tmpfiles' ``legacy.conf``) as a sticky, world-writable directory of root's. So every
user can create files in it, none can remove or replace another's, and nobody but root can
change the directory itself (its owner could take or drop every lease in it); and it is there
on a fresh machine, for any user, with nothing to set up. The rule fails closed: where it is not
root's sticky 1777 directory (or is a link), a job is refused, unless the user passed
``run --no-leases``: leases are never silently off. Only files named ``ptcluster-*`` are ever
read, swept or made here: the rest of the directory is other programs'.

The kernel releases a ``flock`` when the last descriptor of the open file closes, that is when
the guard ends however it ends (SIGKILL, a crash): no lease outlives its job. The files are
cleaned up too, so that a box that runs jobs for months does not gather one per job: a holder
removes its lock file and record while it still holds the lock, and a guard that starts removes
the files of leases nobody holds (its user's; root: anyone's). Removing a lock file that another
process has opened but not yet locked is safe because a lease counts only when the locked file
is still the one at the path (checked after the lock is taken, else taken again), the usual rule
for lock files that get unlinked.

Every file here is opened through ``node.sharing.safefile``: no link followed, no FIFO waited on, a
regular file or nothing. A lock file is opened as it is first (another user's leftover one too:
read-only, which is all a ``flock`` needs) and made only with ``O_EXCL`` when there is none, so
``fs.protected_regular`` (which refuses ``O_CREAT`` on another user's file in a sticky
directory) never turns a leftover lock into a refusal.

Who holds a lease is written beside it, in a file the holder owns (``NAME.UID.RAND.json``, a
random part no one can guess and plant first; world-readable, never a secret: the program's
name, not its arguments). Anyone can write a file of that name pattern, so a record is believed
only when it is well formed, its file belongs to the uid it names (or to root), and its pid is
the one the kernel names as the lock's holder (``/proc/locks``): a record another user planted
names nobody (``ptcluster kill`` signals what the record names).
"""

import bisect
import errno
import fcntl
import os
import pwd
import secrets
import socket
import stat
import time

from ptcluster.node.sharing.records import (
    MOST_TEXT,
    _number,
    alive,
    read_record,
    unlink,
    well_formed,
    write_record,
)
from ptcluster.node.sharing.safefile import create_new, open_regular
from ptcluster.node.wire import LeaseOwner, LeaseRecord

LEASE_DIR = "/run/lock"
PREFIX = "ptcluster-"
"""Every file of ours in the lease directory is named so (and no other file there is touched)."""
_KILL = PREFIX + "kill-"
"""``kill``'s notes (``ptcluster-kill-JOB@HOST.UID.json``): not lease records."""
_LOCK = ".lock"
RECORD_MODE = 0o644
"""A holder's record is world-readable (a umask of 077 must not hide who holds a lease)."""
NO_LEASES = ("run --no-leases: this job takes no leases here (unsafe: other jobs may take its "
             "GPUs and port, and `ptcluster ps` and `kill` do not see it here)")
"""Why a job's leases are off when its user opted out (said on every node: ``leases_off``)."""


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
    """Takes this job's leases in the lease directory (checked, and swept, when made: OSError
    when it is missing or not root's: see :func:`ensure_dir`); or, when ``off`` says why (the
    user's ``run --no-leases``), stands in without them."""

    def __init__(self, directory: str | None = None, off: str | None = None) -> None:
        self.directory = directory
        self.off = off
        if off is None:
            sweep(ensure_dir(directory))

    def take(self, resource: str, info: LeaseOwner) -> Lease | None:
        if self.off:
            return Lease(-1, lease_name(resource), "")
        return take(resource, info, self.directory)

    def holder(self, resource: str) -> LeaseRecord | None:
        return None if self.off else holder(resource, self.directory)


def lease_name(resource: str) -> str:
    """The file name of a resource's lease on this node (``ptcluster-gpu-0@n1``): with the
    hostname, so that nodes that happen to share a lock directory (a shared /run in containers)
    never share a lease."""
    return f"{PREFIX}{resource}@{socket.gethostname()}"


def dir_problem(st: os.stat_result) -> str:
    """Why a lease directory with this (``lstat``) status cannot be trusted ("" when it can)."""
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != 0:
        return (f"belongs to uid {st.st_uid}, not to root: that user can remove, take or "
                "block every job's leases in it")
    if stat.S_IMODE(st.st_mode) != 0o1777:
        return f"has mode {stat.S_IMODE(st.st_mode):o}, not 1777"
    return ""


def ensure_dir(directory: str | None = None) -> str:
    """The lease directory: a real directory of root's, mode 1777 (``/run/lock`` is so from
    boot). Made so where it is missing when we are root (a container without one); else
    OSError, whose text says what is wrong with it (missing: ENOENT)."""
    directory = directory or LEASE_DIR
    if os.getuid() == 0:
        try:
            os.mkdir(directory, 0o1777)
            os.chmod(directory, 0o1777)  # mkdir's mode passes through the umask
        except FileExistsError:
            pass
        except OSError as exc:
            raise OSError(exc.errno, f"{directory} cannot be made: {exc.strerror}") from None
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        raise OSError(errno.ENOENT, f"{directory} is missing (only root may make it)") from None
    why = dir_problem(st)
    if why:
        raise OSError(errno.EPERM, f"{directory} {why}")
    return directory


def _open_lock(directory: str, name: str, create: bool) -> int:
    """A read-only descriptor of the lock file of ``name`` (a regular file: never a link or a
    FIFO), as it is, whoever made it; made (``O_EXCL``, mode 444) only where there is none and
    ``create``. FileNotFoundError where there is none and not ``create``."""
    path = os.path.join(directory, name + _LOCK)
    for _ in range(10):
        try:
            return open_regular(path, os.O_RDONLY)
        except FileNotFoundError:
            if not create:
                raise
        try:
            return create_new(path, 0o444, flags=os.O_RDONLY)
        except FileExistsError:
            continue  # another made it meanwhile: open theirs
    raise OSError(errno.EAGAIN, f"{path} keeps being replaced")


PLANTED = frozenset({errno.EISDIR, errno.EINVAL, errno.ELOOP, errno.EACCES, errno.EPERM,
                     errno.ENXIO, errno.ENOTDIR, errno.EAGAIN, errno.ENODEV})
"""How a lock path that is not an openable regular file fails (a directory, link, FIFO, device,
mode-000 file): busy, held by an unknown holder; passed over, never a refusal (review M1)."""


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
        try:
            fd = _open_lock(directory, name, create)
        except FileNotFoundError:
            raise
        except OSError as exc:
            if exc.errno in PLANTED:
                return None  # busy: held by an unknown holder (whoever put it there)
            raise
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
    lock files this user may remove, the records of holders that are gone, and ``kill``'s
    notes for jobs whose lease is gone (a job's guard reads its note while it holds it)."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return
    entries = [e for e in entries if e.startswith(PREFIX)]  # (the rest is not ours)
    names = {e[:-len(_LOCK)] for e in entries if e.endswith(_LOCK)}
    uid = os.getuid()
    for name in names:
        path = os.path.join(directory, name + _LOCK)
        try:
            st = os.stat(path, follow_symlinks=False)
            if uid != 0 and st.st_uid != uid:
                continue  # (sticky: not ours to remove)
            if not stat.S_ISREG(st.st_mode):
                unlink(path)  # (root: a link or FIFO planted where a lock belongs)
                continue
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
    locks = {e[:-len(_LOCK)] for e in _listdir(directory) if e.endswith(_LOCK)}
    for entry in entries:  # records whose lock file is gone; kill's notes whose job's is
        of = entry.rsplit(".", 2)[0]
        if entry.endswith(".json") and (PREFIX + "job-" + of[len(_KILL):] not in locks
                                        if entry.startswith(_KILL) else not _of_any(entry,
                                                                                     names)):
            unlink(os.path.join(directory, entry))


def _of_any(entry: str, names: set[str]) -> bool:
    """Whether record ``entry`` (``NAME.UID[.RAND].json``; NAME may hold dots) is of one of
    ``names``."""
    return any(c == "." and entry[:i] in names for i, c in enumerate(entry))


def take(resource: str, info: LeaseOwner, directory: str | None = None) -> Lease | None:
    """Lease ``resource`` for as long as this process lives; None when another holds it."""
    name = lease_name(resource)
    directory = ensure_dir(directory)
    fd = _lock(directory, name, create=True, mode=fcntl.LOCK_EX)
    if fd is None:
        return None
    # (a name no one can guess, so none can be planted first: L1)
    info_path = os.path.join(directory, f"{name}.{os.getuid()}.{secrets.token_hex(8)}.json")
    record: LeaseRecord = {
        **info, "resource": resource, "node": socket.gethostname(), "pid": os.getpid(),
        "uid": os.getuid(), "user": user_name(), "since": time.time()}
    try:
        write_record(info_path, {k: v[:MOST_TEXT] if isinstance(v, str) else v
                                 for k, v in record.items()}, RECORD_MODE)
    except OSError:  # who holds it is advice; the lock is the lease
        pass
    return Lease(fd, name, info_path, os.path.join(directory, name + _LOCK))


def kill_note(job_id: str, directory: str | None = None, uid: int | None = None) -> str:
    """Where ``ptcluster kill`` says who ended a job, for the job's guard on this node."""
    return os.path.join(directory or LEASE_DIR, f"{_KILL}{job_id}@{socket.gethostname()}."
                                                f"{os.getuid() if uid is None else uid}.json")


def read_kill_notes(job_id: str, directory: str | None = None) -> dict:
    """The newest ``kill`` note for ``job_id`` on this node (removing the ones it may), or {}.
    Only notes of who could signal this guard count (its user, root); a malformed one is
    skipped, a FIFO or link is never opened (the guard reads them on its way to teardown)."""
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
        got = read_record(path, limit=4096, owners=(0, os.getuid()))
        if got is None:
            continue
        note = got[0]
        unlink(path)
        if isinstance(note, dict) and _number(note.get("t", 0)) and \
                note.get("t", 0) >= best.get("t", 0):
            best = note
    return best


def user_name(uid: int | None = None) -> str:
    """The name of ``uid`` (default: ours) on this node; the number where it has none."""
    uid = os.getuid() if uid is None else uid
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _flock_holders() -> dict[str, set[int]] | None:
    """``{"MAJ:MIN:INODE": pids}`` of every ``flock`` held on this machine, as the kernel lists
    them (``/proc/locks``); None where it cannot be read."""
    try:
        with open("/proc/locks", "rb") as f:
            text = f.read(1 << 24).decode("ascii", "replace")
    except OSError:
        return None
    out: dict[str, set[int]] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[4].isdigit():
            out.setdefault(fields[5], set()).add(int(fields[4]))
    return out


def _holders_of(fd: int, table: dict[str, set[int]] | None) -> set[int]:
    """The pids that hold the lock on ``fd``'s file (empty: not known)."""
    st = os.fstat(fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return (table or {}).get(key, set())


def _held(directory: str, name: str, table: dict[str, set[int]] | None) -> set[int] | None:
    """None when the lease of ``name`` is not held (no lock file, or nobody has it locked);
    else the pids the kernel names as its holders (empty when it does not say)."""
    try:
        fd = _open_lock(directory, name, create=False)
    except FileNotFoundError:
        return None
    except OSError:
        return set()  # (not a lock file we can try: held, by whoever planted it)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None  # nobody holds it (our shared lock goes with the close)
    except BlockingIOError:
        return _holders_of(fd, table)
    finally:
        os.close(fd)


def holder(resource: str, directory: str | None = None) -> LeaseRecord | None:
    """Who holds ``resource`` now ({} when held but not said by whom); None when it is free."""
    name = lease_name(resource)
    directory = directory or LEASE_DIR
    held = _held(directory, name, _flock_holders())
    if held is None:
        return None
    return _said(directory, name, held, sorted(_listdir(directory)))


def held_all(directory: str | None = None, unknown: bool = False) -> list[LeaseRecord]:
    """The record of every lease held on this node now (any user's): what ``ptcluster ps``
    lists. A lock file nobody holds is a lease that has ended, whatever its records say.
    ``unknown``: also ``{"resource", "node", "unknown": True}`` for each lease held with no
    record believed (a directory, link or FIFO planted at its lock path: M1)."""
    directory = directory or LEASE_DIR
    entries = sorted(_listdir(directory))
    table = _flock_holders()
    out: list[LeaseRecord] = []
    for entry in entries:
        if not (entry.startswith(PREFIX) and entry.endswith(_LOCK)):
            continue
        name = entry[:-len(_LOCK)]
        held = _held(directory, name, table)
        record: LeaseRecord = {} if held is None else _said(directory, name, held, entries)
        if record:
            out.append(record)
        elif held is not None and unknown:
            resource, _, node = name[len(PREFIX):].rpartition("@")
            out.append({"resource": resource[:MOST_TEXT], "node": node[:MOST_TEXT],
                        "unknown": True})
    return out


def _listdir(directory: str) -> list[str]:
    try:
        return os.listdir(directory)
    except OSError:
        return []


def _said(directory: str, name: str, holders: set[int], entries: list[str]) -> LeaseRecord:
    """The record of a held lease's holder: the newest of its records that is well formed,
    whose file belongs to the uid it names (or to root), whose process is alive and, where the
    kernel names the lock's holders, one of them, running as that uid. Its ``user`` is its
    uid's name here. ``entries``: the directory's, sorted (the records of ``name`` are found
    by bisection: O(log n) a lease, not O(n), with thousands of entries; L3)."""
    best: LeaseRecord = {}
    at = bisect.bisect_left(entries, name + ".")
    while at < len(entries) and entries[at].startswith(name + "."):
        entry, at = entries[at], at + 1
        if not entry.endswith(".json"):
            continue
        got = read_record(os.path.join(directory, entry), limit=16384)
        if got is None:
            continue
        record, owner = got
        if not well_formed(record) or owner not in (0, record["uid"]) \
                or (holders and record["pid"] not in holders) \
                or not _runs_as(record["pid"], record["uid"]) \
                or record["since"] < best.get("since", -1):
            continue
        best = {**record, "user": user_name(record["uid"])}
    return best


def _runs_as(pid: int, uid: int) -> bool:
    """Whether process ``pid`` runs, as ``uid`` (where ``/proc`` hides other users' processes,
    ``hidepid``: whether it runs)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid == uid
    except FileNotFoundError:
        return alive(pid)
    except OSError:
        return False


def describe(record: LeaseRecord, memory: str | None = None) -> str:
    """``job 20261201-093000-ab12cd (alice, python train.py, since 09:30, 31 GiB)``, from what is
    known; ``memory``: what its processes use of the resource (a GPU's memory), when known."""
    if not record:
        return "another job (its holder did not say who" + (f", {memory}" if memory else "") \
            + ")"
    since = time.strftime("%H:%M", time.localtime(record["since"])) \
        if well_formed(record) else "?"
    said = ", ".join(str(x) for x in (record.get("user"), record.get("command"),
                                      f"since {since}", memory, f"head {record.get('head')}"
                                      if record.get("head") else None) if x)
    return f"job {record.get('job_id', '?')} ({said})"
