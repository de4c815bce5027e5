"""Every rank's stacks as one report: parse the probes' dumps, group ranks by where they are,
and name the straggler. Pure functions (table-tested); the runner collects, the CLI prints.

A rank's dump is faulthandler's text (``node/rank/stack_probe.py``), plus, when the flight
recorder is on and the rank's probe thread could answer, the collectives it has in flight. The
straggler is the rank that holds the others up: the one not in the collective the others wait in
(recorder), else the one whose stack is outside torch.distributed while the others are inside,
else the smallest group of ranks whose stacks differ from the rest.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ptcluster.errors import some
from ptcluster.node.guard.gpus import spans

OUR_FILES = ("ptcluster-stack-probe", "ptcluster-shim", "ptcluster-guard")
"""Frames of ptcluster's own code in a rank (the shim that runs the target, the probe)."""
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)(?: \[(.*?)\])? "
                     r"\(most recent call first\):\s*$")
RULES = ("no-ranks", "outside-collective", "no-stack", "desync", "stack-differs",
         "same-collective", "none")
"""How the stacks named the straggler, or why none (``to_json``'s ``straggler.rule``): no rank
runs; some ranks are outside the collective the others wait in; one gave no stack; its
collectives differ (a desync); its stack differs; every rank waits in the same collective;
none differs."""
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+|\?\?\?) in (.*?)\s*$')


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    @property
    def short(self) -> str:
        return f"{self.file.rsplit('/', 1)[-1]}:{self.line}"

    @property
    def ours(self) -> bool:
        return self.file in OUR_FILES or "runpy" in self.file or self.shim or \
            self.file.endswith("ptcluster/node/rank/stack_probe.py")

    @property
    def shim(self) -> bool:
        """The shim's code that runs the user's program (everything outside it is ours)."""
        return self.file == "ptcluster-shim" or self.file.endswith("ptcluster/node/rank/shim.py")

    @property
    def library(self) -> bool:
        """Code of Python or an installed package, not the user's."""
        f = self.file
        return (f.startswith("<frozen") or "/site-packages/" in f or "/dist-packages/" in f
                or "/lib/python3" in f or "/torch/" in f)

    @property
    def distributed(self) -> bool:
        return "/torch/distributed/" in self.file


@dataclass(frozen=True)
class ThreadStack:
    ident: str
    name: str
    main: bool
    """The thread that runs the user's program (its outermost frame is the shim's)."""
    frames: tuple[Frame, ...]
    """Innermost first, without ptcluster's own frames."""


def parse_faulthandler(text: str) -> list[ThreadStack]:
    """faulthandler's ``dump_traceback(all_threads=True)`` text -> threads, ptcluster's own
    threads (the probe) left out; the main thread first."""
    threads: list[tuple[str, str, list[Frame]]] = []
    for line in text.splitlines():
        head = _THREAD.match(line)
        if head:
            threads.append((head.group(2), head.group(3) or "", []))
            continue
        frame = _FRAME.match(line)
        if frame and threads:
            num = frame.group(2)
            threads[-1][2].append(Frame(frame.group(1), int(num) if num.isdigit() else 0,
                                        frame.group(3)))
    out = []
    for ident, name, frames in threads:
        if any(f.ours and not f.shim and "runpy" not in f.file for f in frames):
            continue  # the probe's own thread
        shim = next((i for i, f in enumerate(frames) if f.shim), None)
        kept = frames if shim is None else frames[:shim]  # the boot code outside it too
        out.append(ThreadStack(ident, name, shim is not None,
                               tuple(f for f in kept if not f.ours)))
    out.sort(key=lambda t: not t.main)
    return out


