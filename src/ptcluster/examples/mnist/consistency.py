"""The checks that every rank holds the same thing: the same data, and the same model and
optimizer state (the divergence digests). Each is a collective: every rank calls it."""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from ptcluster.examples.mnist.data import Dataset
from ptcluster.examples.mnist.world import World


def params_digest(net: nn.Module) -> str:
    h = hashlib.sha256()
    for p in net.parameters():
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def state_digest(net: nn.Module, opt: torch.optim.Optimizer) -> str:
    """The parameters' and the optimizer state's digest: equal on every rank while DDP keeps
    them in step (the optimizer state is each rank's own: DDP never syncs it)."""
    h = hashlib.sha256(params_digest(net).encode())
    for state in opt.state_dict()["state"].values():
        for key in sorted(state):
            value = state[key]
            h.update(key.encode())
            h.update(value.detach().float().cpu().numpy().tobytes()
                     if isinstance(value, torch.Tensor) else repr(value).encode())
    return h.hexdigest()[:16]


def check_in_step(net: nn.Module, opt: torch.optim.Optimizer, world: World, where: str) -> None:
    """Every rank's model and optimizer state are the same, or the job stops here naming the
    groups of ranks. Cheap next to a checkpoint's save."""
    seen = world.gather(state_digest(net, opt))
    if len(set(seen)) > 1:
        groups: dict[str, list[int]] = {}
        for r, d in enumerate(seen):
            groups.setdefault(d, []).append(r)
        raise RuntimeError(f"ranks diverged {where}: " + "; ".join(
            f"ranks {rs} have state {d}" for d, rs in groups.items()))


def check_same_data(data: Dataset, world: World) -> None:
    """Different files on different nodes would give ranks different numbers of steps (a hang)."""
    seen = world.gather((data.name, len(data.train_y), len(data.test_y)))
    if len(set(seen)) != 1:
        raise RuntimeError(f"ranks loaded different data (name, train, test per rank: {seen}): "
                           "put the same MNIST files on every node, or use --dataset digits")
