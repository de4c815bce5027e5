"""Preemption: on SIGUSR2, stop after the next checkpoint and ask Slurm to run the job again.

Slurm warns a job before it ends it (``sbatch --signal=USR2@120``, which ``ptcluster submit``
asks for, or ``scancel -s USR2`` by hand): every rank gets SIGUSR2. The handler only sets a
flag; after each checkpoint (every epoch, and every ``--checkpoint-every-steps``) the ranks
agree on it with one all-reduce (a rank that got the signal a moment later must not go on
alone), and when any rank was signalled they all stop. Inside a Slurm job rank 0 then runs
``scontrol requeue``: Slurm ends this run and queues the job again, whose ``--resume``
continues after the checkpoint just written.
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

    def requeue(self, rank: int) -> None:
        """Rank 0 asks Slurm to requeue this job (said before it is asked: Slurm ends the run
        at once, and the line must be on its way by then)."""
        job = os.environ.get("SLURM_JOB_ID")
        if rank != 0:
            return
        if not job:
            log.info("not a Slurm job: stopping here (run again with --resume)")
            return
        log.info("requeueing Slurm job %s (scontrol requeue)", job)
        try:
            proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True,
                                  timeout=30)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("scontrol requeue %s failed: %s", job, exc)
            return
        if proc.returncode != 0:  # e.g. an interactive allocation: only batch jobs requeue
            log.warning("scontrol requeue %s failed: %s", job, proc.stderr.strip())
