"""The doctor's last check, run on every rank: a real all-reduce, result verified.

Shipped as ``-c`` code through the same launch path as ``ptcluster run`` (with
``node/rank/api.py``: ``init_distributed``, ``device_sync``), so it tests
exactly what a job would use: torchrun, the rendezvous, the interface env, the backend choice.
Every rank contributes ``rank + 1``; the sum must be ``n (n + 1) / 2`` in every element. Rank 0
reports one ``allreduce`` record to the head (``api.report``).

First, every rank times the same fixed compute probe at the same moment (matmuls on its device:
its GPU, else the CPU), and rank 0 reports every rank's seconds (``compute_s``): the doctor names
a node much slower than the others before a job runs at its pace.
"""

import sys
import time
from typing import NoReturn

import torch
import torch.distributed as dist

from ptcluster.node.rank.api import device_sync, end_rank, init_distributed, report

PROBE_SIZE = {"cpu": 512, "cuda": 4096}
"""Matrix side of the compute probe: 268 MFLOP a product on a CPU (the block takes ~0.2 s on
one core here: longer than a CPU quota's 100 ms period), 137 GFLOP on a GPU."""
PROBE_ITERS = 60


def compute_probe(device: torch.device) -> float:
    """Seconds for ``PROBE_ITERS`` products of two fixed matrices on ``device``, after a
    warm-up; one block, so that a CPU quota (whose period is 100 ms) shows in full."""
    n = PROBE_SIZE.get(device.type, PROBE_SIZE["cpu"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    device_sync(device)
    t0 = time.perf_counter()
    for _ in range(PROBE_ITERS):
        a @ b
    device_sync(device)
    return time.perf_counter() - t0


def run() -> int:
    timeout = float(sys.argv[1]) if len(sys.argv) > 1 else 30.0
    numel = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 20
    rank, world, device, backend = init_distributed(timeout)
    dist.barrier()  # every rank probes at the same moment, as a job's ranks compute
    mine = torch.tensor([compute_probe(device)], dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    x = torch.full((numel,), float(rank + 1), device=device)
    dist.all_reduce(x)
    expected = world * (world + 1) / 2
    wrong = int((x != expected).sum().item())
    times = []
    for _ in range(5):
        device_sync(device)
        t0 = time.perf_counter()
        dist.all_reduce(x)
        device_sync(device)
        times.append(time.perf_counter() - t0)
    bad = torch.tensor([wrong], dtype=torch.int64, device=device)
    dist.all_reduce(bad)
    t = sorted(times)[len(times) // 2]
    if rank == 0:
        size = numel * 4
        report("allreduce", {
            "world_size": world, "backend": backend, "bytes": size, "wrong": int(bad.item()),
            "time_ms": round(t * 1000, 3),
            "compute_s": [round(float(v.item()), 4) for v in every],
            "busbw_gbps": round(size / t * 2 * (world - 1) / world / 1e9, 3)})
    dist.destroy_process_group()
    return 1 if int(bad.item()) else 0


def main() -> NoReturn:
    end_rank(run())


if __name__ == "__main__":
    main()
