"""``bench --predict``'s model: a job's step time at 1..N nodes from one node's measured step and
the cluster's measured all-reduce bus bandwidth. Pure: no processes, no network.

The model, per step of a rank:

* **compute** (forward, backward, optimizer, data): the one-node run's mean step time (steps
  with an evaluation in them aside) less the
  part of its own all-reduce that backward did not hide (measured: from the last bucket ready
  to its all-reduce done). It stays the same at every node count: the per-rank batch is kept;
* **all-reduce** of bucket *b* on *n* ranks: ``bytes_b x 2(n-1)/n / busbw(bytes_b)``, the ring's
  traffic over the bus bandwidth the sweep measured at that size on the whole cluster. busbw is
  the bottleneck link's speed whatever *n* is (nccl-tests' definition), so the one sweep serves
  every node count;
* **overlap** (DDP's): bucket *b* starts when backward made it ready (the moment measured in
  the one-node run, relative to the step's start) and when bucket *b-1* is done (one
  communication channel, buckets in DDP's order); backward is assumed to run at its one-node
  speed meanwhile. What is not hidden, ``last done - last ready``, adds to the step. A job whose
  one-node run had no DDP (one rank) has its buckets ready when their last gradient was.

One node's row is the measurement itself. ``efficiency`` is the samples/s per rank against one
node's; ``bound`` is ``network`` when the all-reduce left unhidden is over ``NETWORK_SHARE`` of
the step.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ptcluster.node.rank.step_probe import MeasuredStep

NETWORK_SHARE = 0.10
"""A row is network-bound when the all-reduce that backward does not hide is over this share
of its step (the network alone costs more than this much of the efficiency)."""
PAYS_OFF = 0.8
"""The scaling efficiency at which N nodes "pay off": the link speed named for N nodes is the
one at which they would reach it."""


@dataclass(frozen=True)
class Bucket:
    nbytes: int
    """The bucket's gradient bytes (what one rank all-reduces)."""
    ready_s: float
    """When backward made it ready, seconds from the step's start (the one-node run)."""


@dataclass(frozen=True, kw_only=True)
class Measured:
    """The one-node run, reduced to what the model needs."""

    step_s: float
    """Mean seconds per step (those with an evaluation in them aside)."""
    exposed_s: float
    """Median seconds of the one-node all-reduce that backward did not hide (0 on one rank)."""
    batch: int
    """Samples per rank per step."""
    ranks: int
    """Ranks of the one-node run."""
    buckets: tuple[Bucket, ...]
    """DDP's buckets in the order they are all-reduced."""
    ddp: bool = True
    """Whether the buckets are DDP's own (else emulated: the run had no DDP)."""
    steps: int = 0
    """How many training steps ``step_s`` is the mean of (0: not said)."""

    def __post_init__(self) -> None:
        if not self.step_s > 0 or not math.isfinite(self.step_s):
            raise ValueError(f"step_s must be a finite time > 0; got {self.step_s}")
        if self.batch < 1 or self.ranks < 1:
            raise ValueError(f"batch and ranks must be >= 1; got {self.batch}, {self.ranks}")
        if not 0 <= self.exposed_s < self.step_s:
            raise ValueError(f"exposed_s must be in [0, step_s); got {self.exposed_s}")

    @property
    def grad_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def compute_s(self) -> float:
        return self.step_s - self.exposed_s

    def to_json(self) -> dict[str, Any]:
        return {"step_s": self.step_s, "exposed_s": self.exposed_s, "batch": self.batch,
                "ranks": self.ranks, "grad_bytes": self.grad_bytes, "ddp": self.ddp,
                "steps": self.steps, "buckets": [asdict(b) for b in self.buckets]}


