"""DDP MNIST, done right. The seed recipe's job, without its bugs.

    1 process:         python -m ptcluster.examples.mnist
    this machine:      ptcluster run -m ptcluster.examples.mnist          (2 CPU ranks or 1/GPU)
    a cluster:         ptcluster run --cluster cluster.yaml -m ptcluster.examples.mnist
    same, by hand:     torchrun --nnodes 2 --node-rank I --nproc-per-node G \\
                           --master-addr HEAD --master-port 29500 -m ptcluster.examples.mnist

What the classic recipe gets wrong and this does not:
- the device comes from LOCAL_RANK; ``torch.cuda.set_device(rank)`` with the global rank breaks
  on every node after the first;
- a new shuffle every epoch, the same on every rank (what ``DistributedSampler.set_epoch`` is
  for), each global batch split over the ranks: the same samples whatever the world size, and
  the same step (each rank's loss weighted by its share, so shares may differ by one sample);
- the logged loss is averaged over all ranks, not rank 0's shard;
- test accuracy covers the whole test set, split across ranks and summed;
- no ``loss.item()`` per step (a CPU-GPU sync point): losses are summed on the device;
- checkpoints are written to a temporary file and renamed (a crash never leaves half a file),
  by local rank 0 of every node into its own ``--checkpoint-dir``, so nodes with separate disks
  each hold a copy; every epoch, and every ``--checkpoint-every-steps`` steps; ``--resume``
  takes the newest one any node has, and nodes whose disk lacks it receive it from one that
  has it (over the process group, sha256 checked) and keep a copy;
- restarted by ``ptcluster run --max-restarts`` it resumes by itself (from this job's own
  checkpoints), tells the head what it resumed from and what it saved (the no-progress rule),
  and on fewer ranks keeps the global batch (and the math of a step);
- what depends on a node's disk (resume epoch, MNIST or the digits, downloads) is agreed by all
  ranks, so no rank skips a collective that another enters;
- SIGUSR2 (Slurm's warning before preemption or the time limit) ends the run after the next
  checkpoint, on every rank at the same step; under Slurm the job is requeued (``preempt.py``);
- gloo on CPU and NCCL on GPU chosen automatically (ptcluster's own rank set-up);
  bf16 (or fp16) autocast on GPU.

Here: the training loop, top to bottom. Beside it: ``config.py`` (the flags as a TrainConfig),
``world.py`` (this rank's place), ``data.py``, ``checkpoint.py`` (saving and resuming),
``consistency.py`` (every rank holds the same data and state) and ``preempt.py``.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ptcluster.examples.mnist import checkpoint
from ptcluster.examples.mnist.checkpoint import Checkpoints, Start, TrainState
from ptcluster.examples.mnist.config import TrainConfig, parse_config
from ptcluster.examples.mnist.consistency import check_in_step, check_same_data, params_digest
from ptcluster.examples.mnist.data import Dataset, load_agreed
from ptcluster.examples.mnist.preempt import Preemption
from ptcluster.examples.mnist.world import World
from ptcluster.node.rank.api import checkpoint_saved, end_rank, resumed_from
from ptcluster.node.rank_wire import RESTART_COUNT_VAR

log = logging.getLogger("ptcluster.examples.mnist")
Autocast = Callable[[], AbstractContextManager[Any]]


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    world = World.join(cfg.timeout)
    # Rank 0 alone logs progress; lines go to stdout so they interleave with prints in order.
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    for name in (log.name, "ptcluster.examples.mnist.data"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.propagate = False
        logger.setLevel(logging.INFO if world.rank == 0 else logging.WARNING)
    try:
        return train(cfg, world)
    finally:
        if dist.is_initialized():  # also a world of one under torchrun
            dist.destroy_process_group()


def run(argv: list[str] | None = None) -> NoReturn:
    """:func:`main`, then end the process (``end_rank``: under a launcher, without the
    interpreter's teardown); what ``python -m ptcluster.examples.mnist`` runs."""
    end_rank(main(argv))


def train(cfg: TrainConfig, world: World) -> int:
    """Train up to ``cfg.epochs`` (from where :func:`prepare` says), evaluating and saving after
    every epoch; stop early after a save when preempted."""
    job = prepare(cfg, world)
    start, steps_per_epoch = job.start, job.steps_per_epoch
    x, y = job.data.train_x.to(world.device), job.data.train_y.to(world.device)
    samples, train_time, accuracy = 0, 0.0, float("nan")
    t_start = time.perf_counter()
    for epoch in range(start.epoch, cfg.epochs):
        batches = Batches(x, y, epoch_order(len(y), cfg.seed, epoch, world.device),
                          start.global_batch, world)
        first = start.step if epoch == start.epoch else 0
        t0 = time.perf_counter()
        loss_sum, count, stopped = run_epoch(job.learner, batches, range(first, steps_per_epoch),
                                             functools.partial(job.saves.after_step, epoch))
        if stopped:
            return 0
        if world.device.type == "cuda":
            torch.cuda.synchronize()
        train_time += time.perf_counter() - t0
        total_loss, total = world.all_sum([loss_sum.item(), count])  # (a CPU-GPU sync point)
        samples += int(total)
        accuracy = evaluate(job.net, job.data, world)
        log.info("epoch %d/%d loss=%.4f test_accuracy=%.4f time=%.2fs elapsed=%.2fs", epoch + 1,
                 cfg.epochs, total_loss / max(total, 1), accuracy, time.perf_counter() - t0,
                 time.perf_counter() - t_start)
        if job.saves.at_end(epoch):
            return 0
    world.barrier()
    print(f"rank={world.rank} params_sha256={params_digest(job.net)} start_epoch={start.epoch} "
          f"start_step={start.epoch * steps_per_epoch + start.step}", flush=True)
    if world.rank == 0:
        rate = samples / train_time if train_time else 0.0
        print(f"final epochs={cfg.epochs} test_accuracy={accuracy:.4f} "
              f"samples_per_s={rate:.1f} train_time_s={train_time:.2f} dataset={job.data.name} "
              f"world_size={world.size} backend={world.backend}", flush=True)
    return 0


@dataclass(frozen=True)
class Job:
    """What the epochs need, once prepared."""

    data: Dataset
    net: nn.Module
    learner: Learner
    start: Start
    steps_per_epoch: int
    saves: Saves


def prepare(cfg: TrainConfig, world: World) -> Job:
    """The data (the same on every rank), the model, and where to start: after the newest
    checkpoint any node has with ``--resume`` or in a restarted job, else from the beginning."""
    data = load_agreed(cfg.dataset, cfg.data_dir, world, download=cfg.download)
    check_same_data(data, world)
    log.info("dataset=%s train=%d test=%d world_size=%d backend=%s device=%s", data.name,
             len(data.train_y), len(data.test_y), world.size, world.backend, world.device.type)
    net, opt = build(cfg, world.device)
    autocast, scaler = mixed_precision(cfg.amp, world.device)
    ckpts = Checkpoints(cfg.checkpoint_dir, TrainState(net, opt, scaler), world, data.name)
    restarted = int(os.environ.get(RESTART_COUNT_VAR, "0") or 0) > 0
    start = Start(0, 0, cfg.batch_size * world.size)
    if cfg.resume or restarted:
        start = ckpts.resume(start, restarted=restarted)
    steps_per_epoch = len(data.train_y) // start.global_batch  # the last partial batch: dropped
    if steps_per_epoch < 1:
        raise ValueError(f"a global batch of {start.global_batch} is larger than the "
                         f"{len(data.train_y)} training samples: use a smaller --batch-size")
    if world.rank == 0:
        resumed_from(start.epoch * steps_per_epoch + start.step)
    ddp = DDP(net, device_ids=[world.device.index] if world.device.type == "cuda" else None) \
        if world.size > 1 else net
    if start.position is not None:
        check_in_step(net, opt, world, f"after resuming from {start.position}")
    saves = Saves(ckpts, start.global_batch, steps_per_epoch, cfg.checkpoint_every_steps,
                  Preemption.install())
    return Job(data, net, Learner(ddp, opt, autocast, scaler), start, steps_per_epoch, saves)


def model() -> nn.Module:
    # The recipe's model, so benchmarks compare loops, not architectures.
    return nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))


