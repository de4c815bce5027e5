"""A small real DDP job (gloo) for the straggler tests and benchmarks: a fixed amount of CPU work
per step (one thread per rank). Rank 0 prints every step's wall time (``step N t=T``) and at the
end ``steps_per_s``; ``--seconds S`` runs about S seconds of steps (rank 0's clock decides, told
to every rank by a broadcast every 10 steps, so every rank stops at the same step)."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--width", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
                                    torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
                                    torch.nn.Linear(args.width, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    stop = torch.zeros(1)
    start, step = time.time(), 0
    while True:
        x = torch.randn(256, args.width, generator=gen)
        loss = (model(x) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if rank == 0:
            print(f"step {step} t={time.time():.3f}", flush=True)
        if step % 10 == 0:
            stop.fill_(1.0 if time.time() - start > args.seconds else 0.0)
            dist.broadcast(stop, 0)
            if stop.item():
                break
    if rank == 0:
        print(f"steps_per_s {step / (time.time() - start):.3f}", flush=True)
    dist.destroy_process_group()
    # No interpreter shutdown after that: with gloo, work objects freed during finalization can
    # abort a rank (SIGABRT, "terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