def measured_from(steps: Sequence[MeasuredStep], world_size: int,
                  batch: int | None = None) -> Measured:
    """The probe's ``predict`` record (``node.rank.step_probe``): per measured step its
    seconds, batch and ``[bytes, ready_s, done_s]`` per bucket (None in all but the last
    steps: ``step_probe.KEEP_BUCKETS``). Bucket sizes and order from the
    last step (DDP's rebuilt ones), ready times the median over steps, the step time the mean
    over the steps without an evaluation, the batch the one most steps saw; ``batch`` overrides
    it."""
    if not steps:
        raise ValueError("no measured step")
    last = steps[-1]["buckets"] or []
    with_buckets = [b for s in steps if (b := s.get("buckets")) is not None]
    same = [b for b in with_buckets if len(b) == len(last)]
    buckets = tuple(Bucket(nbytes=int(b[0]), ready_s=statistics.median(s[i][1] for s in same))
                    for i, b in enumerate(last))
    exposed = [max(0.0, max((b[2] for b in s), default=0.0) - max((b[1] for b in s),
                                                                  default=0.0))
               for s in with_buckets] or [0.0]
    train = [s for s in steps if not s.get("eval")] or list(steps)
    step_s = statistics.fmean(s["step_s"] for s in train)
    seen = batch or statistics.mode(int(s["batch"]) for s in steps)  # (an evaluation's aside)
    if seen < 1:
        raise ValueError("the probe saw no batch: pass --batch")
    return Measured(step_s=step_s, exposed_s=min(statistics.median(exposed), 0.9 * step_s),
                    batch=seen, ranks=world_size, buckets=buckets,
                    ddp=all(s.get("ddp", True) for s in steps), steps=len(train))


@dataclass(frozen=True)
class BusBw:
    """Measured all-reduce bus bandwidth (GB/s) by message size: log-log interpolation between
    the measured sizes, the nearest one outside them."""

    points: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        if not self.points or any(s < 1 or not g > 0 for s, g in self.points):
            raise ValueError(f"busbw needs (size >= 1, GB/s > 0) points; got {self.points}")

    def at(self, size: int) -> float:
        pts = sorted(self.points)
        if size <= pts[0][0]:
            return pts[0][1]
        if size >= pts[-1][0]:
            return pts[-1][1]
        for (s0, g0), (s1, g1) in zip(pts, pts[1:], strict=False):
            if s0 <= size <= s1:
                if s1 == s0:
                    return g0
                w = math.log(size / s0) / math.log(s1 / s0)
                return math.exp(math.log(g0) + w * (math.log(g1) - math.log(g0)))
        return pts[-1][1]  # pragma: no cover - the loop covers every size in range

    def scaled(self, factor: float) -> BusBw:
        return BusBw(tuple((s, g * factor) for s, g in self.points))


@dataclass(frozen=True, kw_only=True)
class Row:
    nodes: int
    ranks: int
    step_s: float
    samples_per_s: float
    efficiency: float
    bound: str
    allreduce_s: float
    """All-reduce time of one step's buckets, back to back (0 on one node: inside step_s)."""
    exposed_s: float
    """The part of it backward does not hide."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def allreduce_s(nbytes: int, ranks: int, busbw: BusBw) -> float:
    """Seconds of one all-reduce of ``nbytes`` per rank on ``ranks``: the ring's 2(n-1)/n."""
    if ranks < 2:
        return 0.0
    return nbytes * 2 * (ranks - 1) / ranks / (busbw.at(nbytes) * 1e9)


def exposed(buckets: Sequence[Bucket], ranks: int, busbw: BusBw) -> tuple[float, float]:
    """(all-reduce seconds in all, seconds of it after the last bucket was ready): buckets
    reduced one after another, each from when it is ready."""
    if not buckets or ranks < 2:
        return 0.0, 0.0
    cursor = total = 0.0
    for b in buckets:
        t = allreduce_s(b.nbytes, ranks, busbw)
        cursor = max(b.ready_s, cursor) + t
        total += t
    return total, max(0.0, cursor - max(b.ready_s for b in buckets))


