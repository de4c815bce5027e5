"""``ptcluster kill``'s node program: signal the guard of one job on this node.

Standard library only (shipped like the others). It finds the job's lease (``job-ID``: its
guard holds it while the job runs there; the record names the guard's pid), leaves a note of
who asked (the guard reports it to its head as the cause), and signals the guard, which then
ends its part of the job as on any stop (the same job-scoped teardown: nothing else touched).
The kernel decides who may: only the job's user, or root; anyone else gets EPERM, said as is.
What it signals is checked first, as anything read from the shared lease directory must be: the
record is believed only as ``leases`` believes one (its file is its uid's, its pid holds the
job's lock), and the pid must be a guard of that job run by that uid (``/proc``).

  stdin  line 2  JSON config: {"job_id", "signal": "TERM" | "INT" | "KILL", "by": {host, user}}
  stdout         frames of ``node.wire``: ``hello``, then ``result {json}``
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from typing import TypedDict

from ptcluster.node.problems import Declared, Sent
from ptcluster.node.sharing.leases import RECORD_MODE, held_all, kill_note
from ptcluster.node.sharing.records import unlink, valid_job_id, write_record
from ptcluster.node.wire import Kind, encode, hello

NOT_A_JOB_ID = Declared(
    "kill.not-a-job-id", "kill asked a node with a job id that is not one",
    "{job_id} is not a job id",
    "give the id `ptcluster ps` shows (letters, digits, '.', '_', '-')")
ENDED_MEANWHILE = Declared(
    "kill.ended-meanwhile", "the job's guard ended before it was signalled",
    "its guard ended meanwhile", "none needed: the job's part on that node has ended")
NOT_YOURS = Declared(
    "kill.not-yours", "the job is another user's",
    "job {job_id} is {owner}'s: only {allowed} may end it",
    "ask {owner} to end it (`ptcluster kill` as that user), or root")
TABLE = (NOT_A_JOB_ID, ENDED_MEANWHILE, NOT_YOURS)
"""Why a node's guard of a job was not signalled (``kill.*``: the ``result`` frame's
``problem``; the head adds its own, ``control.kill.TABLE``)."""


def guard_of(pid: int, uid: int, job_id: str) -> bool:
    """Whether process ``pid`` is a guard of ``job_id`` run by ``uid``: its ``/proc`` entry
    belongs to that uid and its command line ends with the words every guard's has (``guard
    JOB_ID``: ``remote.bootstrap.node_argv``). A record names a pid; this is what keeps a
    planted or stale one from steering the signal to any other process."""
    try:
        owner = os.stat(f"/proc/{pid}").st_uid
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read(1 << 16).rstrip(b"\0").split(b"\0")
    except OSError:
        return False
    return owner == uid and argv[-2:] == [b"guard", job_id.encode()]


def _signal(pid: int, uid: int, job_id: str, signum: int) -> bool:
    """Send ``signum`` to the guard ``pid`` of ``job_id``: False (nothing sent) when it is not
    one. Through a pidfd where the kernel has them, so that the process checked is the one
    signalled (a pid freed and reused between the two is not). OSError as ``os.kill``'s."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = -1  # (an older kernel or Python: checked, then signalled by pid)
    try:
        if not guard_of(pid, uid, job_id):
            return False
        if pidfd >= 0:
            signal.pidfd_send_signal(pidfd, signum)
        else:
            os.kill(pid, signum)
        return True
    finally:
        if pidfd >= 0:
            os.close(pidfd)


class KillAnswer(TypedDict, total=False):
    """:func:`end_job`'s ``result`` frame, checked by the head as it arrives
    (``remote.node_replies.KILL``: the same keys)."""

    found: bool
    """Whether this node runs a guard of the job (its lease names one that is)."""
    pid: int
    user: str | None
    """The guard's and its user's (the lease record's)."""
    note_error: str
    """Why the note of who asked could not be written (the signal is sent all the same)."""
    signalled: bool
    error: str
    """Why it was not signalled (not a job id, another user's, ended meanwhile): its
    ``problem``'s what."""
    problem: Sent
    """The same, declared (``TABLE``: its code and fields)."""


def _not_signalled(out: KillAnswer, problem: Sent) -> KillAnswer:
    out["error"], out["problem"] = problem["what"], problem
    return out


class _Config(TypedDict):
    job_id: str


class KillConfig(_Config, total=False):
    """The program's config line (``control.kill.stop_through_guards`` writes it)."""

    signal: str
    """The signal's name without SIG (default TERM)."""
    by: dict[str, str]
    """Who asks (``{host, user}``: the guard's kill note, ``wire.KILLED_BY``)."""


def end_job(job_id: str, signame: str, by: dict) -> KillAnswer:
    if not valid_job_id(job_id):  # (kill's note is named by it, in the shared lease dir)
        return _not_signalled({"found": False}, NOT_A_JOB_ID.sent(job_id=repr(job_id[:80])))
    here = socket.gethostname()  # (a lock directory may be shared with other nodes)
    guards = [r for r in held_all() if r.get("resource") == f"job-{job_id}"
              and r.get("job_id") == job_id and r.get("node") == here
              and guard_of(r["pid"], r["uid"], job_id)]
    if not guards:
        return {"found": False}
    record = guards[0]
    out: KillAnswer = {"found": True, "pid": record["pid"], "user": record.get("user")}
    try:  # the note first: the guard reads it when the signal arrives
        write_record(kill_note(job_id, uid=os.getuid()), {**by, "t": time.time()}, RECORD_MODE)
    except OSError as exc:
        out["note_error"] = str(exc)
    try:
        out["signalled"] = _signal(record["pid"], record["uid"], job_id,
                                   getattr(signal, "SIG" + signame))
        if not out["signalled"]:
            _not_signalled(out, ENDED_MEANWHILE.sent())
    except PermissionError:
        out["signalled"] = False
        owner = record.get("user") or "?"
        _not_signalled(out, NOT_YOURS.sent(job_id=job_id, owner=owner, allowed=owner + (
            "" if owner == "root" else " or root")))
    except ProcessLookupError:
        out["signalled"] = False
        _not_signalled(out, ENDED_MEANWHILE.sent())
    if not out["signalled"]:
        unlink(kill_note(job_id, uid=os.getuid()))
    return out


def main() -> int:
    cfg: KillConfig = json.loads(sys.stdin.readline())
    sys.stdout.buffer.write(hello("kill"))
    result = end_job(str(cfg["job_id"]), str(cfg.get("signal") or "TERM"),
                     dict(cfg.get("by") or {}))
    sys.stdout.buffer.write(encode(Kind.RESULT, result))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
