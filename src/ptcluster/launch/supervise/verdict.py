"""How the supervisor judges and words what went wrong: pure functions, no state of their own.

A rank that ended is judged from what the kernel and the rank itself said: its record (exit
status, when it ended), what its code raised (the shim's ``error`` record), whether its program
had returned, and when its node was told to stop. The failures of nodes and of the job (not
ready, silent, stopped by itself, hung, timed out, a rendezvous on the wrong node) are worded
here too, each with its fix; and the notes a node's ready facts call for (``ready_notes``)."""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ptcluster.errors import Problem, some
from ptcluster.launch.plan import LaunchPlan
from ptcluster.launch.result import Failure, FailureKind, RankRecord, signame
from ptcluster.launch.supervise.events import MALFORMED_FRAME
from ptcluster.launch.supervise.known import Known, RankReport, match_rank
from ptcluster.launch.supervise.machine_view import disk_named, oom_named, xid_named
from ptcluster.node import wire
from ptcluster.node.problems import Declared

CRASH_SIGNALS = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS)
"""How a process's own code dies: after its program returned, that is a library's teardown."""
SHUTDOWN_FIX = ("a library crashed while Python tore the process down: with gloo, work objects "
                "freed during interpreter finalization can abort it (pytorch PR 179291). End "
                "the script with dist.destroy_process_group(), then flush and os._exit(code), "
                "as `python -m ptcluster.examples.mnist` does")

NOT_READY = Declared(
    "run.not-ready", "a node was not ready in time", "not ready after {timeout} s",
    "check that the node is reachable and not overloaded (`ptcluster doctor`)")
TIMED_OUT = Declared(
    "run.timed-out", "the job's deadline passed",
    "timed out after {deadline} s; ranks still running: {ranks}",
    "a collective hung or a rank is stuck: check the ports and interface findings of "
    "`ptcluster doctor`")
GUARD_STOPPED = Declared(
    "run.guard-stopped", "a node's guard ended the job on its own",
    "its guard ended the job on its own: {reason}",
    "see the node log; a guard that no longer hears the head means the network or the head "
    "stalled")
GUARD_SIGNALLED = Declared(
    "run.guard-signalled", "a node's guard was signalled",
    "its guard ended the job on its own: {reason}",
    "something on that node signalled it (a scheduler's cancel or time limit, an "
    "administrator, a shutdown): see the node log")
NODE_SILENT = Declared(
    "run.node-silent", "a node fell silent",
    "node lost: nothing heard for {silent} s (link down or node dead)",
    "check the node's network and power; `ptcluster doctor`")
HUNG = Declared(
    "run.hung", "no rank made progress", "hang: no rank made progress for {timeout} s; {headline}",
    "see the stacks report in the run directory (the straggler first)")
MASTER_ELSEWHERE = Declared(
    "run.master-elsewhere", "the rendezvous address is another node's",
    "the rendezvous address {addr} is {node}'s {what}, but the rendezvous runs on the first "
    "node (node rank 0: {first})",
    "set master.addr to {first}'s address, or move {node} to the top of `nodes`")
TORCHRUN_EXITED = Declared(
    "run.torchrun-exited", "torchrun failed on a node",
    "torchrun exited with code {code} ({error})",
    "see the node log in the run directory")
TABLE = (NOT_READY, TIMED_OUT, GUARD_STOPPED, GUARD_SIGNALLED, NODE_SILENT, HUNG,
         MASTER_ELSEWHERE, TORCHRUN_EXITED, MALFORMED_FRAME)
"""What ``run`` declares (``run.*`` codes): the failures of nodes and of the job the supervisor
words, the head's own refusal to start (``rundir``'s) and its warning of NCCL on sockets
(``nccl_report``'s); a rank's own failure is the rank's words, or a known failure
(``known.py``)."""


@dataclass(frozen=True)
class Raised:
    """An exception left the rank's code (its own report)."""

    at: float
    """When (the head's corrected clock)."""
    text: str
    exit_call: bool = False
    """It was ``sys.exit(N)``: the exit code says it all."""
    exc: str = ""
    """The exception's type name (``SystemExit`` for ``sys.exit(N)``)."""
    errno: int | None = None
    """The errno of the first ``OSError`` in its chain, where one is."""
    disk: wire.DiskFacts | None = None
    """The filesystem its guard found full (ENOSPC, EDQUOT)."""
    usage: str = ""
    """What ``argparse`` exited with (its message), when the parser ended the rank."""
    declared: Problem | None = None
    """The error as its declared problem, where the node said it (its code, fields, fix)."""

    def report(self) -> RankReport:
        """As the known-failures table reads it."""
        return RankReport(self.exc, self.text, self.errno, self.usage)


@dataclass(frozen=True)
class RankVerdict:
    """What a rank's end means (``judge_rank``)."""

    stopped: bool
    """Ended by our own teardown (not a failure); the fields below are then unused."""
    at: float = 0.0
    message: str = ""
    fix: str | None = None
    known: Known | None = None
    """The known failure it is (``launch.supervise.known``): its fix is ``fix``."""
    kind: FailureKind = FailureKind.RANK
    facts: dict[str, Any] = field(default_factory=dict)
    """What the node saw of it (``Failure.facts``)."""
    declared: Problem | None = None
    """What the machine saw, as its declared problem (``machine_view``: its code and fields;
    ``message`` and ``fix`` are its what and fix); None for the rank's own words."""


