"""The head's rule for "which rank is slow": the straggler report while a job runs.

Pure (no clock of its own, no I/O): the supervisor feeds it the guards' ``timing`` frames
(``node.guard.schedstat``: per rank, its main thread's run time and run delay from ``/proc``,
nothing inside the rank) and asks it on every tick.

In a synchronous data-parallel job (DDP, FSDP) every rank waits at each collective for the last
one, and a waiting rank's main thread sleeps (gloo: on a futex). So over a window each rank's
**wait share** (the part of the wall time its main thread was neither running nor runnable) is
high for the ranks that wait and low for the one they wait for. A rank, or every rank of one
node, is the straggler when its *busy share* (1 - wait share) is ``threshold`` times the other
ranks' median while those others wait at least ``MIN_WAIT`` of their time. Where the ranks
report collectives (the flight recorder's counters, which the stack probe already sends for the
hang watch) only windows in which every compared rank completed collectives count: the job is
past its start, where a slow import is not a slow step.

Limits (said in docs/guides/hangs-and-stragglers.md): a CUDA synchronization may spin, so on
GPU the waiting ranks' main threads do not sleep and no one is named (never a false name: the
others' wait share stays under ``MIN_WAIT``); a rank starved by its data loader sleeps as well
and looks like a waiter.

A change (a new straggler, another one, none any more) is said only once it held for
``CONFIRM`` evaluations in a row, one evaluation per ``EVAL_EVERY`` s; a named straggler stays
named until its ratio falls under ``release`` (hysteresis: between the two thresholds nothing
changes).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, TypedDict

from ptcluster.node.wire import NodeTiming, RankTiming

DEFAULT_THRESHOLD = 1.5
"""Busy-share ratio (the straggler's / the other ranks' median) from which a rank is named.
Chosen from ``benchmarks/straggler_threshold.py`` on the testbed (3 nodes x 1 rank, gloo; see
``THRESHOLD_MEASURED``)."""
THRESHOLD_MEASURED = (
    "two runs of benchmarks/straggler_threshold.py, each 5 balanced + 3 capped jobs: balanced, "
    "every rank at every evaluation 0.92-1.14 (peaks 1.12, 1.09, 1.09, 1.04, 1.14; then 1.06, "
    "1.07, 1.04, 1.03, 1.06); one node capped to 25 % of a CPU, its rank 1.67-5.20 (lowest per "
    "run 1.94, 2.03, 1.67; then 1.71, 1.81, 1.90), the other ranks 0.31-0.76; first named "
    "8.3-9.0 s (306-338 steps) after rank 0's first step")
"""What the default rests on (``benchmarks/straggler_threshold.py --balanced 5 --capped 3
--percent 25 --seconds 25``): 1.5 is 1.3x the balanced maximum and 0.9x the capped minimum; a
named straggler is released under 1.25 (``RELEASE``), still above every balanced figure."""
RELEASE = 0.5
"""A named straggler is released when its ratio falls under 1 + RELEASE x (threshold - 1)."""
WINDOW = 3
"""Reports per rank in the window (a guard sends one every 2 s: about 6 s; 12 s on clusters of
1024 nodes, whose guards report every 4 s: ``wire.timing_every``)."""
MIN_WAIT = 0.20
"""The others must wait at least this share of their time: a job that hardly waits has none."""
CONFIRM = 2
"""Evaluations in a row a new verdict must hold before it is said."""
EVAL_EVERY = 2.0
"""Seconds between two evaluations (the guards' ``timing`` period; ``StragglerWatch.every``:
longer where the guards report less often, on large clusters)."""
FLOOR = 0.02
"""The others' busy share is taken as at least this (a ratio stays finite)."""
CPU_STARVED = 0.25
"""A rank's main thread runnable without a CPU this share of its time, and half again the
others' median: its node's CPU is saturated (a CPU quota counts the same)."""
THROTTLED = 0.25
"""A node whose ranks' CPU group was throttled in this share of its quota's periods (the
guard's ``cpu_throttled``) has a saturated CPU, whatever its main thread's delay says
(``node.guard.schedstat``: a throttled rank's main thread may sleep rather than wait)."""
LOW_MEMORY = 0.10
"""A node with less than this share of its memory available is short of memory."""
LOW_GPU = 50.0
"""A node whose GPUs' mean utilization (NVML) is under this is said to have low GPU util."""
MAX_TRACE = 600
"""Evaluations kept in ``trace`` (each rank's ratio at each: what a threshold is chosen from)."""
TRACE_RANKS = 64
"""Jobs of up to this many ranks have every rank's ratio traced (and a peak however low);
larger ones only the ratios from ``release`` up, those that can name or keep a straggler:
1024 nodes x 8 ranks x 600 evaluations would be 5 M figures, and building a verdict for
each of 9216 units every evaluation was most of its time."""


