"""The checkpoint's view of the job: which node each rank is on, each node's leader, and the
process group the checkpoint's own traffic goes through.

A node is what torchrun calls a group: ``GROUP_RANK`` (``NODE_RANK``), else ``RANK //
LOCAL_WORLD_SIZE``; its leader is its ``LOCAL_RANK`` 0. Nodes are put in a ring in the order of
their index: node i replicates to node i+1 mod n.

The traffic (gathers of small metadata, files sent and received as uint8 tensors) goes through
a gloo group of the job's own ranks made for it: no new listener, so nothing new to
authenticate, and these are the job's own ranks. Gloo, not the job's backend, because the bytes
are in host memory (files), because NCCL would need them on a GPU first, and because the save's
background thread must never issue collectives on the group the training loop uses (two
threads' collectives on one group may interleave differently on different ranks). Both gloo and
NCCL send and receive uint8 tensors; gloo runs wherever torch.distributed does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class Place:
    rank: int
    world: int
    node: int
    """This rank's node: its position in the ring (0..nodes-1)."""
    node_of: tuple[int, ...]
    """Each rank's node."""
    leaders: tuple[int, ...]
    """Each node's leader rank (its lowest local rank)."""
    group: Any
    """The checkpoint's gloo group (None without a process group: one process)."""

    @property
    def nodes(self) -> int:
        return len(self.leaders)

    @property
    def leader(self) -> bool:
        return self.leaders[self.node] == self.rank

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (small, picklable metadata only)."""
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)


_CACHE: dict[int, Place] = {}


def _node_index() -> int:
    for var in ("GROUP_RANK", "NODE_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return dist.get_rank() // max(local_world, 1)


def place() -> Place:
    """This rank's place; the first call in a job makes the gloo group (a collective: every
    rank calls save and load, so every rank gets here together)."""
    if not (dist.is_available() and dist.is_initialized()):
        return Place(0, 1, 0, (0,), (0,), None)
    key = id(dist.group.WORLD)
    if key in _CACHE:
        return _CACHE[key]
    group = dist.new_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = (_node_index(), int(os.environ.get("LOCAL_RANK", "0") or 0))
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine, group=group)
    ids = sorted({n for n, _ in every})
    node_of = tuple(ids.index(n) for n, _ in every)
    leaders = tuple(min(r for r in range(world) if node_of[r] == i) for i in range(len(ids)))
    _CACHE[key] = Place(rank, world, node_of[rank], node_of, leaders, group)
    return _CACHE[key]