def judge_rank(record: RankRecord, raised: Raised | None, returned: bool,
               stop_at: float | None, oom: wire.OomFacts | None = None,
               xids: Sequence[wire.XidFacts] = ()) -> RankVerdict | None:
    """None while there is nothing to judge (the rank succeeded, or has not ended). ``oom``:
    the kernel's OOM kills its guard found when it ended; ``xids``: the GPU driver's errors of
    its processes or GPUs; what the machine saw comes first."""
    if record.exit_code == 0 or record.ended_at is None:
        return None
    failed_at = record.ended_at if raised is None else min(raised.at, record.ended_at)
    if stop_at is not None and failed_at >= stop_at:
        return RankVerdict(stopped=True)
    code = record.exit_code
    message = ("ended without an exit status (its process was killed)" if code is None
               else f"killed by {signame(-code)}" if code < 0
               else f"exited with code {code}")
    fix = None
    text = raised.text if raised is not None else ""
    # A rank the teardown ended was signalled; one that exited with its own code did not hang:
    # it exited a moment after another rank's failure had started the teardown.
    killed = code is None or code < 0
    facts: dict[str, Any] = {}
    if text and stop_at is not None and record.ended_at >= stop_at and killed:
        message = f"{text}, then it hung until the teardown ended it ({message})"
        facts["hung_after"] = text  # (summary.json's: what it raised before it hung)
    elif text and raised is not None and not raised.exit_call:
        message += f" ({text})"
    elif raised is not None and raised.usage:  # the script's own parser ended it
        message += f" (argparse: {raised.usage})"
    elif returned and code is not None and -code in CRASH_SIGNALS:
        # (a SIGKILL or SIGTERM then is someone else's doing: named as it is)
        message += " after its program had returned, in the interpreter's shutdown"
        fix = SHUTDOWN_FIX
    named = (oom_named(record.host, code, oom, text) if oom else None) or \
        (xid_named(record.host, message, xids) if xids else None) or \
        (disk_named(record.host, raised.errno, raised.disk, text) if raised else None)
    if named is not None:
        return RankVerdict(stopped=False, at=failed_at, message=named.message, fix=named.fix,
                           kind=FailureKind(named.kind), facts=named.facts,
                           declared=named.problem)
    known = None if raised is None else match_rank(raised.report())
    if known is not None:
        fix = known.fix
    declared = None if raised is None else raised.declared
    if declared is not None:  # (its code and fields; the message says it as above)
        fix = fix or declared.fix
    return RankVerdict(stopped=False, at=failed_at, message=message, fix=fix, known=known,
                       declared=declared, facts=facts)


def not_ready(hosts: Sequence[str], timeout: float, at: float) -> Failure:
    return Failure(host=some(list(hosts)), rank=None, kind=FailureKind.START, at=at,
                   problem=Problem.of(NOT_READY, None, timeout=f"{timeout:.0f}"))


def timed_out(running: Sequence[RankRecord], first_host: str, deadline: float | None,
              at: float) -> Failure:
    hosts = sorted({r.host for r in running}) or [first_host]
    ranks = some([str(r.rank) for r in running], 8) or "none"
    return Failure(host=some(hosts), rank=None, at=at, kind=FailureKind.TIMEOUT,
                   problem=Problem.of(TIMED_OUT, None, deadline=f"{deadline or 0:.0f}",
                                      ranks=ranks))


def guard_stopped(host: str, reason: str, signalled: bool, at: float) -> Failure:
    """The node's guard ended the job on its own (signalled, or the head unheard)."""
    entry = GUARD_SIGNALLED if signalled else GUARD_STOPPED
    return Failure(host=host, rank=None, at=at, kind=FailureKind.LOST,
                   problem=Problem.of(entry, None, reason=reason))


def node_silent(host: str, silent: float, at: float) -> Failure:
    return Failure(host=host, rank=None, at=at, kind=FailureKind.LOST,
                   problem=Problem.of(NODE_SILENT, None, silent=f"{silent:.0f}"))


def hung(host: str, rank: int | None, headline: str, timeout: float, at: float) -> Failure:
    return Failure(host=host, rank=rank, kind=FailureKind.HANG, at=at,
                   problem=Problem.of(HUNG, None, timeout=f"{timeout:.0f}", headline=headline))


def master_elsewhere(plan: LaunchPlan, facts: Mapping[str, wire.ReadyFacts],
                     at: float) -> Failure | None:
    """The rendezvous address is another node's (its address or hostname as its guard
    reported them): node rank 0 would host a store nobody reaches, and every rank would
    wait out the rendezvous timeout. Caught before any rank starts."""
    addr = plan.master_addr.lower()
    first = plan.nodes[0].host
    for node in plan.nodes[1:]:
        said = facts[node.host]
        for what, value in (("address", said.get("address")), ("hostname", said.get("hostname"))):
            if str(value or "").lower() == addr:
                return Failure(host=first, rank=None, kind=FailureKind.GUARD, at=at,
                               problem=Problem.of(MASTER_ELSEWHERE, None,
                                                  addr=plan.master_addr, node=node.host,
                                                  what=what, first=first))
    return None


def ready_notes(host: str, facts: wire.ReadyFacts) -> list[str]:
    """What the user is told of a node's ready facts: sockets on an interface the cluster file
    did not name, leases off, the GPUs chosen and why, no subreaper."""
    notes = []
    source = facts.get("interface_source")
    if source and source != "cluster file":
        notes.append(f"{host}: sockets on {facts.get('interface') or '?'} ({source})")
    if facts.get("leases_off"):
        notes.append(f"{host}: no leases ({facts.get('leases_off')})")
    chosen = facts.get("gpus")
    if chosen:
        notes.append(f"{host}: GPUs {chosen.get('visible') or 'none'}: {chosen.get('why')}")
    if facts.get("subreaper") is False:
        notes.append(f"{host}: cannot become a subreaper ({facts.get('subreaper_error')}); "
                     "orphans of the job may escape teardown")
    return notes
