"""What a node's guard says, as typed events: the only place that knows the guard's frames.

``decode(host, line)`` is pure (table-tested on recorded frames); a frame that does not decode
becomes :class:`Malformed` (shown and logged as a node line), never an exception in a reader.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ptcluster.errors import Problem
from ptcluster.launch.result import Failure, FailureKind
from ptcluster.node import wire
from ptcluster.node.problems import CODE, Declared
from ptcluster.remote import guard_replies


@dataclass(frozen=True)
class Hello:
    host: str
    version: int
    pid: int
    node_time: float


@dataclass(frozen=True)
class Ready:
    host: str
    facts: wire.ReadyFacts


@dataclass(frozen=True)
class GuardRefused:
    """The guard could not do its part (the node's ``error {problem, fix}``: a missing workdir,
    a taken port, ...); on the node it is the guard's ``GuardError`` exception. Its problem's
    who is the node; the frame's empty fix is no fix (None)."""

    host: str
    problem: Problem
    busy: bool = False
    """Only because another job holds what this one asks for (it may wait for it)."""
    unhealthy: bool = False
    """By the node's health gate (``node.facts.health``): a restart leaves the node out."""
    environment: str = ""
    """``missing`` or ``changed`` (``wire.ENV_NOT_READY``): only because the project's
    environment the head expected is not ready there (the runner ships it and tries again)."""


@dataclass(frozen=True)
class Started:
    """torchrun is running on the node (its pid there, for the summary and a human)."""

    host: str
    pid: int
    warm: bool = False
    """Its ranks were forked from a warm pool (``run --warm``, or the job's own pool on a
    restart), not started by torchrun."""


@dataclass(frozen=True)
class Heartbeat:
    host: str
    node_time: float | None = None
    idle: dict[int, float] | None = None
    """Per running rank of the node: seconds since it last made progress (output, CPU, a
    completed collective); None when the guard had nothing to say (no rank running)."""


@dataclass(frozen=True)
class Timing:
    """A guard's straggler figures (``wire.Kind.TIMING``): per rank its main thread's ``{span, run,
    delay, collectives}`` since the guard's last frame; the node's ``{mem_available,
    gpu_util, cpu_throttled}`` (``node.guard.schedstat``)."""

    host: str
    ranks: dict[int, wire.RankTiming]
    node: wire.NodeTiming


@dataclass(frozen=True)
class StacksReply:
    """Every rank's stacks on one node (raw: ``launch.stacks`` parses them)."""

    host: str
    id: int | None
    ranks: dict[int, dict[str, Any]]


@dataclass(frozen=True)
class GuardStopping:
    """The guard is ending its part of the job on its own (signalled, head unheard)."""

    host: str
    reason: str
    node_time: float
    signal: str = ""
    """The signal that stopped the guard ("SIGTERM"), when one did."""
    killed_by: str = ""
    """``ended by `ptcluster kill` from HOST (user)``, when that was the signal."""


@dataclass(frozen=True)
class RankStart:
    host: str
    rank: int
    pid: int
    node_time: float
    python: str = ""
    """The rank's interpreter (its ``sys.executable``)."""


@dataclass(frozen=True)
class RankExit:
    host: str
    rank: int
    code: int | None
    """Wait status as Popen gives it (negative: killed by that signal); None: no record."""
    node_time: float
    duration: float | None
    oom: wire.OomFacts | None = None
    """The kernel's OOM kills its guard found when it failed (None: no count rose)."""
    xids: tuple[wire.XidFacts, ...] = ()
    """The GPU driver's Xids of its processes or its node's job GPUs, when it failed."""


@dataclass(frozen=True)
class GpuError:
    """The GPU driver wrote an Xid on the node while the job ran (``wire.Kind.XID``)."""

    host: str
    xid: wire.XidFacts


