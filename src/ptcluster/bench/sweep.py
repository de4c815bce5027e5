"""Head side of `ptcluster bench`: run the worker on every rank, turn its timings into
nccl-tests rows (formulas.py), and collect the node-pair matrix."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ptcluster.bench.formulas import (
    DTYPES,
    OPS,
    bandwidths,
    count_for,
    redop_for,
    root_for,
    size_for,
)
from ptcluster.cluster.model import ClusterSpec
from ptcluster.launch.api import run_rank_program
from ptcluster.launch.options import RunOptions
from ptcluster.launch.result import Failure
from ptcluster.launch.runner import LineSink
from ptcluster.node import BENCH_WORKER
from ptcluster.node.rank.bench_wire import WorkerConfig
from ptcluster.remote.rank_records import pair_done, row_done, started


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One sweep: which ops at which sizes, and how each size is timed and checked."""

    ops: tuple[str, ...]
    """Collectives to run, from ``formulas.OPS``, in this order."""
    sizes: tuple[int, ...]
    """Message sizes in bytes (nccl-tests' "size" column); a size below one element per rank
    is skipped, as nccl-tests does."""
    iters: int = 20
    """Timed iterations per size; the time is their average."""
    warmup: int = 5
    """Untimed iterations before the timed ones."""
    min_s: float = 0.0
    """Seconds each size is timed for at least: when ``iters`` took less, as many iterations
    as should last this long are timed instead (0: ``iters`` only)."""
    check: int = 1
    """Verified runs per size (0: no check)."""
    dtype: str = "float32"
    """Element type, a key of ``formulas.DTYPES``."""
    pairs: bool = False
    """Also measure every pair of nodes (first rank of each) with a sendrecv ping-pong."""
    pair_size: int = 16 << 20
    """Bytes per message of the node-pair ping-pong."""
    timeout: float = 300.0
    """Seconds for the whole sweep."""
    corrupt: bool = False
    """Test-only, library-only (no CLI option): rank 0 perturbs one expected value per check,
    so a test can prove that #wrong counts real mismatches."""

    def __post_init__(self) -> None:
        unknown = [op for op in self.ops if op not in OPS]
        if not self.ops or unknown:
            raise ValueError(f"ops must be one or more of {', '.join(OPS)}; got "
                             f"{list(self.ops)}")
        if not self.sizes or any(size < 1 for size in self.sizes):
            raise ValueError(f"sizes must be one or more sizes >= 1 byte; got {list(self.sizes)}")
        for name, least in (("iters", 1), ("warmup", 0), ("check", 0), ("pair_size", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}; got {getattr(self, name)}")
        if not 0 <= self.min_s < math.inf:
            raise ValueError(f"min_s must be a finite number of seconds >= 0; got {self.min_s}")
        if not 0 < self.timeout < math.inf:  # also rejects nan
            raise ValueError(f"timeout must be a finite number of seconds > 0; got "
                             f"{self.timeout}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")


@dataclass(kw_only=True)
class Row:
    op: str
    size: int
    count: int
    type: str
    redop: str
    root: int
    time_us: float
    algbw: float
    busbw: float
    wrong: int


SLOW_PAIR = 0.7
"""A node pair whose bandwidth is below this fraction of the pairs' median is named slow (the
ratio is printed whatever it is; the threshold only decides the word)."""


@dataclass(frozen=True)
class SlowestPair:
    a: str
    b: str
    gbps: float
    median_gbps: float

    @property
    def ratio(self) -> float:
        return self.gbps / self.median_gbps if self.median_gbps > 0 else 0.0

    @property
    def slow(self) -> bool:
        return self.ratio < SLOW_PAIR

    def to_json(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "gbps": self.gbps, "median_gbps": self.median_gbps,
                "ratio": round(self.ratio, 3), "slow": self.slow}

    def line(self) -> str:
        verdict = f"slow: below {SLOW_PAIR:.1f}x the median" if self.slow else "within range"
        return (f"slowest pair: {self.a} <-> {self.b} {self.gbps:.3f} GB/s, median of the pairs "
                f"{self.median_gbps:.3f} GB/s ({self.ratio:.2f}x, {verdict})")


def slowest_pair(pairs: list[dict[str, Any]]) -> SlowestPair | None:
    """The pair with the least bandwidth, against the median of all pairs; None with fewer
    than 3 pairs (a median of one or two says nothing about one link)."""
    if len(pairs) < 3:
        return None
    values = sorted(p["gbps"] for p in pairs)
    mid = len(values) // 2
    median = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
    low = min(pairs, key=lambda p: p["gbps"])
    return SlowestPair(a=low["a"], b=low["b"], gbps=low["gbps"], median_gbps=median)


@dataclass(kw_only=True)
class BenchResult:
    world_size: int = 0
    backend: str = ""
    rows: list[Row] = field(default_factory=list)
    pairs: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failure: Failure | None = None

    @property
    def wrong(self) -> int:
        return sum(r.wrong for r in self.rows)

    @property
    def slowest_pair(self) -> SlowestPair | None:
        return slowest_pair(self.pairs)

    @property
    def avg_busbw(self) -> float:
        return sum(r.busbw for r in self.rows) / len(self.rows) if self.rows else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "backend": self.backend,
                "rows": [asdict(r) for r in self.rows], "pairs": self.pairs,
                "slowest_pair": None if self.slowest_pair is None else
                self.slowest_pair.to_json(),
                "skipped": self.skipped, "out_of_bounds": self.wrong,
                "avg_busbw": self.avg_busbw,
                "failure": None if self.failure is None else self.failure.headline()}


