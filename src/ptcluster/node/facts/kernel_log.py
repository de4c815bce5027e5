"""The kernel's log, where this user may read it: ``/dev/kmsg`` (root: ``kernel.dmesg_restrict``
is 1 on Ubuntu since 20.10) or ``journalctl -k`` (groups adm, systemd-journal, wheel:
journalctl(1)). Each record comes as ``(seconds since boot, text)``: the kernel stamps records
with its monotonic clock, immune to the wall clock's steps (``boot_wall`` turns it into a time).

Only the kernel's own records are read: facility ``kern`` (kmsg's ``PRI`` >> 3 == 0; the
journal's ``SYSLOG_FACILITY``). Lines written into ``/dev/kmsg`` from user space carry another
(the kernel makes ``kern`` ``user``), and journald may forward any user's messages there. The
project's tests, on machines without a GPU, write the driver's lines that way as root: their
guards set ``TEST_USER_LINES`` (read from the guard's own environment, which only its user
sets) to read those too.

Standard library only; a part of the guard and of the doctor's facts program.
"""

from __future__ import annotations

import grp
import json
import os
import re
import shutil
import subprocess
import time

LOG_GROUPS = ("adm", "systemd-journal", "wheel")
"""Groups whose members may read the kernel's log through ``journalctl -k`` (journalctl(1))."""
LOG_JOURNAL_TIMEOUT = 5.0
"""Seconds a ``journalctl`` read may take."""
LOG_KMSG = "/dev/kmsg"
LOG_JOURNAL = "journalctl -k"

KERN = 0
"""The kernel's facility (syslog's ``LOG_KERN``)."""
TEST_USER_LINES = "PTCLUSTER_TEST_KMSG_USER_LINES"
"""Set to 1 by the tests alone: records of the ``user`` facility are read as the kernel's."""


def facilities() -> tuple[int, ...]:
    """The facilities whose records are the kernel's word here."""
    return (KERN, 1) if os.environ.get(TEST_USER_LINES) == "1" else (KERN,)


LogRecord = tuple[float, str]
"""One line of the log: (seconds since boot, its text)."""


def log_source() -> str:
    """Where this process can read the kernel's log: ``LOG_KMSG``, ``LOG_JOURNAL``, or ""."""
    fd = open_kmsg(at_end=True)
    if fd is not None:
        os.close(fd)
        return LOG_KMSG
    return LOG_JOURNAL if journal_readable() else ""


def open_kmsg(at_end: bool) -> int | None:
    """``/dev/kmsg``, not blocking, at its end (``at_end``: only records written from now on) or
    at its oldest record; None where the kernel refuses (``kernel.dmesg_restrict``: root only)."""
    try:
        fd = os.open(LOG_KMSG, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    if at_end:
        try:
            os.lseek(fd, 0, os.SEEK_END)
        except OSError:
            os.close(fd)
            return None
    return fd


def read_kmsg(fd: int) -> list[LogRecord]:
    """The kernel's records waiting (``prio,seq,usec,flags;text``, /dev/kmsg's format; the
    others skipped: ``facilities``)."""
    out = []
    allowed = facilities()
    for _ in range(100000):
        try:
            record = os.read(fd, 8192)
        except BlockingIOError:
            break
        except BrokenPipeError:  # records overwritten before we read them: go on
            continue
        except OSError:
            break
        if not record:
            break
        head, _, text = record.decode(errors="replace").partition(";")
        fields = head.split(",")
        try:
            usec, facility = int(fields[2]), int(fields[0]) >> 3
        except (IndexError, ValueError):
            continue
        if facility in allowed:
            out.append((usec / 1e6, text.split("\n", 1)[0]))
    return out


def journal_readable() -> bool:
    """Whether ``journalctl -k`` shows this user the kernel's lines."""
    if shutil.which("journalctl") is None:
        return False
    if os.geteuid() == 0:
        return True
    names = set()
    for gid in os.getgroups():
        try:
            names.add(grp.getgrgid(gid).gr_name)
        except KeyError:
            continue
    return bool(names & set(LOG_GROUPS))


def read_journal(since: float | None = None) -> list[LogRecord]:
    """This boot's kernel lines from the journal (those since the wall time ``since``, where
    given), as JSON: the record's own monotonic stamp (``_SOURCE_MONOTONIC_TIMESTAMP``, µs)."""
    argv = ["journalctl", "-k", "-b", "0", "-q", "--no-pager", "-o", "json",
            "--output-fields=MESSAGE,_SOURCE_MONOTONIC_TIMESTAMP,SYSLOG_FACILITY"]
    if since is not None:
        argv.append(f"--since=@{int(since) - 1}")
    try:
        run = subprocess.run(argv, capture_output=True, timeout=LOG_JOURNAL_TIMEOUT,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return []
    out, allowed = [], facilities()
    for line in run.stdout.decode(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        text = entry.get("MESSAGE") if isinstance(entry, dict) else None
        if not isinstance(text, str):  # (a list of bytes where it was not UTF-8)
            continue
        if str(entry.get("SYSLOG_FACILITY", KERN)) not in {str(f) for f in allowed}:
            continue  # (user space's line forwarded into the kernel's log)
        stamp = entry.get("_SOURCE_MONOTONIC_TIMESTAMP") or entry.get("__MONOTONIC_TIMESTAMP")
        try:
            at = int(stamp) / 1e6
        except (TypeError, ValueError):
            at = 0.0
        out.append((at, text))
    return out


OOMD_KILL = re.compile(r"(?:Killed|Marked) (/\S*) (?:for killing )?due to (.+)")
"""systemd-oomd's line for a control group it kills (src/oom/oomd-manager.c: ``Killed %s due to
memory pressure for %s being …`` up to systemd 255, ``Marked %s for killing due to …`` since;
the swap rule's lines alike): it kills whole groups from user space, and the kernel logs
nothing of it."""


def oomd_kills(since: float) -> list[tuple[str, str]]:
    """systemd-oomd's kills since the wall time ``since``: (the control group, why), from its
    journal (``journalctl -u systemd-oomd``: readable by the same groups as the kernel's)."""
    try:
        run = subprocess.run(["journalctl", "-u", "systemd-oomd", "-q", "--no-pager", "-o",
                              "cat", f"--since=@{int(since) - 1}"], capture_output=True,
                             timeout=LOG_JOURNAL_TIMEOUT, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return []
    return oomd_lines(run.stdout.decode(errors="replace").splitlines())


def oomd_lines(lines: list[str]) -> list[tuple[str, str]]:
    """The (control group, why) of each of systemd-oomd's kill lines among ``lines``."""
    out = []
    for line in lines:
        m = OOMD_KILL.match(line)  # (at the start: a control group's name is free text)
        if m is not None:
            out.append((m.group(1), m.group(2).strip()))
    return out


def within(group: str, killed: str) -> bool:
    """Whether control group ``group`` is ``killed`` or below it (oomd kills a whole subtree)."""
    killed = killed.rstrip("/") or "/"
    return group == killed or group.startswith(killed + "/") or killed == "/"


def kernel_since_boot() -> tuple[list[LogRecord], str]:
    """Every record of this boot the log still holds, and where they were read ("" with no
    records: the log is not readable here)."""
    fd = open_kmsg(at_end=False)
    if fd is not None:
        try:
            return read_kmsg(fd), LOG_KMSG
        finally:
            os.close(fd)
    if journal_readable():
        return read_journal(), LOG_JOURNAL
    return [], ""


def boot_wall() -> float:
    """The wall time this node booted (now less its uptime): a record's time is this plus its
    stamp."""
    try:
        with open("/proc/uptime") as f:
            return time.time() - float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
