"""A small real DDP job (gloo) that checkpoints with ``ptcluster.checkpoint`` (the tests of
``tests/local/test_checkpoint.py``). Deterministic: the global batch of every step is the same
whatever the world size (each rank takes its slice), so the parameters after step k are the
same up to float rounding in any world size.

``--resume``: load first (prints ``loaded STEP`` or ``loaded None``). Then train up to
``--steps``, saving every ``--every`` steps. Rank 0 writes the parameters it ends with to
``--out`` and, with ``--digests DIR``, the sha256 of the parameters after each step to
``DIR/<step>`` (before that step's save), for the kill test to compare a load with.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import ptcluster

WIDTH, BATCH = 32, 8


class App:
    """The model and optimizer as one DCP ``Stateful`` (as DCP's own tutorial does)."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        model, opt = get_state_dict(self.model, self.opt)
        return {"model": model, "opt": opt}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"],
                       optim_state_dict=sd["opt"])


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(bytes(p.detach().contiguous().view(-1).view(torch.uint8).tolist()))
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--dir", default="ckpt")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--out", default="")
    ap.add_argument("--digests", default="")
    ap.add_argument("--width", type=int, default=WIDTH)
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds per step (rank 0 prints "
                    "each step: a test cuts a node when it sees one)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.Tanh(),
                              torch.nn.Linear(args.width, 1))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = {"app": App(model, opt), "extra": torch.zeros(3)}
    start = 0
    if args.resume:
        got = ptcluster.checkpoint.load(state, args.dir)
        print(f"loaded {got}", flush=True)
        start = got or 0
    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, args.width, generator=g), torch.randn(BATCH, 1, generator=g)
        mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        opt.zero_grad()
        # sum over this rank's slice / BATCH, times world (DDP averages): the global mean
        loss = ((model(x[mine]) - y[mine]) ** 2).sum() / BATCH * world
        loss.backward()
        opt.step()
        state["extra"].add_(1)  # a plain tensor beside the Stateful: the steps done
        if args.digests and rank == 0:
            Path(args.digests, str(step + 1)).write_text(digest(net))
        if args.every and (step + 1) % args.every == 0:
            ptcluster.checkpoint.save(state, step + 1, args.dir, keep=args.keep)
        if args.sleep:
            time.sleep(args.sleep)
            if rank == 0:
                print(f"step {step + 1} done", flush=True)
    ptcluster.checkpoint.wait()
    if args.out and rank == 0:
        torch.save({"params": net.state_dict(), "extra": state["extra"],
                    "digest": digest(net)}, args.out)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