def predict(m: Measured, slots: Sequence[int], busbw: BusBw | None) -> list[Row]:
    """A row per node count 1..len(slots): the first k nodes with their slots."""
    rows: list[Row] = []
    one = m.batch * m.ranks / m.step_s
    for k in range(1, len(slots) + 1):
        ranks = sum(slots[:k])
        if k == 1:
            step, total, hidden_not = m.step_s, 0.0, m.exposed_s
        else:
            if busbw is None:
                raise ValueError("a prediction past one node needs the measured busbw")
            total, hidden_not = exposed(m.buckets, ranks, busbw)
            step = m.compute_s + hidden_not
        sps = m.batch * ranks / step
        rows.append(Row(nodes=k, ranks=ranks, step_s=step, samples_per_s=sps,
                        efficiency=(sps / ranks) / (one / m.ranks),
                        bound="network" if hidden_not > NETWORK_SHARE * step else "compute",
                        allreduce_s=total, exposed_s=hidden_not))
    return rows


def link_for(m: Measured, slots: Sequence[int], busbw: BusBw,
             target: float = PAYS_OFF) -> float | None:
    """The factor by which the measured busbw must grow for all ``len(slots)`` nodes to reach
    ``target`` efficiency (<= 1: they already do); None when no bandwidth would (the compute
    alone is already below it)."""
    def eff(f: float) -> float:
        return predict(m, slots, busbw.scaled(f))[-1].efficiency

    if eff(1.0) >= target:
        return 1.0
    hi = 2.0
    while eff(hi) < target:
        hi *= 2
        if hi > 1e6:
            return None
    lo = 1.0
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if eff(mid) < target else (lo, mid)
    return hi


def slower(rows: Sequence[Row]) -> list[tuple[Row, Row]]:
    """Every node count predicted slower than a smaller one: (its row, the fastest row with
    fewer nodes)."""
    out = []
    for k, row in enumerate(rows[1:], start=1):
        best = max(rows[:k], key=lambda r: r.samples_per_s)  # the best with fewer nodes
        if row.samples_per_s < best.samples_per_s:
            out.append((row, best))
    return out


def link(m: Measured, slots: Sequence[int], busbw: BusBw) -> tuple[float, float | None]:
    """The link now and the link that pays off: the all-reduce's bus bandwidth measured now
    (Gbit/s, at the largest bucket), and the one with which all the nodes would reach
    ``PAYS_OFF`` scaling efficiency (None: no link speed does; at most the first: they do
    now)."""
    factor = link_for(m, slots, busbw)
    now_gbit = busbw.at(max((b.nbytes for b in m.buckets), default=1)) * 8
    return now_gbit, None if factor is None else now_gbit * factor


def verdict(m: Measured, rows: Sequence[Row], slots: Sequence[int],
            busbw: BusBw | None) -> list[str]:
    """Plain sentences: every node count predicted slower than a smaller one (the fastest of
    those named: :func:`slower`), and what link speed would make all the nodes pay off
    (:func:`link`)."""
    out: list[str] = []
    mb = m.grad_bytes / 1e6
    for row, best in slower(rows):
        out.append(
            f"{row.nodes} nodes are predicted slower than {best.nodes}: "
            f"{row.samples_per_s:.1f} samples/s against {best.samples_per_s:.1f}. Each step "
            f"all-reduces {mb:.2f} MB of gradients, {row.allreduce_s:.3f} s on "
            f"{row.ranks} ranks, {row.exposed_s:.3f} s of it not hidden behind backward, "
            f"against {m.compute_s:.3f} s of compute.")
    if busbw is None or len(rows) < 2:
        return out
    last = rows[-1]
    now_gbit, needed = link(m, slots, busbw)
    if needed is None:
        out.append(f"No link speed brings {last.nodes} nodes to {PAYS_OFF:.0%} scaling "
                   "efficiency: the step is not limited by the network.")
    elif needed <= now_gbit:
        out.append(f"{last.nodes} nodes pay off: {last.samples_per_s / rows[0].samples_per_s:.2f}x "
                   f"the samples/s of one node ({last.efficiency:.0%} scaling efficiency).")
    else:
        out.append(f"{last.nodes} nodes would reach {PAYS_OFF:.0%} scaling efficiency with a "
                   f"link of about {needed:.3g} Gbit/s (the all-reduce measured "
                   f"{now_gbit:.3g} Gbit/s of bus bandwidth now).")
    return out
