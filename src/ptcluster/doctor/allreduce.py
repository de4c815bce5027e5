"""The doctor's last check: a real all-reduce over every rank, result verified.

Runs as ``-c`` code through the same launch path as ``ptcluster run`` (so it tests exactly what
a job would use: torchrun, the rendezvous, the interface env, the backend choice). Every rank
contributes ``rank + 1``; the sum must be ``n (n + 1) / 2`` in every element. Rank 0 prints one
``PTCDOCTOR {json}`` line.
"""

from __future__ import annotations

MARK = "PTCDOCTOR "

CODE = r'''
import json, os, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist

timeout = float(sys.argv[1]) if len(sys.argv) > 1 else 30.0
numel = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 20
backend = os.environ.get("PTCLUSTER_BACKEND", "auto")
if backend == "auto":
    backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
if backend == "nccl":
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
else:
    device = torch.device("cpu")
dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
rank, world = dist.get_rank(), dist.get_world_size()
x = torch.full((numel,), float(rank + 1), device=device)
dist.all_reduce(x)
expected = world * (world + 1) / 2
wrong = int((x != expected).sum().item())
times = []
for _ in range(5):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    dist.all_reduce(x)
    if device.type == "cuda":
        torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
bad = torch.tensor([wrong], dtype=torch.int64, device=device)
dist.all_reduce(bad)
t = sorted(times)[len(times) // 2]
if rank == 0:
    size = numel * 4
    print("PTCDOCTOR " + json.dumps({
        "world_size": world, "backend": backend, "bytes": size, "wrong": int(bad.item()),
        "time_ms": round(t * 1000, 3),
        "busbw_gbps": round(size / t * 2 * (world - 1) / world / 1e9, 3)}), flush=True)
dist.destroy_process_group()
sys.exit(1 if int(bad.item()) else 0)
'''
