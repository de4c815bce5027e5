"""Head side of ``bench --predict``: the job's brief run on the first node (its slots), with the
rank-side step probe armed (``node.rank.step_probe``), then the all-reduce sweep at the
measured bucket sizes on the whole cluster (``sweep.run_bench``), then the model (``predict``).
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from ptcluster.bench.predict import (
    BusBw,
    Measured,
    Row,
    link,
    measured_from,
    predict,
    slower,
    verdict,
)
from ptcluster.bench.sweep import BenchConfig, BenchResult, run_bench
from ptcluster.cluster.model import ClusterSpec
from ptcluster.launch.api import run_target
from ptcluster.launch.options import RunOptions
from ptcluster.launch.plan import Target
from ptcluster.launch.result import Failure
from ptcluster.node.rank_wire import PREDICT_VAR, THREADS_DEFAULT, THREADS_VAR
from ptcluster.remote.rank_records import predict_record
from ptcluster.remote.replies import BadReply

MAX_SWEEP_SIZES = 8
"""Most distinct sizes the sweep times: past this many bucket sizes, a geometric ladder from the
smallest to the largest (interpolated between)."""
SWEEP_MIN_S = 1.0
"""Seconds each bucket size's all-reduce is timed for at least (``PredictConfig.min_s`` when
that is less): ten periods of a CPU quota. The sweep's few iterations of a small bucket last
milliseconds: on the CPU-capped testbed the same 0.4 MB all-reduce timed 3.1 ms in one run (one
period's unthrottled part) and 11.5 ms in the next (a throttled stretch)."""
TAIL_LINES = 30
"""Lines of the brief run's output kept to show when it fails."""


@dataclass(frozen=True, kw_only=True)
class PredictConfig:
    warmup: int = 5
    """Steps run before the measured ones (DDP rebuilds its buckets after the first)."""
    steps: int = 30
    """Measured steps at least; the job is ended after them (and after ``min_s``)."""
    min_s: float = 3.0
    """Measured seconds at least: more steps are run when ``steps`` were quicker."""
    batch: int | None = None
    """Samples per rank per step; None: the first dimension of the first input the model's
    forward sees."""
    timeout: float = 300.0
    """Seconds for the brief run (start, warm-up and measured steps)."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_s < math.inf:
            raise ValueError(f"min_s must be a finite number of seconds >= 0; got {self.min_s}")
        if self.warmup < 1 or self.steps < 1:
            raise ValueError(f"warmup and steps must be >= 1; got {self.warmup}, {self.steps}")
        if self.batch is not None and self.batch < 1:
            raise ValueError(f"batch must be >= 1; got {self.batch}")
        if not 0 < self.timeout < math.inf:
            raise ValueError(f"timeout must be a finite number of seconds > 0; got "
                             f"{self.timeout}")


@dataclass(kw_only=True)
class Prediction:
    measured: Measured | None = None
    rows: list[Row] = field(default_factory=list)
    sentences: list[str] = field(default_factory=list)
    slower: list[tuple[int, int]] = field(default_factory=list)
    """(nodes, than): each node count predicted slower than a smaller one (``predict.slower``)."""
    link: tuple[float, float | None] | None = None
    """(now, pays off): the link in Gbit/s (``predict.link``); None for one node."""
    sweep: BenchResult | None = None
    failure: Failure | None = None
    output_tail: list[str] = field(default_factory=list)
    """The brief run's last lines, when it failed."""
    probe_s: float = 0.0
    sweep_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"rows": [{k: r.to_json()[k] for k in ("nodes", "ranks", "step_s",
                                                       "samples_per_s", "efficiency", "bound")}
                         for r in self.rows],
                "sweep": None if self.sweep is None else self.sweep.to_json(),
                "measured": None if self.measured is None else self.measured.to_json(),
                "detail": [r.to_json() for r in self.rows], "verdict": self.sentences,
                "slower": [{"nodes": n, "than": than} for n, than in self.slower],
                "link": None if self.link is None else {"now_gbit": self.link[0],
                                                        "pays_off_gbit": self.link[1]},
                "seconds": {"probe": round(self.probe_s, 3), "sweep": round(self.sweep_s, 3)},
                "failure": None if self.failure is None else self.failure.headline()}


