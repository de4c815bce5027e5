"""A directory of small JSON records, each naming a live process: how they are written, read,
removed and told stale, for the node's lease records (``node.leases``, in a shared sticky
directory every user writes in) and the head's registry of running heads (``control.registry``,
a directory of the user's own).

Standard library only: a part of every node program that leases (inlined by
``remote.bootstrap``), and imported as a module on the head. What makes a record safe where
others may plant files: it is written under a new name (``O_EXCL``, never through a planted link)
and renamed over whatever had its name; it is read without following a link, only from a regular
file (a planted FIFO or device is not opened for reading and waited on), with its owner's uid for
the reader to judge. Which directory is trusted, and which owners, stays with each user of this.
"""

import json
import os
import stat


def write_record(path: str, record: dict, mode: int, dir_fd: int | None = None,
                 tmp: str = "") -> None:
    """``record`` as ``path`` (relative to ``dir_fd`` when given), with ``mode`` whatever the
    umask: written to ``tmp`` (default ``PATH.PID.tmp``; ``O_EXCL | O_NOFOLLOW``) and renamed
    over ``path``. OSError when it cannot be (``tmp`` removed)."""
    tmp = tmp or f"{path}.{os.getpid()}.tmp"
    try:
        wfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      mode, dir_fd=dir_fd)
        os.fchmod(wfd, mode)  # (the mode passed through the umask)
        with os.fdopen(wfd, "w") as f:
            json.dump(record, f)
        os.rename(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError:
        unlink(tmp, dir_fd)
        raise


def read_record(path: str, dir_fd: int | None = None,
                limit: int = -1) -> tuple[object, int] | None:
    """(the JSON value of the record at ``path``, the uid that owns the file); None when it is
    not a regular file, cannot be opened without following a link, or does not parse. ``limit``:
    read at most this many bytes (-1: all)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                     dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            return json.loads(f.read(limit)), st.st_uid
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def unlink(path: str, dir_fd: int | None = None) -> None:
    """Remove ``path`` if it can be (gone already, or not ours to remove: left)."""
    try:
        os.unlink(path, dir_fd=dir_fd)
    except OSError:
        pass


def alive(pid: object) -> bool:
    """Whether the process a record names runs (another user's counts: it cannot be signalled,
    but it is there)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
