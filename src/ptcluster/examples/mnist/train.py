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
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ptcluster.examples.mnist import checkpoint
from ptcluster.examples.mnist.checkpoint import Start, resume, save_training
from ptcluster.examples.mnist.consistency import check_in_step, check_same_data, params_digest
from ptcluster.examples.mnist.data import (
    Dataset,
    download_mnist,
    find_mnist,
    load_digits,
    load_mnist,
)
from ptcluster.examples.mnist.preempt import Preemption
from ptcluster.examples.mnist.world import all_sum, gather, setup
from ptcluster.node.rank.api import checkpoint_saved, end_rank, resumed_from
from ptcluster.node.rank_wire import RESTART_COUNT_VAR

log = logging.getLogger("ptcluster.examples.mnist")
Autocast = Callable[[], AbstractContextManager[Any]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ptcluster.examples.mnist",
                                description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64,
                   help="per rank; the global batch (this x the ranks) is kept on a resume")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--lr", type=float, default=None,
                   help="default: 1e-3 for adamw, 0.05 for sgd")
    p.add_argument("--momentum", type=float, default=0.9, help="sgd only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", type=Path, default=Path("data"),
                   help="on each node; relative to its workdir")
    p.add_argument("--dataset", choices=("auto", "mnist", "digits"), default="auto",
                   help="auto: MNIST when every node has its files (or can download them), "
                        "else digits")
    p.add_argument("--no-download", action="store_true", help="never touch the network")
    p.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"),
                   help="on each node; relative to its workdir")
    p.add_argument("--resume", action="store_true",
                   help="continue after the newest checkpoint any node has (a restart of "
                        "ptcluster run --max-restarts does so by itself)")
    p.add_argument("--checkpoint-every-steps", type=int, default=0, metavar="K",
                   help="also save every K optimizer steps, not only every epoch (0: off)")
    p.add_argument("--amp", choices=("auto", "bf16", "fp16", "off"), default="auto",
                   help="autocast on GPU (auto: bf16 where supported, else fp16)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds a collective may wait for the other ranks")
    return p.parse_args(argv)


def model() -> nn.Module:
    # The recipe's model, so benchmarks compare loops, not architectures.
    return nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))


def evaluate(net: nn.Module, data: Dataset, rank: int, world: int,
             device: torch.device) -> float:
    """Accuracy over the whole test set: each rank takes every world-th sample, counts summed."""
    net.eval()
    with torch.no_grad():
        x, y = data.test_x[rank::world].to(device), data.test_y[rank::world].to(device)
        correct = (net(x).argmax(1) == y).sum().item() if len(y) else 0
    net.train()
    correct_all, total = all_sum([correct, len(y)], device, world)
    return correct_all / total


def load_data(args: argparse.Namespace, local_rank: int, world: int) -> Dataset:
    """The same data set on every rank, whatever each node's disk holds.

    Every rank takes the same collective steps: local rank 0 of each node downloads what its
    node lacks while the others wait at the barrier; then MNIST only if every rank finds its
    files, else the digits everywhere.
    """
    if args.dataset == "digits":
        return load_digits()
    if not args.no_download:
        if local_rank == 0 and find_mnist(args.data_dir) is None:
            why = download_mnist(args.data_dir)
            if why:  # asked for MNIST: every node says why it has none
                (log.warning if args.dataset == "mnist" else log.info)("MNIST unavailable (%s)",
                                                                       why)
        if world > 1:
            dist.barrier()
    files = find_mnist(args.data_dir)
    found = gather(files is not None, world)
    if files is not None and all(found):
        return load_mnist(files)
    lacking = [r for r, ok in enumerate(found) if not ok]
    where = f"{args.data_dir} on rank(s) {lacking}" if world > 1 else str(args.data_dir)
    if args.dataset == "mnist":
        raise RuntimeError(f"MNIST is not in {where}. Put the four IDX files there on every "
                           "node, or use --dataset digits")
    log.info("MNIST is not in %s: every rank uses the offline digits", where)
    return load_digits()


def build(args: argparse.Namespace,
          device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(args.seed)
    net = model().to(device)
    opt: torch.optim.Optimizer
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(net.parameters(), lr=args.lr or 0.05, momentum=args.momentum)
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=args.lr or 1e-3)
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


