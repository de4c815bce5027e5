"""The doctor's last check, run on every rank: a real all-reduce, result verified.

Shipped as ``-c`` code through the same launch path as ``ptcluster run`` (after
``node/rank/api.py``, which defines ``init_distributed`` and ``device_sync``), so it tests
exactly what a job would use: torchrun, the rendezvous, the interface env, the backend choice.
Every rank contributes ``rank + 1``; the sum must be ``n (n + 1) / 2`` in every element. Rank 0
reports one ``allreduce`` record to the head (``rank_setup.report``).
"""

import sys
import time

import torch
import torch.distributed as dist

# init_distributed, device_sync and end_rank come from node/rank/api.py, prepended when
# shipped.


def main() -> int:
    timeout = float(sys.argv[1]) if len(sys.argv) > 1 else 30.0
    numel = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 20
    rank, world, device, backend = init_distributed(timeout)  # type: ignore[name-defined]  # noqa: F821
    x = torch.full((numel,), float(rank + 1), device=device)
    dist.all_reduce(x)
    expected = world * (world + 1) / 2
    wrong = int((x != expected).sum().item())
    times = []
    for _ in range(5):
        device_sync(device)  # type: ignore[name-defined]  # noqa: F821
        t0 = time.perf_counter()
        dist.all_reduce(x)
        device_sync(device)  # type: ignore[name-defined]  # noqa: F821
        times.append(time.perf_counter() - t0)
    bad = torch.tensor([wrong], dtype=torch.int64, device=device)
    dist.all_reduce(bad)
    t = sorted(times)[len(times) // 2]
    if rank == 0:
        size = numel * 4
        report("allreduce", {  # type: ignore[name-defined]  # noqa: F821
            "world_size": world, "backend": backend, "bytes": size, "wrong": int(bad.item()),
            "time_ms": round(t * 1000, 3),
            "busbw_gbps": round(size / t * 2 * (world - 1) / world / 1e9, 3)})
    dist.destroy_process_group()
    return 1 if int(bad.item()) else 0


if __name__ == "__main__":
    end_rank(main())  # type: ignore[name-defined]  # noqa: F821
