"""Preemption: on SIGUSR2, stop after the next checkpoint and ask Slurm to run the job again.

Slurm warns a job before it ends it (``sbatch --signal=USR2@120``, which ``ptcluster submit``
asks for, or ``scancel -s USR2`` by hand): every rank gets SIGUSR2. The handler only sets a
flag; after each epoch's checkpoint the ranks agree on it with one all-reduce (a rank that got
the signal a moment later must not enter the next epoch alone), and when any rank was signalled
they all stop. Inside a Slurm job rank 0 then runs ``scontrol requeue``: Slurm ends this run and
queues the job again, whose ``--resume`` continues after the checkpoint just written.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from types import FrameType

import torch
import torch.distributed as dist

log = logging.getLogger("ptcluster.examples.mnist")


class Preemption:
    """Install with :meth:`install`; ask :meth:`agreed` after every checkpoint."""

    def __init__(self) -> None:
        self.signalled = False

    @classmethod
    def install(cls) -> Preemption:
        self = cls()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR2, self._handler)
        return self

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = True  # only a flag: the training loop decides when to stop

    def agreed(self, device: torch.device, world: int) -> bool:
        """True on every rank when any rank was signalled. A collective: every rank calls it."""
        flag = torch.tensor([1.0 if self.signalled else 0.0], device=device)
        if world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def requeue(self, rank: int) -> str:
        """Rank 0 asks Slurm to requeue this job; what happened, for the log."""
        job = os.environ.get("SLURM_JOB_ID")
        if not job:
            return "not a Slurm job: stopping (run again with --resume)"
        if rank != 0:
            return f"rank 0 requeues Slurm job {job}"
        try:
            proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True,
                                  timeout=30)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"scontrol requeue {job} failed: {exc}"
        if proc.returncode != 0:
            return f"scontrol requeue {job} failed: {proc.stderr.strip()}"
        return f"Slurm job {job} requeued"