@dataclass(frozen=True)
class RankError:
    """An exception left the rank's code (reported by the rank, before its exit)."""

    host: str
    rank: int
    node_time: float
    text: str
    exc: str = ""
    """The exception's type name (``SystemExit`` for a non-zero ``sys.exit``); "" if unknown."""
    errno: int | None = None
    """The errno of the first ``OSError`` in its chain, where one is."""
    filename: str = ""
    disk: wire.DiskFacts | None = None
    """The filesystem it could not write to, as its guard saw it (ENOSPC, EDQUOT)."""
    usage: str = ""
    """``argparse``'s message, when the parser ended the rank (``sys.exit(2)``)."""
    declared: Problem | None = None
    """The error as its declared problem, where the guard said it (``text`` is its what: a
    warm pool's rank the pool failed, ``node.guard.warm_ranks.TABLE``)."""


@dataclass(frozen=True)
class RankData:
    host: str
    rank: int
    data: dict[str, Any]


@dataclass(frozen=True)
class RankOutput:
    host: str
    rank: int
    stream: str
    """"out" or "err"."""
    text: str


@dataclass(frozen=True)
class AgentOutput:
    """A line of the node's own processes: torchrun's agent, or ssh/the node on stderr."""

    host: str
    text: str
    stream: str = "agent"


@dataclass(frozen=True)
class GuardExit:
    host: str
    code: int
    reason: str
    error: str = ""
    """What ended torchrun itself, ``TYPE: TEXT`` (its error file), when the guard has it."""
    nccl: wire.NcclChoice | None = None
    """What NCCL chose on the node, read from its own log (``node.facts.nccl_log``): transport,
    HCAs, GID index; and the likely cause when it used sockets though the node has HCAs."""
    kept_pool: bool = False
    """The guard handed the job's warm pool on to the next attempt (restarts left)."""


@dataclass(frozen=True)
class Malformed:
    host: str
    line: str
    error: str
    kind: str = ""
    """The frame's kind when it is one the head reads (a malformed one is the node's failure);
    "" for a line that is no frame of a known kind (shown as the node's line)."""


@dataclass(frozen=True)
class ChannelClosed:
    """Both streams of the node's channel ended and its process was reaped."""

    host: str
    exit_code: int | None
    stderr: list[str] = field(default_factory=list)
    cause: Problem | None = None
    """What the connector makes of the channel's end (``remote.transport.
    explain_channel_failure``), or why it could not even start (its who: None)."""


Event = (Hello | Ready | GuardRefused | Started | Heartbeat | GuardStopping | RankStart | RankExit
         | RankError | RankData | RankOutput | AgentOutput | GuardExit | Malformed | ChannelClosed
         | StacksReply | Timing | GpuError)


def decode(host: str, line: str) -> Event:
    """One frame of the guard's stdout as an event."""
    kind, payload = wire.split(line)
    try:
        if kind in (wire.Kind.OUT, wire.Kind.ERR):
            rank, _, text = payload.partition(" ")
            return RankOutput(host, rank_key(rank), "out" if kind == wire.Kind.OUT else "err", text)
        if kind == wire.Kind.AGENT:
            return AgentOutput(host, payload)
        body = wire.control(payload)
        return _control(host, kind, body)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        known = kind in KNOWN and not isinstance(exc, UnknownKind)
        return Malformed(host, line[:MOST_TEXT], f"{type(exc).__name__}: {str(exc)[:200]}",
                         kind if known else "")


class UnknownKind(ValueError):
    """A frame of a kind the head does not read."""


KNOWN = frozenset(vars(wire.Kind)[k] for k in vars(wire.Kind) if k.isupper())
"""Every frame kind of the wire protocol."""
MOST_TEXT = 1 << 16
"""Longest text field of a control frame the head keeps (a traceback's last lines)."""
MOST_RANK = 1 << 24


