"""Runs on every rank (shipped as ``-c`` code through the launch path, with
``node/rank/api.py``: ``init_distributed``, ``device_sync`` and ``report``).

argv[1] is a JSON config from the head (``sweep.worker_config``): per op, the element counts
to run, computed on the head (``formulas.count_for``), so this file has no size formula.
Rank 0 reports one record per result (``rank_setup.report``, never printed).
Timing: warm-ups, then timed iterations between device synchronisations, the time averaged
over ranks; with ``min_s`` (``bench --predict``), while those took less, as many more as make
``min_s``, timed anew (a window of a few short collectives on a node under a CPU quota, whose
period is 100 ms, catches a throttled stretch, or none). Correctness: a separate pass whose
inputs are small integers (exact in every float type), compared with the exact expected
result; mismatches are summed over ranks.
"""

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from ptcluster.node.rank.api import device_sync, end_rank, init_distributed, report
from ptcluster.node.rank.bench_wire import PairDone, RowDone, Started, WorkerConfig

MAX_ITERS = 100_000
"""Most timed iterations of one size, however short they are (``min_s``)."""


@dataclass(frozen=True)
class Rank:
    """This rank's place in the job, and the sweep's element type."""

    rank: int
    n: int
    device: torch.device
    dtype: torch.dtype

    def sync(self) -> None:
        device_sync(self.device)

    def pattern(self, count: int, r: int, offset: int = 0) -> torch.Tensor:
        """Rank r's check input: small integers, whose sums over ranks stay exact in fp16/bf16."""
        idx = torch.arange(offset, offset + count, device=self.device)
        return ((idx + r) % 4).to(self.dtype)


def run() -> int:
    cfg: WorkerConfig = json.loads(sys.argv[1])
    rank, n, device, backend = init_distributed(cfg["timeout"])
    me = Rank(rank, n, device, getattr(torch, cfg["dtype"]))
    if rank == 0:
        started: Started = {"world_size": n, "backend": backend, "device": device.type}
        report("start", started)
    for op, counts in cfg["plan"]:
        for count in counts:
            seconds, wrong = bench_count(me, cfg, op, count)
            if rank == 0:
                row: RowDone = {"op": op, "count": count, "seconds": seconds, "wrong": wrong}
                report("row", row)
    if cfg["pairs"]:
        pair_matrix(me, cfg)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def bench_count(me: Rank, cfg: WorkerConfig, op: str, count: int) -> tuple[float, int]:
    """One row: seconds per op (averaged over ranks) and wrong elements (summed over ranks)."""
    big = count * me.n  # all_gather's output and reduce_scatter's input
    send = torch.zeros(big if op == "reduce_scatter" else count, dtype=me.dtype, device=me.device)
    recv = torch.zeros(big if op == "all_gather" else count, dtype=me.dtype, device=me.device)
    prev, nxt = (me.rank - 1) % me.n, (me.rank + 1) % me.n

    def run() -> None:
        run_op(op, send, recv, prev, nxt)

    seconds = time_op(me, run, cfg["warmup"], cfg["iters"], cfg.get("min_s", 0.0))
    wrong = sum(check(me, op, send, recv, count, run, cfg["corrupt"])
                for _ in range(cfg["check"]))
    bad = torch.tensor([wrong], dtype=torch.int64, device=me.device)
    dist.all_reduce(bad)
    return seconds, int(bad.item())


def time_op(me: Rank, run: Callable[[], None], warmup: int, iters: int,
            min_s: float = 0.0) -> float:
    """Seconds per run: warm-ups, then ``iters`` runs between device syncs; mean over ranks.
    When those took less than ``min_s``, the runs that should last ``min_s`` (the most any
    rank asks for, so that every rank runs as many) are timed instead."""
    for _ in range(warmup):
        run()
    seconds = timed(me, run, iters)
    if seconds * iters < min_s:
        want = torch.tensor([min(MAX_ITERS, math.ceil(min_s / max(seconds, 1e-9)))],
                            dtype=torch.int64, device=me.device)
        dist.all_reduce(want, op=dist.ReduceOp.MAX)
        seconds = timed(me, run, int(want.item()))
    return seconds


def timed(me: Rank, run: Callable[[], None], iters: int) -> float:
    """Seconds per run of ``iters`` runs from a barrier, between device syncs; mean over
    ranks."""
    me.sync()  # queued work (the warm-ups on a GPU): waited for before starting the clock
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    me.sync()
    elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64,
                           device=me.device)
    dist.all_reduce(elapsed)
    return float(elapsed.item()) / me.n


def run_op(op: str, send: torch.Tensor, recv: torch.Tensor, prev: int, nxt: int) -> None:
    if op == "all_reduce":
        dist.all_reduce(send)
    elif op == "all_gather":
        dist.all_gather_into_tensor(recv, send)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(recv, send)
    elif op == "broadcast":
        dist.broadcast(send, src=0)
    else:
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt),
                                       dist.P2POp(dist.irecv, recv, prev)])
        for req in reqs:
            req.wait()


def check(me: Rank, op: str, send: torch.Tensor, recv: torch.Tensor, count: int,
          run: Callable[[], None], corrupt: bool) -> int:
    """One verified run: returns this rank's number of wrong elements."""
    rank, n, pattern = me.rank, me.n, me.pattern
    if op == "all_reduce":
        send.copy_(pattern(count, rank))
        expected = torch.stack([pattern(count, r).double() for r in range(n)]).sum(0)
        run()
        got = send
    elif op == "all_gather":
        send.copy_(pattern(count, rank))
        expected = torch.cat([pattern(count, r).double() for r in range(n)])
        run()
        got = recv
    elif op == "reduce_scatter":
        send.copy_(pattern(count * n, rank))
        expected = torch.stack([pattern(count, r, offset=rank * count).double()
                                for r in range(n)]).sum(0)
        run()
        got = recv
    elif op == "broadcast":
        send.copy_(pattern(count, rank))
        expected = pattern(count, 0).double()
        run()
        got = send
    else:
        send.copy_(pattern(count, rank))
        expected = pattern(count, (rank - 1) % n).double()
        run()
        got = recv
    if corrupt and rank == 0:  # library-only test hook (BenchConfig.corrupt)
        expected = expected.clone()
        expected[0] += 1
    return int((got.double() != expected).sum().item())


def pair_matrix(me: Rank, cfg: WorkerConfig) -> None:
    """Ping-pong between the first ranks of every pair of nodes; others wait at the barrier."""
    buf = torch.ones(cfg["pair_count"], dtype=me.dtype, device=me.device)
    for a, b in cfg["pairs"]:
        dist.barrier()
        if me.rank not in (a, b):
            continue
        peer, first = (b, True) if me.rank == a else (a, False)
        for _ in range(cfg["warmup"]):
            round_trip(buf, peer, first)
        me.sync()
        t0 = time.perf_counter()
        for _ in range(cfg["iters"]):
            round_trip(buf, peer, first)
        me.sync()
        seconds = (time.perf_counter() - t0) / cfg["iters"]
        if me.rank == a:
            pair: PairDone = {"a": a, "b": b, "seconds": seconds}
            report("pair", pair)


def round_trip(buf: torch.Tensor, peer: int, first: bool) -> None:
    """One ping-pong: the first side sends, then receives it back; the other the reverse."""
    if first:
        dist.send(buf, peer)
        dist.recv(buf, peer)
    else:
        dist.recv(buf, peer)
        dist.send(buf, peer)


def main() -> NoReturn:
    end_rank(run())


if __name__ == "__main__":
    main()