def build(cfg: TrainConfig, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(cfg.seed)
    net = model().to(device)
    opt: torch.optim.Optimizer
    if cfg.optimizer == "sgd":
        opt = torch.optim.SGD(net.parameters(), lr=cfg.learning_rate, momentum=cfg.momentum)
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=cfg.learning_rate)
    return net, opt


def grad_scaler(enabled: bool) -> Any:
    """A CUDA GradScaler on every torch from the declared floor (2.1) up.

    ``torch.amp.GradScaler("cuda")`` is torch >= 2.3; ``torch.cuda.amp.GradScaler`` is the older
    spelling (deprecated since).
    """
    if hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler("cuda", enabled=enabled)
    return torch.cuda.amp.GradScaler(enabled=enabled)


def mixed_precision(amp: str, device: torch.device) -> tuple[Autocast, Any]:
    """(autocast factory, grad scaler): bf16 (or fp16 with loss scaling) on GPU, else off."""
    use_amp = device.type == "cuda" and amp != "off"
    amp_dtype = torch.bfloat16 if amp == "bf16" or (
        amp == "auto" and use_amp and torch.cuda.is_bf16_supported()) else torch.float16
    scaler = grad_scaler(enabled=use_amp and amp_dtype == torch.float16)
    if not use_amp:
        return nullcontext, scaler
    return (lambda: torch.autocast("cuda", dtype=amp_dtype)), scaler


