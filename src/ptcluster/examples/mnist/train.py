"""DDP MNIST, done right. The seed recipe's job, without its bugs.

    1 process:         python -m ptcluster.examples.mnist
    this machine:      ptcluster run -m ptcluster.examples.mnist          (2 CPU ranks or 1/GPU)
    a cluster:         ptcluster run --cluster cluster.yaml -m ptcluster.examples.mnist
    same, by hand:     torchrun --nnodes 2 --node-rank I --nproc-per-node G \\
                           --master-addr HEAD --master-port 29500 -m ptcluster.examples.mnist

What the classic recipe gets wrong and this does not:
- the device comes from LOCAL_RANK; ``torch.cuda.set_device(rank)`` with the global rank breaks
  on every node after the first;
- a DistributedSampler with ``set_epoch`` (otherwise every epoch sees the same order);
- the logged loss is averaged over all ranks, not rank 0's shard;
- test accuracy covers the whole test set, split across ranks and summed;
- no ``loss.item()`` per step (a CPU-GPU sync point): losses are summed on the device;
- checkpoints are written to a temporary file and renamed (a crash never leaves half a file);
- gloo on CPU and NCCL on GPU chosen automatically; bf16 (or fp16) autocast on GPU.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from ptcluster.examples.mnist.data import Dataset, find_mnist, load_dataset

log = logging.getLogger("ptcluster.examples.mnist")
CHECKPOINT = "checkpoint.pt"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ptcluster.examples.mnist",
                                description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--lr", type=float, default=None,
                   help="default: 1e-3 for adamw, 0.05 for sgd")
    p.add_argument("--momentum", type=float, default=0.9, help="sgd only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", type=Path, default=Path("data"))
    p.add_argument("--dataset", choices=("auto", "mnist", "digits"), default="auto",
                   help="auto: MNIST when its files are there or can be downloaded, else digits")
    p.add_argument("--no-download", action="store_true", help="never touch the network")
    p.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--amp", choices=("auto", "bf16", "fp16", "off"), default="auto",
                   help="autocast on GPU (auto: bf16 where supported, else fp16)")
    return p.parse_args(argv)


def model() -> nn.Module:
    # The recipe's model, so benchmarks compare loops, not architectures.
    return nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))


def setup() -> tuple[int, int, int, torch.device, str]:
    """(rank, local_rank, world_size, device, backend); a plain run is a world of one."""
    if "RANK" not in os.environ:
        device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
        return 0, 0, 1, device, "none"
    local_rank = int(os.environ["LOCAL_RANK"])
    backend = os.environ.get("PTCLUSTER_BACKEND", "auto")
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)  # LOCAL_RANK, never the global rank
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    return dist.get_rank(), local_rank, dist.get_world_size(), device, backend


def all_sum(values: list[float], device: torch.device, world: int) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(t)
    return t.tolist()


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


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write then rename: a crash mid-write leaves the previous checkpoint intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)


def params_digest(net: nn.Module) -> str:
    h = hashlib.sha256()
    for p in net.parameters():
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def load_data(args: argparse.Namespace, local_rank: int, world: int) -> Dataset:
    may_download = (args.dataset != "digits" and not args.no_download
                    and find_mnist(args.data_dir) is None)
    if not may_download:  # nothing to fetch: every rank reads at once
        return load_dataset(args.dataset, args.data_dir, download=False)
    # One download per node (local rank 0); the others wait, then read the files.
    if local_rank == 0:
        data = load_dataset(args.dataset, args.data_dir, download=True)
    if world > 1:
        dist.barrier()
    if local_rank != 0:
        data = load_dataset(args.dataset, args.data_dir, download=False)
    return data


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, local_rank, world, device, backend = setup()
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
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def train(args: argparse.Namespace, rank: int, local_rank: int, world: int,
          device: torch.device, backend: str) -> int:
    data = load_data(args, local_rank, world)
    if world > 1:  # every rank must train on the same data set
        names = [None] * world
        dist.all_gather_object(names, data.name)
        if len(set(names)) != 1:
            raise RuntimeError(f"ranks loaded different data sets {names}: put the MNIST files "
                               "on every node, or pass --dataset digits")
    log.info("dataset=%s train=%d test=%d world_size=%d backend=%s device=%s", data.name,
             len(data.train_y), len(data.test_y), world, backend, device.type)

    torch.manual_seed(args.seed)
    net = model().to(device)
    opt: torch.optim.Optimizer
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(net.parameters(), lr=args.lr or 0.05, momentum=args.momentum)
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=args.lr or 1e-3)
    start_epoch = 0
    ckpt_path = args.checkpoint_dir / CHECKPOINT
    if args.resume and ckpt_path.is_file():
        state = torch.load(ckpt_path, map_location=device)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
        log.info("resumed from %s: continuing at epoch %d", ckpt_path, start_epoch + 1)
    elif args.resume:
        log.info("no checkpoint at %s: starting fresh", ckpt_path)
    ddp = DDP(net, device_ids=[device.index] if device.type == "cuda" else None) \
        if world > 1 else net

    use_amp = device.type == "cuda" and args.amp != "off"
    amp_dtype = torch.bfloat16 if args.amp == "bf16" or (
        args.amp == "auto" and use_amp and torch.cuda.is_bf16_supported()) else torch.float16
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp and amp_dtype == torch.float16)
    autocast = (lambda: torch.autocast("cuda", dtype=amp_dtype)) if use_amp else nullcontext

    train_x, train_y = data.train_x.to(device), data.train_y.to(device)
    # The sampler only needs len(); indices into the in-memory tensors are all we take from it.
    sampler: DistributedSampler[int] = DistributedSampler(
        cast(Any, range(len(train_y))), num_replicas=world, rank=rank, shuffle=True,
        seed=args.seed)
    loss_fn = nn.CrossEntropyLoss()
    samples, train_time, accuracy = 0, 0.0, float("nan")
    t_start = time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        order = torch.tensor(list(sampler), device=device)
        loss_sum = torch.zeros((), device=device)
        t0 = time.perf_counter()
        for i in range(0, len(order), args.batch_size):
            idx = order[i:i + args.batch_size]
            with autocast():
                loss = loss_fn(ddp(train_x[idx]), train_y[idx])
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            loss_sum += loss.detach() * len(idx)  # stays on the device: no sync per step
        if device.type == "cuda":
            torch.cuda.synchronize()
        train_time += time.perf_counter() - t0
        samples += len(order) * world
        total_loss, count = all_sum([loss_sum.item(), len(order)], device, world)
        accuracy = evaluate(net, data, rank, world, device)
        log.info("epoch %d/%d loss=%.4f test_accuracy=%.4f time=%.2fs elapsed=%.2fs", epoch + 1,
                 args.epochs, total_loss / count, accuracy, time.perf_counter() - t0,
                 time.perf_counter() - t_start)
        if rank == 0:
            save_checkpoint(ckpt_path, {"model": net.state_dict(), "optimizer": opt.state_dict(),
                                        "epoch": epoch, "dataset": data.name})
    if world > 1:
        dist.barrier()
    print(f"rank={rank} params_sha256={params_digest(net)}", flush=True)
    if rank == 0:
        rate = samples / train_time if train_time else 0.0
        print(f"final epochs={args.epochs} test_accuracy={accuracy:.4f} "
              f"samples_per_s={rate:.1f} train_time_s={train_time:.2f} dataset={data.name} "
              f"world_size={world} backend={backend}", flush=True)
    return 0