def run_epoch(ddp: nn.Module, opt: torch.optim.Optimizer, amp: tuple[Autocast, Any],
              x: torch.Tensor, y: torch.Tensor, order: torch.Tensor, steps: range,
              global_batch: int, rank: int, world: int,
              after_step: Callable[[int], bool]) -> tuple[torch.Tensor, int, bool]:
    """``steps`` of the epoch: step ``k`` takes global batch ``k`` of ``order``, this rank its
    ``rank::world`` share; ``after_step(k + 1)`` True stops it there. (The summed loss, still
    on the device; the samples it covers; whether it was stopped.)

    The shares differ by one sample where ``world`` does not divide ``global_batch``, so each
    rank's loss is its share's *sum* times ``world / global_batch``: DDP's average over the
    ranks is then the mean over the whole global batch, and a step is the same step on any
    world size (up to float rounding).
    """
    autocast, scaler = amp
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    weight = world / global_batch
    loss_sum = torch.zeros((), device=x.device)
    count = 0
    for k in steps:
        idx = order[k * global_batch:(k + 1) * global_batch][rank::world]
        with autocast():
            share_sum = loss_fn(ddp(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        scaler.scale(share_sum * weight).backward()
        scaler.step(opt)
        scaler.update()
        loss_sum += share_sum.detach()  # stays on the device: no sync per step
        count += len(idx)
        if after_step(k + 1):
            return loss_sum, count, True
    return loss_sum, count, False


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, local_rank, world, device, backend = setup(args.timeout)
    # Rank 0 alone logs progress; lines go to stdout so they interleave with prints in order.
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    for name in (log.name, "ptcluster.examples.mnist.data"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.propagate = False
        logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    try:
        return train(args, rank, local_rank, world, device, backend)
    finally:
        if dist.is_initialized():  # also a world of one under torchrun
            dist.destroy_process_group()


def run(argv: list[str] | None = None) -> NoReturn:
    """:func:`main`, then end the process (``end_rank``: under a launcher, without the
    interpreter's teardown); what ``python -m ptcluster.examples.mnist`` runs."""
    end_rank(main(argv))


def train(args: argparse.Namespace, rank: int, local_rank: int, world: int,
          device: torch.device, backend: str) -> int:
    data = load_data(args, local_rank, world)
    check_same_data(data, world)
    log.info("dataset=%s train=%d test=%d world_size=%d backend=%s device=%s", data.name,
             len(data.train_y), len(data.test_y), world, backend, device.type)
    net, opt = build(args, device)
    restarted = int(os.environ.get(RESTART_COUNT_VAR, "0") or 0) > 0
    start = resume(args, net, opt, data, world, device, restarted, rank) \
        if args.resume or restarted else Start(0, 0, args.batch_size * world)
    steps_per_epoch = len(data.train_y) // start.global_batch  # the last partial batch: dropped
    if steps_per_epoch < 1:
        raise ValueError(f"a global batch of {start.global_batch} is larger than the "
                         f"{len(data.train_y)} training samples: use a smaller --batch-size")
    if rank == 0:
        resumed_from(start.epoch * steps_per_epoch + start.step)
    ddp = DDP(net, device_ids=[device.index] if device.type == "cuda" else None) \
        if world > 1 else net
    if start.position is not None:
        check_in_step(net, opt, world, f"after resuming from {start.position}")
    amp = mixed_precision(args.amp, device)
    if start.scaler and amp[1].is_enabled():
        amp[1].load_state_dict(start.scaler)
    last_saved = start.position
    preempted = Preemption.install()

    def checkpoint_at(position: checkpoint.Position, global_step: int) -> bool:
        """Save (local rank 0 of every node), then: stop here, preempted? A collective."""
        nonlocal last_saved
        check_in_step(net, opt, world, f"before saving {checkpoint.path_of(Path(), position)}")
        if local_rank == 0:  # one copy per node: a node that loses its disk loses nothing
            save_training(args, position, start, world, net, opt, amp[1], data, device,
                 keep=last_saved)
            checkpoint_saved(global_step)
        last_saved = position
        if preempted.agreed(device, world):  # after the save: every node holds it
            epoch, step = position
            log.info("preempted (SIGUSR2) %s: checkpoint saved",
                     f"after epoch {epoch + 1}" if step == checkpoint.END else
                     f"in epoch {epoch + 1} after step {step}")
            preempted.requeue(rank)
            return True
        return False

    train_x, train_y = data.train_x.to(device), data.train_y.to(device)
    samples, train_time, accuracy = 0, 0.0, float("nan")
    t_start = time.perf_counter()
    every = args.checkpoint_every_steps
    for epoch in range(start.epoch, args.epochs):
        order = epoch_order(len(train_y), args.seed, epoch, device)
        first = start.step if epoch == start.epoch else 0

        def after_step(k: int, epoch: int = epoch) -> bool:
            g = epoch * steps_per_epoch + k
            return every > 0 and g % every == 0 and k < steps_per_epoch and \
                checkpoint_at((epoch, k), g)

        t0 = time.perf_counter()
        loss_sum, count, stopped = run_epoch(ddp, opt, amp, train_x, train_y, order,
                                             range(first, steps_per_epoch), start.global_batch,
                                             rank, world, after_step)
        if stopped:
            return 0
        if device.type == "cuda":
            torch.cuda.synchronize()
        train_time += time.perf_counter() - t0
        total_loss, total = all_sum([loss_sum.item(), count], device, world)
        samples += int(total)
        accuracy = evaluate(net, data, rank, world, device)
        log.info("epoch %d/%d loss=%.4f test_accuracy=%.4f time=%.2fs elapsed=%.2fs", epoch + 1,
                 args.epochs, total_loss / max(total, 1), accuracy, time.perf_counter() - t0,
                 time.perf_counter() - t_start)
        if checkpoint_at((epoch, checkpoint.END), (epoch + 1) * steps_per_epoch):
            return 0
    if world > 1:
        dist.barrier()
    print(f"rank={rank} params_sha256={params_digest(net)} start_epoch={start.epoch} "
          f"start_step={start.epoch * steps_per_epoch + start.step}", flush=True)
    if rank == 0:
        rate = samples / train_time if train_time else 0.0
        print(f"final epochs={args.epochs} test_accuracy={accuracy:.4f} "
              f"samples_per_s={rate:.1f} train_time_s={train_time:.2f} dataset={data.name} "
              f"world_size={world} backend={backend}", flush=True)
    return 0