def epoch_order(n: int, seed: int, epoch: int, device: torch.device) -> torch.Tensor:
    """The epoch's shuffle of ``n`` samples: new each epoch, the same on every rank."""
    g = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).to(device)


@dataclass(frozen=True)
class Learner:
    """What takes a step: the model as DDP wraps it (the model itself on one rank), its
    optimizer, and mixed precision's autocast and loss scaler."""

    ddp: nn.Module
    opt: torch.optim.Optimizer
    autocast: Autocast
    scaler: Any


@dataclass(frozen=True)
class Batches:
    """An epoch's global batches: step ``k`` takes global batch ``k`` of ``order`` (the epoch's
    shuffle of the samples ``x``, ``y``), this rank its ``rank::size`` share of it."""

    x: torch.Tensor
    y: torch.Tensor
    order: torch.Tensor
    global_batch: int
    world: World

    def share(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        n, world = self.global_batch, self.world
        idx = self.order[k * n:(k + 1) * n][world.rank::world.size]
        return self.x[idx], self.y[idx]

    @property
    def weight(self) -> float:
        """What each rank's loss sum is scaled by (see :func:`run_epoch`)."""
        return self.world.size / self.global_batch


def run_epoch(learner: Learner, batches: Batches, steps: range,
              after_step: Callable[[int], bool]) -> tuple[torch.Tensor, int, bool]:
    """``steps`` of the epoch; ``after_step(k + 1)`` True stops it there. (The summed loss,
    still on the device; the samples it covers; whether it was stopped.)

    The shares differ by one sample where the world size does not divide the global batch, so
    each rank's loss is its share's *sum* times ``world / global_batch``: DDP's average over the
    ranks is then the mean over the whole global batch, and a step is the same step on any
    world size (up to float rounding).
    """
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    loss_sum = torch.zeros((), device=batches.x.device)
    count = 0
    for k in steps:
        x, y = batches.share(k)
        with learner.autocast():
            share_sum = loss_fn(learner.ddp(x), y)
        learner.opt.zero_grad(set_to_none=True)
        learner.scaler.scale(share_sum * batches.weight).backward()
        learner.scaler.step(learner.opt)
        learner.scaler.update()
        loss_sum += share_sum.detach()  # stays on the device: no sync per step
        count += len(y)
        if after_step(k + 1):
            return loss_sum, count, True
    return loss_sum, count, False


@dataclass(frozen=True)
class Saves:
    """When to save and whether to stop there: at the end of every epoch and every ``every``
    optimizer steps (0: never; counted from the job's first step, across resumes); after each
    save, whether any rank was told to stop (SIGUSR2, preemption). A collective: every rank
    decides the same."""

    ckpts: Checkpoints
    global_batch: int
    steps_per_epoch: int
    every: int
    preempted: Preemption

    def after_step(self, epoch: int, k: int) -> bool:
        """``k`` steps of ``epoch`` done: saved there, and stop?"""
        g = epoch * self.steps_per_epoch + k
        return self.every > 0 and g % self.every == 0 and k < self.steps_per_epoch and \
            self.at((epoch, k), g)

    def at_end(self, epoch: int) -> bool:
        return self.at((epoch, checkpoint.END), (epoch + 1) * self.steps_per_epoch)

    def at(self, position: checkpoint.Position, global_step: int) -> bool:
        """Save (local rank 0 of every node), then: stop here, preempted?"""
        state, world = self.ckpts.state, self.ckpts.world
        check_in_step(state.net, state.opt, world,
                      f"before saving {checkpoint.path_of(Path(), position)}")
        if self.ckpts.save(position, self.global_batch):
            checkpoint_saved(global_step, self.ckpts.folder)
        if not self.preempted.agreed(world.device, world.size):  # after the save: all hold it
            return False
        epoch, step = position
        log.info("preempted (SIGUSR2) %s: checkpoint saved",
                 f"after epoch {epoch + 1}" if step == checkpoint.END else
                 f"in epoch {epoch + 1} after step {step}")
        self.preempted.requeue(world.rank)
        return True


def evaluate(net: nn.Module, data: Dataset, world: World) -> float:
    """Accuracy over the whole test set: each rank takes every world-th sample, counts summed."""
    net.eval()
    with torch.no_grad():
        x = data.test_x[world.rank::world.size].to(world.device)
        y = data.test_y[world.rank::world.size].to(world.device)
        correct = (net(x).argmax(1) == y).sum().item() if len(y) else 0
    net.train()
    correct_all, total = world.all_sum([correct, len(y)])
    return correct_all / total