class RankJson(TypedDict):
    """One rank's row of the report (``RankFigures.to_json`` and the whole attempt's)."""

    rank: int
    host: str
    wait_share: float
    starved_share: float
    window_s: float
    collectives: int | None
    wait_share_job: float | None
    """Over the whole attempt (None before any report)."""
    collectives_job: int


class VerdictJson(TypedDict):
    """``Straggler.to_json``: the straggler named."""

    ranks: list[int]
    host: str
    whole_node: bool
    ratio: float
    others_wait_share: float
    wait_per_collective_s: float | None
    why: str
    seen: dict[str, float]
    """What ``why`` says, as figures (``Straggler.seen``)."""


class TraceJson(TypedDict):
    """One evaluation: when, and each rank's ratio (by rank, as text)."""

    at: float
    ratios: dict[str, float]


class Report(TypedDict):
    """``StragglerWatch.to_json``: what ``summary.json``'s ``straggler`` holds, the control
    socket answers (``Request.STRAGGLER``) and ``monitor``, ``stacks --json`` and the metrics
    read."""

    threshold: float
    release: float
    ranks: list[RankJson]
    nodes: dict[str, NodeTiming]
    current: VerdictJson | None
    peak: dict[str, Any] | None
    history: list[dict[str, Any]]
    """Each change of verdict: ``at``, ``line`` and the verdict's keys (``ranks: []``,
    ``host: None`` when one was released)."""
    trace: list[TraceJson]


@dataclass(frozen=True)
class RankFigures:
    """One rank over the window (seconds summed over its reports)."""

    rank: int
    host: str
    span: float
    run: float
    delay: float
    collectives: int | None
    """Collectives completed in the window; None when the rank does not report them."""
    active: bool = True
    """Every report of the window had collectives completed (or the rank reports none)."""

    wait_share: float = field(init=False, repr=False, compare=False)
    """The share of the window its main thread slept (neither running nor runnable)."""
    starved_share: float = field(init=False, repr=False, compare=False)
    """The share of the window it was runnable without a CPU."""
    busy: float = field(init=False, repr=False, compare=False)
    """1 - ``wait_share``."""

    def __post_init__(self) -> None:  # (computed once: they are read ~10 times per evaluation)
        span = self.span
        wait = min(1.0, max(0.0, span - self.run - self.delay) / span) if span > 0 else 0.0
        object.__setattr__(self, "wait_share", wait)
        object.__setattr__(self, "starved_share",
                           min(1.0, self.delay / span) if span > 0 else 0.0)
        object.__setattr__(self, "busy", 1.0 - wait)

    def to_json(self, share_job: float | None = None, collectives_job: int = 0) -> RankJson:
        """This window's row, with the whole attempt's figures (``wait_share_job``,
        ``collectives_job``)."""
        return {"rank": self.rank, "host": self.host, "wait_share": round(self.wait_share, 3),
                "starved_share": round(self.starved_share, 3), "window_s": round(self.span, 1),
                "collectives": self.collectives, "wait_share_job": share_job,
                "collectives_job": collectives_job}


@dataclass(frozen=True)
class Straggler:
    """The straggler: ``ranks`` (one, or every rank of ``host``); its busy share over the others'
    median (``ratio``: "its steps take Kx the median"), the others' median wait share and
    seconds waited per collective (None where unknown), and why, as far as the node saw."""

    ranks: tuple[int, ...]
    host: str
    whole_node: bool
    ratio: float
    others_wait_share: float
    wait_per_collective: float | None
    why: str
    seen: dict[str, float] = field(default_factory=dict)
    """What the node saw that ``why`` says, by name, past its limit only: ``cpu_starved`` (the
    share of time the most starved rank's main thread waited for a CPU), ``cpu_throttled``
    (the share of CPU quota periods throttled), ``mem_available`` (share), ``gpu_util`` (%)."""

    @property
    def who(self) -> str:
        if self.whole_node:
            return f"{self.host} (ranks {','.join(map(str, self.ranks))})"
        return f"rank {self.ranks[0]} on {self.host}"

    def line(self) -> str:
        share = f"{self.others_wait_share:.0%} of their time"
        waits = (f"{self.wait_per_collective:.3f} s per collective ({share})"
                 if self.wait_per_collective is not None else share)
        return (f"{self.who} is the straggler: the other ranks wait {waits} for it (its steps "
                f"take {self.ratio:.1f}x the median); {self.why}")

    def to_json(self) -> VerdictJson:
        return {"ranks": list(self.ranks), "host": self.host, "whole_node": self.whole_node,
                "ratio": self.ratio, "others_wait_share": self.others_wait_share,
                "wait_per_collective_s": self.wait_per_collective, "why": self.why,
                "seen": dict(self.seen)}