@dataclass(kw_only=True)
class RankStack:
    rank: int
    host: str
    pid: int | None = None
    threads: list[ThreadStack] = field(default_factory=list)
    active: list[dict[str, Any]] = field(default_factory=list)
    """Collectives in flight per the flight recorder ({pg, seq, op, sizes, state})."""
    counts: dict[str, Any] | None = None
    """The recorder's counters (enqueued, completed, waiting) when the rank answered."""
    ops: dict[str, int] | None = None
    """Collectives issued so far, by kind (the recorder's whole history, when it holds it)."""
    error: str = ""
    note: str = ""
    ms: float | None = None
    """From the signal to the end of the dump (how long asking cost)."""
    native: str = ""
    """py-spy's dump (native frames, the GIL holder) when the node has py-spy."""

    @property
    def main(self) -> ThreadStack | None:
        for t in self.threads:
            if t.main:
                return t
        return self.threads[0] if self.threads else None

    @property
    def user_frame(self) -> Frame | None:
        main = self.main
        if main is None:
            return None
        return next((f for f in main.frames if not f.library), main.frames[0] if main.frames
                    else None)

    @property
    def collective(self) -> str | None:
        """The torch.distributed call the main thread is in (e.g. ``all_reduce``), if any."""
        main = self.main
        if main is None:
            return None
        calls = []
        for f in main.frames:
            if not f.library:
                break
            if f.distributed and f.func not in ("wrapper", "_wrapper", "inner"):
                calls.append(f.func)
        return calls[-1] if calls else None

    @property
    def in_collective(self) -> bool | None:
        """Waiting inside a collective: the recorder's word first, else the stack's."""
        if self.counts is not None and "waiting" in self.counts:
            return bool(self.counts["waiting"])
        if self.main is None:
            return None
        return self.collective is not None

    def where(self) -> str:
        """One line: ``all_reduce #9 at train.py:88`` or ``in load_batch at data.py:40``."""
        if self.error and not self.threads:
            return f"no stack ({self.error})"
        user = self.user_frame
        site = f"{user.func} at {user.short}" if user else "no Python frame"
        call = self.collective
        if call is None:
            return f"in {site}"
        seq = self.active[-1].get("seq") if self.active else None
        at = f"at {user.short} (in {user.func})" if user else "(no Python frame of yours)"
        return f"{call}{f' #{seq}' if seq is not None else ''} {at}"

    def signature(self) -> str:
        """Ranks with the same signature are "in the same place" (the seq number aside)."""
        if self.error and not self.threads:
            return "<none>"
        user = self.user_frame
        return f"{self.collective or ''}|{user.file if user else ''}:{user.line if user else 0}"


@dataclass(kw_only=True)
class Group:
    ranks: list[RankStack]

    def label(self) -> str:
        nums = spans([r.rank for r in self.ranks])
        hosts = some(list(dict.fromkeys(str(r.host) for r in self.ranks)), sep=",")
        who = f"rank {nums}" if len(self.ranks) == 1 else f"ranks {nums}"
        return f"{who} on {hosts}: {self.ranks[0].where()}"


@dataclass(kw_only=True)
class StackReport:
    ranks: list[RankStack]
    reason: str = ""
    """Why it was taken ("asked by ptcluster stacks", "hang: no progress for 30 s")."""
    missing: list[str] = field(default_factory=list)
    """Nodes that did not answer in time."""
    at: float = 0.0

    def groups(self) -> list[Group]:
        """Ranks grouped by identical place, biggest group first."""
        by: dict[str, list[RankStack]] = {}
        for r in sorted(self.ranks, key=lambda r: r.rank):
            by.setdefault(r.signature(), []).append(r)
        return sorted((Group(ranks=v) for v in by.values()),
                      key=lambda g: (-len(g.ranks), g.ranks[0].rank))

    def straggler(self) -> tuple[list[RankStack], str]:
        """(the ranks holding the others up, why), or ([], why none could be named)."""
        late, why, _ = self.named()
        return late, why

    def named(self) -> tuple[list[RankStack], str, str]:
        """:meth:`straggler` and the rule that decided it (``RULES``)."""
        if not self.ranks:  # asked before the ranks' probes were up (or after they ended)
            return [], ("no rank of the job runs yet (or any more) on the nodes that answered: "
                        "ask again once the job prints its first lines"), "no-ranks"
        known = [r for r in self.ranks if r.in_collective is not None]
        waiting = [r for r in known if r.in_collective]
        outside = [r for r in known if not r.in_collective]
        if waiting and outside:
            what = _common_collective(waiting)
            return outside, (f"not in the collective the others wait in ({what})" if what
                             else "not in a collective while the others wait in one"), \
                "outside-collective"
        silent = [r for r in self.ranks if not r.threads]
        if silent and len(silent) < len(self.ranks):
            return silent, "it gave no stack while the others did", "no-stack"
        odd = _odd_history(self.ranks)
        if odd is not None:
            return *odd, "desync"
        groups = self.groups()
        if len(groups) > 1 and len(groups[-1].ranks) < len(groups[0].ranks):
            small = [g for g in groups if len(g.ranks) == len(groups[-1].ranks)]
            if len(small) == 1:
                return small[0].ranks, (f"its stack differs from the other ranks' "
                                        f"({groups[0].ranks[0].where()})"), "stack-differs"
        if len(groups) == 1 and waiting:
            return [], "every rank waits in the same collective: a rank or node that is " \
                       "gone (see the nodes) or a collective no rank will issue", \
                "same-collective"
        return [], "no single rank differs from the others", "none"

    def lines(self, full: bool = True) -> list[str]:
        """The report for a terminal: the straggler first, then the ranks by place, then
        (``full``) every rank's main-thread stack."""
        out = []
        if self.reason:
            out.append(self.reason)
        late, why = self.straggler()
        for r in late:
            out.append(f"straggler: rank {r.rank} on {r.host}"
                       f"{f' (pid {r.pid})' if r.pid else ''}: {r.where()} -- {why}")
        if not late:
            out.append(f"no straggler named: {why}")
        if self.ranks:
            out.append("ranks by place:")
            out += [f"  {g.label()}" for g in self.groups()]
        for host in self.missing:
            out.append(f"  {host}: no answer (node unreachable or busy)")
        if full:
            first = {r.rank for r in late}
            for r in sorted(self.ranks, key=lambda r: (r.rank not in first, r.rank)):
                out.append(f"rank {r.rank} on {r.host}:")
                out += ["  " + line for line in rank_stack_lines(r)]
        return out

    def headline(self) -> str:
        late, why = self.straggler()
        if not late:
            return f"no rank made progress; {why}"
        who = ", ".join(f"rank {r.rank} on {r.host}" for r in late)
        return f"straggler {who}: {late[0].where()} ({why})"

    def to_json(self) -> dict[str, Any]:
        late, why, rule = self.named()
        return {
            "reason": self.reason, "at": self.at, "missing": self.missing,
            "straggler": {"ranks": [r.rank for r in late], "why": why, "rule": rule},
            "groups": [{"ranks": [r.rank for r in g.ranks], "where": g.ranks[0].where()}
                       for g in self.groups()],
            "ranks": [{"rank": r.rank, "host": r.host, "pid": r.pid, "where": r.where(),
                       "error": r.error, "note": r.note, "probe_ms": r.ms, "pyspy": r.native,
                       "flight_recorder": {"counts": r.counts, "active": r.active,
                                           "ops": r.ops},
                       "threads": [{"id": t.ident, "name": t.name, "main": t.main,
                                    "frames": [{"file": f.file, "line": f.line, "func": f.func}
                                               for f in t.frames]} for t in r.threads]}
                      for r in sorted(self.ranks, key=lambda r: r.rank)],
        }


