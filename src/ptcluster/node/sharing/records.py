"""A directory of small JSON records, each naming a live process: how they are written, read,
removed and told stale, for the node's lease records (``node.sharing.leases``, in a shared sticky
directory every user writes in) and the head's registry of running heads (``control.registry``,
a directory of the user's own).

Standard library only: a part of every node program that leases (shipped by
``remote.bootstrap``), and imported as a module on the head. What makes a record safe where
others may plant files: it is written under a new name (``O_EXCL``, never through a planted link)
and renamed over whatever had its name; it is read without following a link, only from a regular
file (a planted FIFO or device is not opened for reading and waited on), with its owner's uid for
the reader to judge. Which directory is trusted, and which owners, stays with each user of this.
"""

import json
import math
import os
import re
from collections.abc import Mapping
from typing import TypeGuard

from ptcluster.node.sharing.safefile import create_new, read_regular
from ptcluster.node.wire import LeaseRecord

JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""What a job id is, everywhere one becomes a path (a lease's or a kill note's name, a run
directory, a registry entry, a guard's temp dir): no separator, no leading dot, no control
character (``re.fullmatch``: a trailing newline does not pass)."""


def valid_job_id(job_id: object) -> bool:
    """Whether ``job_id`` can name an entry: the one check of a job id, head and node (L5)."""
    return isinstance(job_id, str) and JOB_ID.fullmatch(job_id) is not None


def write_record(path: str, record: Mapping[str, object], mode: int, dir_fd: int | None = None,
                 tmp: str = "") -> None:
    """``record`` as ``path`` (relative to ``dir_fd`` when given), with ``mode`` whatever the
    umask: written to ``tmp`` (default ``PATH.PID.tmp``; ``O_EXCL | O_NOFOLLOW``) and renamed
    over ``path``. OSError when it cannot be (``tmp`` removed)."""
    tmp = tmp or f"{path}.{os.getpid()}.tmp"
    try:
        with os.fdopen(create_new(tmp, mode, dir_fd), "w") as f:
            json.dump(record, f)
        os.rename(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError:
        unlink(tmp, dir_fd)
        raise


def read_record(path: str, dir_fd: int | None = None, limit: int = 65536,
                owners: tuple[int, ...] = ()) -> tuple[object, int] | None:
    """(the JSON value of the record at ``path``, the uid that owns the file); None when it is
    not a regular file (of one of ``owners``, when given), cannot be opened without following a
    link, or does not parse within ``limit`` bytes."""
    got = read_regular(path, limit, dir_fd, owners)
    if got is None:
        return None
    try:
        return json.loads(got[0]), got[1]
    except ValueError:
        return None


def unlink(path: str, dir_fd: int | None = None) -> None:
    """Remove ``path`` if it can be (gone already, or not ours to remove: left)."""
    try:
        os.unlink(path, dir_fd=dir_fd)
    except OSError:
        pass


def alive(pid: object) -> bool:
    """Whether the process a record names runs (another user's counts: it cannot be signalled,
    but it is there)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 2 ** 31:
        return False  # (a huge one would be an OverflowError, not a "no")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)


_TEXT = ("job_id", "user", "command", "node", "resource", "head")
MOST_TEXT = 256
"""Longest text of a record that is believed (each is a label of ``monitor --serve``)."""
MAX_LEASES = 4096
"""Most lease records a sampler sends (``held_all``'s first ones): the head refuses more."""
MOST_KEYS = 32


def well_formed(record: object) -> TypeGuard[LeaseRecord]:
    """Whether ``record`` is a lease record every reader can use as is: a dict with a pid and a
    uid that are plausible ints, a finite ``since`` (seconds since 1970, before 2242), text
    where text belongs and ``ranks`` as ``[first, last]``; every key a printable label, every
    value text of at most :data:`MOST_TEXT`, a bounded number, true/false or null (what the
    head takes in a sample: ``remote.replies.sample_reply``). Anything else is skipped, never
    turned into an exception (``ps``, ``kill``, the monitor and a busy refusal read them)."""
    if not isinstance(record, dict) or len(record) > MOST_KEYS:
        return False
    pid, uid, since, ranks = (record.get(k) for k in ("pid", "uid", "since", "ranks"))
    return (isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 2 ** 31
            and isinstance(uid, int) and not isinstance(uid, bool) and 0 <= uid < 2 ** 32
            and _number(since) and 0 <= float(since or 0) < 2 ** 33
            and all(isinstance(record.get(k), str) and len(record[k]) <= MOST_TEXT
                    for k in _TEXT if record.get(k) is not None)
            and all(_key(k) and (isinstance(v, str) and len(v) <= MOST_TEXT or v is None
                                 or isinstance(v, bool) or _number(v) and abs(v) < 2 ** 62
                                 or k == "ranks") for k, v in record.items())
            and (record.get("job_id") is None or valid_job_id(record["job_id"]))
            and (ranks is None or (isinstance(ranks, list) and len(ranks) == 2 and all(
                isinstance(r, int) and not isinstance(r, bool) and abs(r) < 2 ** 31
                for r in ranks))))


UNKNOWN_KEYS = frozenset({"resource", "node", "unknown"})
"""A held lease with no record believed (``leases.held_all(unknown=True)``): only these."""


def sampled(record: object) -> TypeGuard[LeaseRecord]:
    """Whether ``record`` is a lease as a sampler sends it and the head takes it in a sample
    (``remote.replies.sample_reply``): one rule for both sides. A :func:`well_formed` record,
    or a lease held with no record believed (a planted lock entry): ``{resource, node,
    unknown: true}``, its texts of at most :data:`MOST_TEXT`."""
    if isinstance(record, dict) and record.get("unknown") is True:
        return set(record) == UNKNOWN_KEYS and all(
            isinstance(record[k], str) and len(record[k]) <= MOST_TEXT
            for k in ("resource", "node"))
    return well_formed(record)


def lease_of(record: LeaseRecord) -> tuple[str, str]:
    """What a lease record holds, read one way for every reader (the sampler, ``ps``, the
    monitor, the metrics): ``("job", "")``, ``("gpu", "3")``, ``("port", "29500")``; a
    kind not named here is returned as it is, for the reader to skip."""
    kind, _, value = str(record.get("resource") or "").partition("-")
    return kind, value


def rank_count(record: LeaseRecord) -> int:
    """The ranks a job lease's ``ranks`` (``[first, last]``) says it runs on its node (0 when
    it says none). ``record`` is :func:`well_formed` (every reader's records are)."""
    ranks = record.get("ranks")
    return max(ranks[1] - ranks[0] + 1, 0) if ranks else 0


def _key(key: object) -> bool:
    """A record's key: a label's text (what ``monitor --serve``'s head accepts)."""
    return isinstance(key, str) and 0 < len(key) <= MOST_TEXT and key.isprintable()