def sweep_plan(cfg: BenchConfig, nranks: int) -> tuple[list[tuple[str, list[int]]], list[str]]:
    """The per-rank element counts of every op (``formulas.count_for``; sizes too small for
    one element per rank are left out), and a line for each op that cannot run."""
    elem = DTYPES[cfg.dtype]
    plan: list[tuple[str, list[int]]] = []
    skipped: list[str] = []
    for op in cfg.ops:
        if op == "sendrecv" and nranks < 2:
            skipped.append(f"{op}: sendrecv needs 2 ranks")
            continue
        counts = [count_for(op, size, nranks, elem) for size in cfg.sizes]
        plan.append((op, [c for c in counts if c >= 1]))
    return plan, skipped


def worker_config(cfg: BenchConfig, nranks: int, pairs: list[list[int]]) -> WorkerConfig:
    """What every rank's worker gets (JSON, argv[1]): counts, not sizes, so the head's formulas
    are the only ones. ``pairs``: the [rank a, rank b] ping-pongs, when ``cfg.pairs``."""
    return {"plan": sweep_plan(cfg, nranks)[0], "iters": cfg.iters, "warmup": cfg.warmup,
            "min_s": cfg.min_s,
            "check": cfg.check, "dtype": cfg.dtype, "timeout": cfg.timeout,
            "corrupt": cfg.corrupt, "pairs": pairs if cfg.pairs else [],
            "pair_count": pair_count(cfg)}


def pair_count(cfg: BenchConfig) -> int:
    """Elements per node-pair message (at least one)."""
    return max(1, cfg.pair_size // DTYPES[cfg.dtype])


def run_bench(spec: ClusterSpec, cfg: BenchConfig, port: int | None = None,
              on_line: LineSink | None = None) -> BenchResult:
    pairs = [[spec.rank_base(i), spec.rank_base(j)]
             for i in range(len(spec.nodes)) for j in range(i + 1, len(spec.nodes))]
    n = spec.world_size
    worker_cfg = worker_config(cfg, n, pairs)
    host_of = {r: spec.nodes[i].host for i in range(len(spec.nodes)) for r in spec.ranks_of(i)}
    result = BenchResult(world_size=n, skipped=sweep_plan(cfg, n)[1])
    elem = DTYPES[cfg.dtype]
    pair_bytes = pair_count(cfg) * elem

    def handle(host: str, rank: int, data: dict[str, Any]) -> None:
        """A worker's record, checked (``remote.rank_records``: one that fails is noted by
        the run as unusable)."""
        kind = data.pop("kind", None)
        if kind == "start":
            result.backend = started(data)["backend"]
        elif kind == "row":
            row = row_done(data)
            op, count, seconds = row["op"], row["count"], row["seconds"]
            size = size_for(op, count, n, elem)
            algbw, busbw = bandwidths(op, size, seconds, n)
            result.rows.append(Row(op=op, size=size, count=count, type=cfg.dtype,
                                   redop=redop_for(op), root=root_for(op),
                                   time_us=seconds * 1e6, algbw=algbw, busbw=busbw,
                                   wrong=row["wrong"]))
        elif kind == "pair":
            pair = pair_done(data)
            result.pairs.append({"a": host_of[pair["a"]], "b": host_of[pair["b"]],
                                 "bytes": pair_bytes,
                                 "gbps": 2 * pair_bytes / pair["seconds"] / 1e9})

    run = run_rank_program(spec, BENCH_WORKER,
                           (json.dumps(worker_cfg),), port=port, on_data=handle, on_line=on_line,
                           options=RunOptions(deadline=cfg.timeout))
    if not run.ok:
        result.failure = run.root_cause or Failure(host=spec.nodes[0].host, rank=None,
                                                   message="the benchmark was interrupted")
    return result