def rank_stack_lines(r: RankStack) -> list[str]:
    out = []
    if r.error:
        out.append(f"({r.error})")
    if r.note:
        out.append(f"({r.note})")
    for act in r.active:
        out.append(f"in flight: {act.get('op')} #{act.get('seq')} sizes {act.get('sizes')}")
    for t in r.threads:
        label = "main thread" if t.main else f"thread {t.name or t.ident}"
        out.append(f"{label} (most recent call last):")
        out += [f"  {f.file}:{f.line} in {f.func}" for f in reversed(t.frames)]
    if r.native:
        out.append("py-spy (native frames too, most recent call first):")
        out += [f"  {line}" for line in r.native.splitlines() if line.strip()]
    return out


def rank_stack(rank: int, host: str, raw: dict[str, Any]) -> RankStack:
    """One rank's entry of a guard's ``stacks`` frame -> :class:`RankStack`."""
    fr = raw.get("fr") or {}
    pid = raw.get("pid")
    return RankStack(rank=rank, host=host, pid=int(pid) if pid else None,
                     threads=parse_faulthandler(str(raw.get("text") or "")),
                     active=list(fr.get("active") or []), counts=fr.get("counts"),
                     ops=fr.get("ops"),
                     error=str(raw.get("error") or ""), note=str(raw.get("note") or ""),
                     ms=raw.get("ms"),
                     native=str(raw.get("pyspy") or (f"(py-spy: {raw['pyspy_error']})"
                                                     if raw.get("pyspy_error") else "")))


def build_report(replies: Iterable[tuple[str, dict[int, dict[str, Any]]]], *, reason: str,
                 missing: Iterable[str] = (), at: float = 0.0) -> StackReport:
    ranks = [rank_stack(rank, host, raw) for host, by_rank in replies
             for rank, raw in by_rank.items()]
    return StackReport(ranks=ranks, reason=reason, missing=list(missing), at=at)


def _common_collective(waiting: list[RankStack]) -> str:
    names = {(r.active[-1].get("op"), r.active[-1].get("seq")) if r.active else
             (r.collective, None) for r in waiting}
    if len(names) != 1:
        return ""
    op, seq = names.pop()
    if not op:
        return ""
    return f"{op}{f' #{seq}' if seq is not None else ''}"


def _odd_history(ranks: list[RankStack]) -> tuple[list[RankStack], str] | None:
    """A desync by the recorder's history: the ranks (a minority) that issued a different
    number of some collective than the others did."""
    known = [r for r in ranks if r.ops is not None]
    if len(known) < 2:
        return None
    by: dict[tuple[tuple[str, int], ...], list[RankStack]] = {}
    for r in known:
        by.setdefault(tuple(sorted((r.ops or {}).items())), []).append(r)
    if len(by) < 2:
        return None
    groups = sorted(by.items(), key=lambda kv: -len(kv[1]))
    (usual, most), (odd, few) = groups[0], groups[1]
    if len(groups) > 2 or len(few) >= len(most):
        return None
    mine, theirs = dict(odd), dict(usual)
    diffs = [f"{mine.get(op, 0)} {op}, the others {theirs.get(op, 0)}"
             for op in sorted(set(mine) | set(theirs)) if mine.get(op, 0) != theirs.get(op, 0)]
    return few, "its collectives differ from the others' (a desync): issued " + "; ".join(diffs)