def bounded(value: Any, low: int, high: int, what: str) -> int:
    """``value`` as an int in ``[low, high]`` (pure; a bool or a float is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{what} {str(value)[:40]!r} is not a whole number from {low} to {high}")
    return value


def rank_of(value: Any) -> int:
    """A rank number: a JSON int in ``[0, MOST_RANK]``."""
    return bounded(value, 0, MOST_RANK, "rank")


def rank_key(text: str) -> int:
    """A rank number written as text (a table's key, a text frame's field): ASCII digits."""
    return rank_of(int(text) if text.isascii() and text.isdigit() and len(text) < 12 else None)


def moment(value: Any, what: str = "t") -> float:
    """A finite time or duration (an int or a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not -1e12 < value < 1e12:  # (NaN and inf fail too)
        raise ValueError(f"{what} {str(value)[:40]!r} is not a finite number")
    return float(value)


def said(value: Any, what: str) -> str:
    """A text field: a string of at most :data:`MOST_TEXT` characters (None: "")."""
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > MOST_TEXT:
        raise ValueError(f"{what} is not text of at most {MOST_TEXT} characters")
    return value


def code_of(value: Any) -> str | None:
    """A declared problem's code as a node sends it (``guard.port-in-use``); None for none."""
    if value is None:
        return None
    if not isinstance(value, str) or not CODE.match(value):
        raise ValueError(f"code {str(value)[:40]!r} is not a problem's code")
    return value


def values_of(value: Any) -> tuple[tuple[str, str], ...]:
    """The named values a node filled its refusal's text with: a table of short strings."""
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > 16:
        raise ValueError("fields are not a table of at most 16")
    return tuple((said(k, "field"), said(v, "field")) for k, v in value.items())


def env_not_ready(value: Any) -> str:
    """A guard's ``error {environment}``: "" (none) or one of ``wire.ENV_NOT_READY``."""
    if value in (None, ""):
        return ""
    if value not in wire.ENV_NOT_READY:
        raise ValueError(f"environment {str(value)[:40]!r} is not one of "
                         f"{', '.join(wire.ENV_NOT_READY)}")
    return str(value)


def _declared(body: dict[str, Any]) -> Problem | None:
    """A rank error's declared problem (its ``code``, ``fix`` and ``fields``), or None."""
    code = code_of(body.get("code"))
    if code is None:
        return None
    return Problem(None, said(body.get("text"), "text"), said(body.get("fix"), "fix") or None,
                   code, values_of(body.get("fields")))


def pid_of(value: Any) -> int:
    return bounded(value, 1, 1 << 31, "pid")


def _control(host: str, kind: str, body: dict[str, Any]) -> Event:
    if kind == wire.Kind.HB:
        idle = body.get("idle")
        return Heartbeat(host, _opt_float(body.get("t")), None if idle is None else
                         {rank_key(r): moment(s, "idle") for r, s in idle.items()})
    if kind == wire.Kind.TIMING:
        ranks, node = guard_replies.timing(body.get("ranks") or {}, body.get("node") or {})
        return Timing(host, {rank_key(r): v for r, v in ranks.items()}, node)
    if kind == wire.Kind.STACKS:
        ident = body.get("id")
        return StacksReply(host, None if ident is None else int(ident),
                           {rank_key(r): dict(v) for r, v in (body.get("ranks") or {}).items()})
    if kind == wire.Kind.RERROR:
        num = body.get("errno")
        return RankError(host, rank_of(body["rank"]), moment(body["t"]),
                         said(body.get("text"), "text"), said(body.get("exc"), "exc"),
                         None if num is None else bounded(num, 0, 1 << 16, "errno"),
                         said(body.get("filename"), "filename"),
                         guard_replies.disk_facts(body["disk"]) if body.get("disk") else None,
                         said(body.get("usage"), "usage"), _declared(body))
    if kind == wire.Kind.STOPPING:
        signal = str(body.get("signal") or "")
        return GuardStopping(host, said(body.get("reason"), "reason"), moment(body["t"]), signal,
                             killed_by(str(body.get("killed_by") or "")) if signal else "")
    if kind == wire.Kind.RSTART:
        return RankStart(host, rank_of(body["rank"]), pid_of(body["pid"]), moment(body["t"]),
                         said(body.get("python"), "python"))
    if kind == wire.Kind.REXIT:
        code = body.get("code")
        return RankExit(host, rank_of(body["rank"]),
                        None if code is None else bounded(code, -(1 << 31), 1 << 31, "code"),
                        moment(body["t"]), _opt_float(body.get("duration")),
                        guard_replies.oom_facts(body["oom"]) if body.get("oom") else None,
                        guard_replies.xids(body.get("xids") or []))
    if kind == wire.Kind.XID:
        return GpuError(host, guard_replies.xid_facts(body))
    if kind == wire.Kind.RDATA:
        return RankData(host, rank_of(body.pop("rank")), body)
    if kind == wire.Kind.HELLO:
        return Hello(host, bounded(body["v"], 0, 1 << 16, "v"), pid_of(body["pid"]),
                     moment(body["time"], "time"))
    if kind == wire.Kind.READY:
        return Ready(host, guard_replies.ready_facts(body))
    if kind == wire.Kind.ERROR:
        problem = Problem(host, said(body["problem"], "problem"),
                          said(body.get("fix"), "fix") or None, code_of(body.get("code")),
                          values_of(body.get("fields")))
        return GuardRefused(host, problem, bool(body.get("busy")), bool(body.get("unhealthy")),
                            env_not_ready(body.get("environment")))
    if kind == wire.Kind.STARTED:
        return Started(host, pid_of(body["pid"]), body.get("warm") is True)
    if kind == wire.Kind.EXIT:
        return GuardExit(host, bounded(body["code"], -(1 << 31), 1 << 31, "code"),
                         said(body.get("reason"), "reason"), said(body.get("error"), "error"),
                         nccl_chosen(body.get("nccl")), body.get("kept_pool") is True)
    raise UnknownKind(f"unknown frame kind {kind!r}")


_KILLER = re.compile(re.escape(wire.KILLED_BY)
                     .replace(r"\{host\}", r"([A-Za-z0-9.:-]{1,253}|\?)")
                     .replace(r"\{user\}", r"([A-Za-z0-9_][A-Za-z0-9_.-]{0,31}\$?|\?)"))


def killed_by(said: str) -> str:
    """A guard's ``killed_by`` as the head repeats it: only the form a guard makes of a kill note
    (``wire.KILLED_BY``: a host name and a user name), else nothing. A guard stopped by a signal
    may say who sent it (it stops restarts: ``launch.supervise.restart``); a node cannot pass
    other text for it."""
    found = _KILLER.fullmatch(said)
    return wire.KILLED_BY.format(host=found[1], user=found[2]) if found else ""


def nccl_chosen(said: Any) -> wire.NcclChoice | None:
    """A guard's ``nccl`` as the head keeps it: every key of ``wire.NcclChoice`` (None where
    not said), each a short string, a number or a list of short strings (a node's text,
    cleaned again where it is shown); other keys dropped."""
    if not isinstance(said, dict):
        return None
    hcas = said.get("hcas")
    return {"transport": _said(said.get("transport")), "hca": _said(said.get("hca")),
            "link": _said(said.get("link")), "sockets": _said(said.get("sockets")),
            "gid_index": _said_number(said.get("gid_index")),
            "ranks": _count(said.get("ranks")),
            "hcas": [str(v)[:64] for v in hcas[:16]] if isinstance(hcas, list) else None,
            "cause": _said(said.get("cause"))}


def _said(value: Any) -> str | None:
    return None if isinstance(value, bool) or value is None else str(value)[:300]


def _said_number(value: Any) -> int | str | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else _said(value)


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _opt_float(value: Any) -> float | None:
    return None if value is None else moment(value)


MALFORMED_FRAME = Declared(
    "run.malformed-frame", "a node sent a malformed frame",
    "node {host} sent a malformed {kind} frame: {error}",
    "check that node: its guard does not send this (a node that does may be compromised, or "
    "run another ptcluster version)")


def malformed(e: Malformed, at: float) -> Failure:
    """The node's failure for a malformed frame of a kind the head reads (pure)."""
    return Failure(host=e.host, rank=None, at=at, kind=FailureKind.GUARD,
                   problem=Problem.of(MALFORMED_FRAME, None, host=e.host, kind=e.kind,
                                      error=e.error))
