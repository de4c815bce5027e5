"""This process's place in the job and the collectives the trainer needs on plain values.

A plain ``python -m ptcluster.examples.mnist`` is a world of one: no process group, and every
collective here is then the value itself.
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ptcluster.node.rank.api import init_distributed

T = TypeVar("T")


def setup(timeout_s: float) -> tuple[int, int, int, torch.device, str]:
    """(rank, local_rank, world_size, device, backend); a plain run is a world of one."""
    if "RANK" not in os.environ:
        device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
        return 0, 0, 1, device, "none"
    # The rule every ptcluster rank program uses: PTCLUSTER_BACKEND (auto: NCCL with a GPU, else
    # gloo) and the device from LOCAL_RANK, never from the global rank.
    rank, world, device, backend = init_distributed(timeout_s)
    return rank, int(os.environ["LOCAL_RANK"]), world, device, backend


def gather(obj: T, world: int) -> list[T]:
    """Every rank's ``obj`` in rank order. A collective: every rank must call it."""
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def all_sum(values: list[float], device: torch.device, world: int) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(t)
    return t.tolist()

