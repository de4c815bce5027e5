"""What ``ptcluster.checkpoint.save`` costs a training loop: a 256 MiB state (DDP-replicated, as
every rank holds it) on 3 "nodes" x 1 rank on this machine (gloo; each node its own
checkpoint root, ``PTCLUSTER_CKPT_ROOT``, on the same disk). Printed, medians of ``--saves``:

* the time ``save()`` takes to return (the copy to host memory), against a synchronous
  ``torch.save`` of the same state to the same disk with fsync (rank 0, the others waiting);
  target: ratio <= 0.25;
* the training steps' slowdown while the background write and replication run (a step: a few
  256x256 matmuls and an all-reduce, as DDP's), against steps with no save running;
* how long the background part takes (DCP write, hashes, replication to the next node, marker):
  it must end before the next save at a save every 30 s.

    .venv/bin/python benchmarks/checkpoint_cost.py [--saves 3] [--mib 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NODES = 3


def launch(args: argparse.Namespace) -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(dir=ROOT.parent) as tmp:
        procs = []
        for rank in range(NODES):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(NODES),
                   "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": "1", "PTCLUSTER_CKPT_ROOT": f"{tmp}/node{rank}",
                   "PYTHONPATH": str(ROOT / "src")}
            procs.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:]], env=env,
                                          stdout=None if rank == 0 else subprocess.DEVNULL))
        codes = [p.wait() for p in procs]
    return max(codes)


def step(a, flag: float) -> float:
    """One training-like step: compute, then an all-reduce that also carries rank 0's flag."""
    import torch
    import torch.distributed as dist

    for _ in range(4):
        a = torch.tanh(a @ a.T / a.shape[0])
    t = torch.tensor([float(a.sum()), flag])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[1])


def steps_while(running: threading.Event | None, a, n: int = 0) -> list[float]:
    """Step times: ``n`` steps, or (``running``) until rank 0 sees the save's thread done."""
    import torch.distributed as dist

    times = []
    while True:
        t0 = time.perf_counter()
        flag = 1.0 if running is not None and dist.get_rank() == 0 and \
            not running.is_set() else 0.0
        done = step(a, flag)
        times.append(time.perf_counter() - t0)
        if (running is None and len(times) >= n) or (running is not None and done):
            return times


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import ptcluster.checkpoint as ckpt
    from ptcluster.checkpoint import saver

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    numel = args.mib * 2**20 // 4 // 8
    state = {f"w{i}": torch.randn(numel) for i in range(8)}
    a = torch.randn(256, 256)
    sync = []
    for _ in range(args.saves):
        dist.barrier()
        if rank == 0:
            path = Path(os.environ["PTCLUSTER_CKPT_ROOT"]) / "sync.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            sync.append(time.perf_counter() - t0)
            path.unlink()
    quiet = steps_while(None, a, n=40)
    returned, background, busy = [], [], []
    for i in range(args.saves):
        dist.barrier()
        t0 = time.perf_counter()
        ckpt.save(state, i + 1, "ckpt", keep=2)
        returned.append(time.perf_counter() - t0)
        thread, ended = saver.PENDING.thread, threading.Event()
        assert thread is not None

        def watch(thread: threading.Thread = thread, ended: threading.Event = ended,
                  t0: float = t0) -> None:
            thread.join()
            background.append(time.perf_counter() - t0)
            ended.set()

        threading.Thread(target=watch, daemon=True).start()
        busy += steps_while(_while_not(ended), a)
        ckpt.wait()
    if rank == 0:
        r, s = statistics.median(returned), statistics.median(sync)
        q, b = statistics.median(quiet), statistics.median(busy)
        bg = statistics.median(background)
        print(f"state: {args.mib} MiB on {NODES} nodes x 1 rank (gloo), {args.saves} saves")
        print(f"save() returns in (median):           {r:.3f} s")
        print(f"torch.save + fsync, same state, disk: {s:.3f} s")
        print(f"ratio save()/torch.save:              {r / s:.3f}  (target <= 0.25)")
        print(f"step time, no save running (median):  {q * 1e3:.1f} ms")
        print(f"step time, save in background:        {b * 1e3:.1f} ms  ({b / q:.2f}x)")
        print(f"background (write+replicate+marker):  {bg:.2f} s  (a save every 30 s: "
              f"{'done before the next' if bg < 30 else 'NOT done before the next'})")
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _while_not(ended: threading.Event) -> threading.Event:
    """An event that is set until ``ended`` is (``steps_while`` stops when rank 0 sees it
    clear)."""

    class Running(threading.Event):
        def is_set(self) -> bool:
            return not ended.is_set()

    return Running()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--mib", type=int, default=256)
    args = ap.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