def sweep_sizes(buckets: list[int]) -> tuple[int, ...]:
    """The sizes to time: every distinct bucket size, or a ladder of ``MAX_SWEEP_SIZES``."""
    distinct = sorted({max(4, b) for b in buckets})
    if len(distinct) <= MAX_SWEEP_SIZES:
        return tuple(distinct)
    lo, hi = distinct[0], distinct[-1]
    step = (hi / lo) ** (1 / (MAX_SWEEP_SIZES - 1))
    return tuple(sorted({int(lo * step ** i) for i in range(MAX_SWEEP_SIZES - 1)} | {hi}))


def probe_job(spec: ClusterSpec, target: Target, cfg: PredictConfig,
              port: int | None) -> tuple[Measured | None, Failure | None, list[str]]:
    """The brief run on the first node: its measurement, or why there is none (and the run's
    last lines). Its ranks get ``OMP_NUM_THREADS=1`` when the whole cluster has several ranks
    and ``env:`` sets none, as that job's ranks will (a one-rank job's default is every core)."""
    env = [*spec.env, (PREDICT_VAR, json.dumps({"warmup": cfg.warmup, "steps": cfg.steps,
                                     "min_s": cfg.min_s}))]
    if spec.world_size > 1 and THREADS_VAR not in dict(spec.env):
        # the threads the ranks of the job on several nodes get (``plan.threads_default``),
        # not the every-core default of a one-rank job: the compute measured is theirs
        env.append((THREADS_VAR, THREADS_DEFAULT))
    one = replace(spec, nodes=spec.nodes[:1], env=tuple(env))
    records: list[dict[str, Any]] = []
    tail: deque[str] = deque(maxlen=TAIL_LINES)

    def on_data(host: str, rank: int, data: dict[str, Any]) -> None:
        if data.get("kind") == "predict":
            records.append(data)  # (checked once, the last: the one the head keeps)

    def on_line(host: str, rank: int | None, text: str) -> None:
        tail.append(f"[{host}{'' if rank is None else f' rank {rank}'}] {text}")

    run = run_target(one, target, "predict", port=port, on_data=on_data, on_line=on_line,
                     options=RunOptions(deadline=cfg.timeout))
    host = spec.nodes[0].host
    if records:
        try:
            last = predict_record(records[-1])
            return measured_from(last["steps"], last["world_size"], cfg.batch), None, []
        except BadReply as exc:
            return None, Failure(host=host, rank=0, problem=exc.problem), list(tail)
        except ValueError as exc:
            return None, Failure(host=host, rank=0, message=str(exc)), list(tail)
    why = run.root_cause or Failure(
        host=host, rank=None, message=f"the job ended before {cfg.warmup + cfg.steps} "
        "optimizer steps (does it call optimizer.step() of a torch.optim optimizer?)")
    return None, why, list(tail)


def run_predict(spec: ClusterSpec, sweep_spec: ClusterSpec, target: Target, cfg: PredictConfig,
                bench: BenchConfig, port: int | None = None) -> Prediction:
    """The brief run, the sweep (``bench``'s settings, at the measured bucket sizes; none on
    a one-node cluster) and the table. ``sweep_spec``: the cluster for ptcluster's own ranks."""
    out = Prediction()
    t0 = time.monotonic()
    out.measured, out.failure, out.output_tail = probe_job(spec, target, cfg, port)
    out.probe_s = time.monotonic() - t0
    m = out.measured
    if m is None:
        return out
    slots = [n.slots for n in spec.nodes]
    busbw = None
    if len(spec.nodes) > 1 and m.buckets:
        t1 = time.monotonic()
        out.sweep = run_bench(sweep_spec, replace(
            bench, ops=("all_reduce",), sizes=sweep_sizes([b.nbytes for b in m.buckets]),
            pairs=False, min_s=min(cfg.min_s, SWEEP_MIN_S)), port=port)
        out.sweep_s = time.monotonic() - t1
        if out.sweep.failure is not None:
            out.failure = out.sweep.failure
            return out
        points = tuple((r.size, r.busbw) for r in out.sweep.rows if r.busbw > 0)
        if not points:
            out.failure = Failure(host=spec.nodes[0].host, rank=None,
                                  message="the all-reduce sweep measured no bandwidth")
            return out
        busbw = BusBw(points)
    elif len(spec.nodes) > 1:  # no gradient at all: nothing to all-reduce
        busbw = BusBw(((1, 1.0),))
    out.rows = predict(m, slots, busbw)
    out.sentences = verdict(m, out.rows, slots, busbw)
    out.slower = [(row.nodes, best.nodes) for row, best in slower(out.rows)]
    if busbw is not None and len(out.rows) > 1:
        out.link = link(m, slots, busbw)
    return out
