"""Files in directories other users can write (``/tmp``, the lease directory, a shared runs
directory): the one way ptcluster opens them.

Standard library only: a part of every node program that touches such a directory (shipped by
``remote.bootstrap``), and imported as a module on the head. What another user can plant where
we open a file, and what each function here does about it:

* a **symlink** (to our own files, to ``/dev/zero``): never followed (``O_NOFOLLOW``; a link
  turns the open into ``ELOOP``);
* a **FIFO or a device**: opened without blocking (``O_NONBLOCK``: a FIFO with no writer would
  wait for one for ever) and refused before a byte is read (``S_ISREG``);
* a **file of theirs** under the name we meant to create: a new file is only ever made with
  ``O_EXCL`` (never reused, whatever its mode; under ``fs.protected_regular`` an ``O_CREAT``
  of another user's file in a sticky directory fails even when it would not create);
* a **huge file**: reads are capped;
* a **directory of theirs**, or one open to others, where ours should be: refused
  (:func:`private_dir` checks the owner and the mode of what it did not make itself;
  :func:`open_dir` those of a directory whose files are then opened through its descriptor);
* a **swap during a walk**: trees are removed through descriptors (``shutil.rmtree`` on Linux
  never follows a link it meets, even one swapped in after it looked).

Each refusal is an ``OSError`` whose ``strerror`` says what was found, for the caller to say.
"""

import errno
import fcntl
import os
import shutil
import stat

_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def open_regular(path: str, flags: int = os.O_RDONLY, dir_fd: int | None = None,
                 owners: tuple[int, ...] = ()) -> int:
    """A descriptor of the regular file at ``path`` (relative to ``dir_fd`` when given), opened
    with ``flags`` (never ``O_CREAT``: see :func:`create_new`) without following a link or
    waiting on a FIFO; ``owners``: the uids it may belong to (any when empty). OSError else."""
    if flags & os.O_CREAT:
        raise ValueError("open_regular never creates: create_new does, with O_EXCL")
    fd = os.open(path, flags | _OPEN, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        if owners and st.st_uid not in owners:
            raise OSError(errno.EPERM, f"{path} belongs to uid {st.st_uid}")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str, limit: int, dir_fd: int | None = None,
                 owners: tuple[int, ...] = ()) -> tuple[bytes, int] | None:
    """(at most ``limit`` bytes of the regular file at ``path``, the uid that owns it); None when
    there is no such file of one of ``owners`` to read (a link, a FIFO, another user's, gone)."""
    try:
        fd = open_regular(path, os.O_RDONLY, dir_fd, owners)
    except OSError:
        return None
    try:
        chunks, left = [], limit
        while left > 0:
            chunk = os.read(fd, min(left, 65536))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks), os.fstat(fd).st_uid
    except OSError:
        return None
    finally:
        os.close(fd)


def create_new(path: str, mode: int, dir_fd: int | None = None,
               flags: int = os.O_WRONLY) -> int:
    """A descriptor of a file made now at ``path`` with exactly ``mode`` (whatever the umask):
    ``O_EXCL``, so neither a planted link nor another user's file is ever opened in its place
    (FileExistsError when the name is taken)."""
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | _OPEN, mode, dir_fd=dir_fd)
    try:
        os.fchmod(fd, mode)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return fd
    except BaseException:
        os.close(fd)
        raise


def unsafe_dir(st: os.stat_result, uid: int | None = None, others: int = 0o022) -> str:
    """Why a directory with this status (``lstat``'s, or ``fstat``'s of a descriptor opened
    without following a link) is not one of ``uid``'s (default: ours) that grants others none of
    the ``others`` bits ("" when it is): **the private-directory check**, the one every caller
    uses (the heads registry, ssh's socket directory, the guard's temp dirs). ``others``: 0o022,
    others may look but not change (a run directory, a control socket's); 0o077, no access at
    all (mode 700: the message says so)."""
    uid = os.getuid() if uid is None else uid
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != uid:
        return f"belongs to uid {st.st_uid}, not to uid {uid}"
    if st.st_mode & others:
        must = "" if others == 0o022 else f"; it must be {0o777 & ~others:o}"
        return f"is open to others (mode {stat.S_IMODE(st.st_mode):o}{must})"
    return ""


def private_dir(path: str, mode: int = 0o700) -> str:
    """``path``, a directory of ours that others can neither enter nor change: made with
    ``mode`` where missing; where it exists, refused (OSError) unless it is a real directory
    (not a link) of ours with no access for others."""
    try:
        os.mkdir(path, mode)
        os.chmod(path, mode)  # (mkdir's mode passed through the umask)
    except FileExistsError:
        pass
    why = unsafe_dir(os.lstat(path), others=0o077 & ~mode | 0o022)
    if why:
        raise OSError(errno.EPERM, f"{path} {why}")
    return path


def open_dir(path: str, others: int = 0o077, follow: bool = False,
             uid: int | None = None) -> int:
    """A descriptor of the directory at ``path`` (for ``dir_fd=``: what is opened through it
    stays in the directory checked, whatever is renamed after), refused (OSError) unless it
    belongs to ``uid`` (default: ours) and grants others none of the ``others`` bits (0o077:
    no access; 0o022: they may look, not change); ``follow``: ``path`` may be a link."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        why = unsafe_dir(os.fstat(fd), uid, others | 0o022)
        if why:
            raise OSError(errno.EPERM, f"{path} {why}")
        return fd
    except BaseException:
        os.close(fd)
        raise


def remove_tree(path: str) -> None:
    """Remove ``path`` and what is in it, through descriptors: a link met inside (even one
    swapped in during the walk) is removed, never followed. What cannot be removed stays."""
    if not path:
        return
    try:
        st = os.lstat(path)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass


SAFE_RMTREE = shutil.rmtree.avoids_symlink_attacks
"""Whether :func:`remove_tree` is immune to a swap during its walk (True on Linux)."""
