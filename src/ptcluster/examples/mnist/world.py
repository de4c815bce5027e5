"""This process's place in the job (:class:`World`) and the collectives the trainer needs on
plain values.

A plain ``python -m ptcluster.examples.mnist`` is a world of one: no process group, and every
collective here is then the value itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ptcluster.node.rank.api import init_distributed

T = TypeVar("T")


@dataclass(frozen=True)
class World:
    rank: int
    """The global rank: rank 0 alone logs progress and prints the final line."""
    local_rank: int
    """The rank on its node: local rank 0 of every node writes that node's checkpoints and
    downloads its data."""
    size: int
    """The number of ranks."""
    device: torch.device
    """This rank's device: the GPU of its LOCAL_RANK under NCCL (a plain run: the first GPU, if
    any), else the CPU."""
    backend: str
    """The process group's backend; ``none`` for a plain run."""

    @classmethod
    def join(cls, timeout_s: float) -> World:
        """Join the job's process group (a plain run: a world of one, without one)."""
        if "RANK" not in os.environ:
            device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
            return cls(0, 0, 1, device, "none")
        # The rule every ptcluster rank program uses: PTCLUSTER_BACKEND (auto: NCCL with a GPU,
        # else gloo) and the device from LOCAL_RANK, never from the global rank.
        rank, size, device, backend = init_distributed(timeout_s)
        return cls(rank, int(os.environ["LOCAL_RANK"]), size, device, backend)

    def gather(self, obj: T) -> list[T]:
        """Every rank's ``obj`` in rank order. A collective: every rank must call it."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def all_sum(self, values: list[float]) -> list[float]:
        """Each value summed over the ranks (in float64). A collective."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.size > 1:
            dist.all_reduce(t)
        return t.tolist()

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()
