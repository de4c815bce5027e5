"""A job with a large gradient and little compute, for ``bench --predict``'s checks: an MLP of
1024 -> 2560 -> 1024 (5.25 M float32 parameters: 21 MB of gradient per step) on a fixed
synthetic batch, always under DDP (also on one rank), SGD. Rank 0 prints
``samples_per_s=X steps=K world_size=N``: the samples of every rank over the seconds of the
steps after ``--warmup``.

    python tests/support/biggrad.py [--steps K] [--warmup W] [--batch B]
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

WIDTH, HIDDEN = 1024, 2560


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.ReLU(),
                                                  nn.Linear(HIDDEN, WIDTH)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch, WIDTH)
    y = torch.randn(args.batch, WIDTH)
    t0 = time.perf_counter()
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            t0 = time.perf_counter()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    seconds = time.perf_counter() - t0
    world = dist.get_world_size()
    if dist.get_rank() == 0:
        print(f"samples_per_s={args.batch * world * args.steps / seconds:.2f} "
              f"steps={args.steps} world_size={world}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # (gloo's teardown may abort a finished process: see ptcluster's end_rank)


if __name__ == "__main__":
    main()