class _Spread:
    """One figure of every rank, sorted once, so that the median of all but a few ranks costs
    O(those few), not O(ranks): each of 8192 ranks (1024 nodes) is compared with the other
    8191, and a sort of them per rank was ~5 ms, 45 s per evaluation."""

    def __init__(self, values: dict[int, float]) -> None:
        order = sorted(values, key=lambda r: (values[r], r))
        self.sorted = [values[r] for r in order]
        self.at = {r: i for i, r in enumerate(order)}

    def median_floor(self, most: int) -> float:
        """At most the median of the values left once any ``most`` of them are taken out (taking
        values out moves every order statistic up, never down)."""
        return self.sorted[max(0, (len(self.sorted) - most) // 2 - 1)]

    def median_without(self, ranks: tuple[int, ...]) -> float:
        """``statistics.median`` of every value but those of ``ranks`` (the same arithmetic)."""
        gone = sorted(self.at[r] for r in ranks)
        n = len(self.sorted) - len(gone)
        if n % 2:
            return self._kth(n // 2, gone)
        return (self._kth(n // 2 - 1, gone) + self._kth(n // 2, gone)) / 2

    def _kth(self, k: int, gone: list[int]) -> float:
        """The ``k``-th (from 0) of the values left once the positions ``gone`` are taken out."""
        for position in gone:
            if position > k:
                break
            k += 1
        return self.sorted[k]


def candidates(figures: dict[int, RankFigures], nodes: dict[str, NodeTiming],
               at_least: float = 0.0) -> list[Straggler]:
    """Every rank, and every node of several ranks (not all of them), as the straggler would be,
    with its ratio (those of ``at_least`` or more); none where the others hardly wait
    (``MIN_WAIT``) or fewer than 2 ranks. O(ranks log ranks): the others' medians and sums come
    from the whole set less the unit."""
    if len(figures) < 2:
        return []
    by_host: dict[str, list[int]] = {}
    for r, f in sorted(figures.items()):
        by_host.setdefault(f.host, []).append(r)
    units = [(tuple(rs), host, True) for host, rs in by_host.items()
             if 1 < len(rs) < len(figures)]
    units += [((r,), f.host, False) for r, f in sorted(figures.items())]
    busies = _Spread({r: f.busy for r, f in figures.items()})
    # A unit whose ratio cannot reach ``at_least`` even against the lowest median the others
    # can have is passed over: at 8192 ranks that is nearly all of them, most of the time.
    floor = max(FLOOR, busies.median_floor(max(len(ranks) for ranks, _, _ in units)))
    units = [u for u in units
             if min(figures[r].busy for r in u[0]) / floor >= at_least - 0.005]  # (rounding)
    if not units:
        return []
    waits = _Spread({r: f.wait_share for r, f in figures.items()})
    starved = _Spread({r: f.starved_share for r, f in figures.items()})
    waited_all = sum(f.span - f.run - f.delay for f in figures.values())
    counted_all = sum(f.collectives or 0 for f in figures.values())
    uncounted_all = sum(1 for f in figures.values() if f.collectives is None or f.collectives <= 0)
    out = []
    for ranks, host, whole in units:
        mine = [figures[r] for r in ranks]
        # a whole node is as slow as its least slow rank: every one of them must stand out
        busy = min(f.busy for f in mine)
        median_wait = waits.median_without(ranks)
        if median_wait < MIN_WAIT:
            continue
        median_busy = max(FLOOR, busies.median_without(ranks))
        # rounded once, here: the console line and summary.json show the same figures
        ratio = round(busy / median_busy, 2)
        if ratio < at_least:
            continue
        waited = waited_all - sum(f.span - f.run - f.delay for f in mine)
        uncounted = uncounted_all - sum(1 for f in mine
                                        if f.collectives is None or f.collectives <= 0)
        counted = counted_all - sum(f.collectives or 0 for f in mine)
        per = max(0.0, waited) / counted if uncounted == 0 else None
        found = seen(mine, starved.median_without(ranks), nodes.get(host) or {})
        out.append(Straggler(ranks, host, whole, ratio, round(median_wait, 3),
                           None if per is None else round(per, 4), why(host, found), found))
    return out


def find_straggler(figures: dict[int, RankFigures], nodes: dict[str, NodeTiming],
                   threshold: float) -> Straggler | None:
    """The straggler among ``figures``, or None: a whole node before a single rank, else the
    slowest."""
    found = [v for v in candidates(figures, nodes) if v.ratio >= threshold]
    return max(found, key=lambda v: (v.whole_node, v.ratio), default=None)


def seen(mine: list[RankFigures], usual: float, node: NodeTiming) -> dict[str, float]:
    """What the node saw that slows its ranks (``Straggler.seen``), never a guess (``usual``:
    the other ranks' median share of time waiting for a CPU)."""
    out: dict[str, float] = {}
    starved = max(f.starved_share for f in mine)
    throttled = node.get("cpu_throttled")
    if starved >= max(CPU_STARVED, 1.5 * usual):
        out["cpu_starved"] = starved
    elif isinstance(throttled, (int, float)) and throttled >= THROTTLED:
        out["cpu_throttled"] = throttled
    mem = node.get("mem_available")
    if isinstance(mem, (int, float)) and mem < LOW_MEMORY:
        out["mem_available"] = mem
    gpu = node.get("gpu_util")
    if isinstance(gpu, (int, float)) and gpu < LOW_GPU:
        out["gpu_util"] = gpu
    return out


def why(host: str, seen: dict[str, float]) -> str:
    """``seen`` said, or "why unknown"."""
    reasons = []
    if "cpu_starved" in seen:
        reasons.append(f"{host}'s CPU is saturated (its main thread waited "
                       f"{seen['cpu_starved']:.0%} of the time for a CPU)")
    if "cpu_throttled" in seen:
        reasons.append(f"{host}'s CPU is saturated (a CPU quota throttled its ranks in "
                       f"{seen['cpu_throttled']:.0%} of its periods)")
    if "mem_available" in seen:
        reasons.append(f"{host} is short of memory ({seen['mem_available']:.0%} available)")
    if "gpu_util" in seen:
        reasons.append(f"{host}'s GPU util is low ({seen['gpu_util']:.0f}%)")
    return "; ".join(reasons) if reasons else "why unknown"


@dataclass
class StragglerWatch:
    """The window of every rank's reports, the current verdict and its history."""

    threshold: float = DEFAULT_THRESHOLD
    window: int = WINDOW
    every: float = EVAL_EVERY
    """Seconds between two evaluations: the guards' ``timing`` period."""
    reports: dict[int, deque[tuple[str, float, float, float, int | None]]] = field(
        default_factory=dict)
    """rank -> its last ``window`` reports: (host, span, run, delay, collectives or None)."""
    nodes: dict[str, NodeTiming] = field(default_factory=dict)
    totals: dict[int, list[float]] = field(default_factory=dict)
    """rank -> [seconds reported, seconds its main thread waited, collectives completed] over the
    whole attempt."""
    current: Straggler | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    peak: dict[str, Any] | None = None
    """The highest ratio any rank or node reached in an evaluation, named or not (past
    ``TRACE_RANKS`` ranks: only from the release ratio up)."""
    trace: deque[TraceJson] = field(default_factory=lambda: deque(maxlen=MAX_TRACE))
    """Per evaluation: when, and each rank's ratio (for ``benchmarks/straggler_threshold``; past
    ``TRACE_RANKS`` ranks only those from the release ratio up)."""
    version: int = 0
    """Counts the reports taken (a reader of ``to_json`` knows when to read again)."""
    _pending: tuple[tuple[int, ...] | None, int] = (None, 0)
    _last_eval: float | None = None
    _fresh: bool = False

    def __post_init__(self) -> None:
        if self.threshold <= 1.0:
            raise ValueError(f"straggler threshold must be > 1, got {self.threshold}")

    @property
    def release(self) -> float:
        return 1.0 + RELEASE * (self.threshold - 1.0)

    def report(self, host: str, ranks: dict[int, RankTiming], node: NodeTiming) -> None:
        """A guard's ``timing`` frame: per rank its interval's figures, and its node's."""
        for rank, body in ranks.items():
            try:
                span, run, delay = float(body["span"]), float(body["run"]), float(body["delay"])
            except (KeyError, TypeError, ValueError):
                continue
            if span <= 0:
                continue
            count = body.get("collectives")
            self.reports.setdefault(rank, deque(maxlen=self.window)).append(
                (host, span, run, delay, count if isinstance(count, int) else None))
            total = self.totals.setdefault(rank, [0.0, 0.0, 0.0])
            total[0] += span
            total[1] += max(0.0, span - run - delay)
            total[2] += count if isinstance(count, int) and count > 0 else 0
        self.nodes[host] = node.copy()
        self._fresh = True
        self.version += 1

    def figures(self) -> dict[int, RankFigures]:
        """Every rank with a full window."""
        out: dict[int, RankFigures] = {}
        for rank, window in self.reports.items():
            if len(window) < self.window:
                continue
            _, spans, runs, delays, counts = zip(*window, strict=True)
            known = None not in counts
            out[rank] = RankFigures(
                rank=rank, host=window[-1][0], span=sum(spans), run=sum(runs), delay=sum(delays),
                collectives=sum(counts) if known else None,
                active=not known or min(counts) > 0)
        return out

    def due(self, at: float) -> bool:
        """Whether ``evaluate`` would look now (new reports, ``every`` s since the last)."""
        return self._fresh and (self._last_eval is None
                                or at - self._last_eval >= self.every - 0.25)

    def evaluate(self, at: float, running: set[int]) -> str | None:
        """At most every ``every`` s, after new reports: the line to say when the verdict
        changed (``at``: wall clock, for the history), else None. Only ``running`` ranks whose
        window is full and active (collectives completed) are compared, and only once every
        running rank has such a window."""
        if not self.due(at):
            return None
        self._fresh, self._last_eval = False, at
        figures = {r: f for r, f in self.figures().items() if r in running}
        if set(figures) != running or not all(f.active for f in figures.values()):
            return None
        found = candidates(figures, self.nodes,
                           at_least=0.0 if len(figures) <= TRACE_RANKS else self.release)
        self.trace.append({"at": round(at, 3), "ratios": {
            str(v.ranks[0]): round(v.ratio, 3) for v in found if not v.whole_node}})
        top = max(found, key=lambda v: v.ratio, default=None)
        if top is not None and (self.peak is None or top.ratio > self.peak["ratio"]):
            self.peak = {"at": at, "ranks": list(top.ranks), "ratio": round(top.ratio, 2)}
        return self._decide(at, found)

    def _decide(self, at: float, found: list[Straggler]) -> str | None:
        """Hysteresis: the current straggler holds while its ratio is at least ``release`` and
        no other unit beats it over ``threshold``; any change must hold ``CONFIRM`` times."""
        best = max((v for v in found if v.ratio >= self.threshold),
                   key=lambda v: (v.whole_node, v.ratio), default=None)
        verdict = best
        if self.current is not None:
            mine = next((v for v in found if v.ranks == self.current.ranks), None)
            if mine is not None and mine.ratio >= self.release and (
                    best is None or best.ranks == mine.ranks or best.ratio <= mine.ratio):
                verdict = mine
        key = None if verdict is None else verdict.ranks
        now_key = None if self.current is None else self.current.ranks
        if key == now_key:
            self._pending = (None, 0)
            if verdict is not None:
                self.current = verdict  # the same straggler: fresh figures
            return None
        seen = self._pending[1] + 1 if self._pending[0] == key else 1
        self._pending = (key, seen)
        if seen < CONFIRM:
            return None
        self._pending = (None, 0)
        before, self.current = self.current, verdict
        if verdict is None:
            assert before is not None
            line = f"no straggler any more ({before.who} keeps up)"
            self.history.append({"at": at, "ranks": [], "host": None, "line": line})
            return line
        line = verdict.line()
        self.history.append({"at": at, **verdict.to_json(), "line": line})
        return line

    def to_json(self) -> Report:
        """The current figures: every rank's window, the verdict, the history."""
        ranks = []
        for rank, f in sorted(self.figures().items()):
            span, waited, done = self.totals.get(rank, [0.0, 0.0, 0.0])
            ranks.append(f.to_json(round(waited / span, 3) if span > 0 else None, int(done)))
        return {"threshold": self.threshold, "release": round(self.release, 3),
                "ranks": ranks, "nodes": dict(self.nodes),
                "current": None if self.current is None else self.current.to_json(),
                "peak": self.peak, "history": list(self.history), "trace": list(self.trace)}
