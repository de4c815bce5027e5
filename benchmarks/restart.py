"""`run --max-restarts`: time from a rank's death to the first step of the next attempt, against
a fresh launch of the same job (from `ptcluster run` to its first step); and the work lost.

The job (2 local ranks, gloo): init, then steps of one all_reduce each, a "checkpoint" (its step
in a file, reported with ``ptcluster.checkpoint_saved``) every 10 steps; in attempt 0 rank 1
SIGKILLs itself at step 25. The next attempt resumes from the file. Every step prints its wall
time, so both figures are measured on the same clock. Runs alternate. Target: restart <= 1.3x.

Each twice: as by default, where the restart's ranks are forked from the job's own warm pool
(issue 45: <= 0.5x a fresh launch), and with ``--cold`` (no pool: torchrun starts every
attempt's ranks), side by side; the summary's ``warm`` of each
attempt is checked.

    .venv/bin/python benchmarks/restart.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import PTCLUSTER, median, show

JOB = """import os, signal, sys, time
import torch, torch.distributed as dist
import ptcluster
dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), os.environ.get(
    "PTCLUSTER_ATTEMPT", os.environ.get("TORCHELASTIC_RESTART_COUNT"))
start = int(open("ckpt").read()) if os.path.exists("ckpt") and attempt != "0" else 0
if rank == 0:
    ptcluster.resumed_from(start)
for step in range(start + 1, 41):
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"step={step} attempt={attempt} t={time.time():.6f}", flush=True)
    if step % 10 == 0 and rank == 0:
        open("ckpt", "w").write(str(step))
        ptcluster.checkpoint_saved(step)
    if step == 25 and attempt == "0" and rank == 1 and len(sys.argv) > 1:
        print(f"dying t={time.time():.6f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.02)
dist.destroy_process_group()
"""
TORCHRUN_ATTEMPTS: list[int] = []
"""The attempt of each torchrun restart that stepped first (1: its first restart worked)."""
LINE = re.compile(r"(?:\] |^)(step=(\d+) attempt=(\d+)|dying) t=([\d.]+)", re.M)


def torchrun_argv() -> list[str]:
    """Plain torchrun, elastic: c10d rendezvous on a free local port, up to 3 restarts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
            "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--max-restarts", "3", "--monitor-interval", "0.1"]


def run(cwd: Path, kill: bool, cold: bool = False, torchrun: bool = False) -> tuple[float, int]:
    """(seconds: launch -> first step, or death -> first step of attempt 1; steps lost); with
    the job's warm pool, or ``cold`` (``--cold``: none), or under plain ``torchrun`` (the first
    attempt after the death that steps: ``TORCHRUN_ATTEMPTS`` gets its number)."""
    (cwd / "ckpt").unlink(missing_ok=True)
    runs = cwd / "runs"
    before = set(runs.glob("*/summary.json"))
    argv = (torchrun_argv() if torchrun else PTCLUSTER + [
        "run", "--nproc", "2", "--run-dir", "runs", "--max-restarts", "1",
        *(["--cold"] if cold else [])]) + ["job.py"] + (["kill"] if kill else [])
    t0 = time.time()
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-2000:]}")
    died, first, resumed = None, None, None
    for m in LINE.finditer(proc.stdout):
        t = float(m.group(4))
        if m.group(1) == "dying":
            died = t
        elif first is None and (m.group(3) != "0" if kill else m.group(3) == "0"):
            first, resumed = t, int(m.group(2)) - 1
            if torchrun:
                TORCHRUN_ATTEMPTS.append(int(m.group(3)))
    assert first is not None, proc.stdout[-2000:]
    if torchrun:
        assert died is not None and resumed is not None, proc.stdout[-2000:]
        return first - died, 25 - resumed
    (new,) = set(runs.glob("*/summary.json")) - before
    warm = [a["warm"] for a in json.loads(new.read_text())["attempts"]]
    assert warm[1:] == [{"localhost": not cold}] * (len(warm) - 1), warm
    if not kill:
        return first - t0, 0
    assert died is not None and resumed is not None
    return first - died, 25 - resumed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        (cwd / "job.py").write_text(JOB)
        run(cwd, kill=False)  # warm the page cache
        fresh, restart, lost = [], [], []
        fresh_cold, restart_cold, restart_torchrun = [], [], []
        for _ in range(args.repeat):
            fresh.append(run(cwd, kill=False)[0])
            fresh_cold.append(run(cwd, kill=False, cold=True)[0])
            took, steps = run(cwd, kill=True)
            restart.append(took)
            lost.append(steps)
            took, steps = run(cwd, kill=True, cold=True)
            restart_cold.append(took)
            lost.append(steps)
            took, steps = run(cwd, kill=True, torchrun=True)
            restart_torchrun.append(took)
            lost.append(steps)
    pooled, cold = median(restart), median(restart_cold)
    show([
        ("fresh launch -> first step (median s)", f"{median(fresh):.2f}  {sorted(fresh)}"),
        ("fresh launch, --cold (median s)", f"{median(fresh_cold):.2f}  {sorted(fresh_cold)}"),
        ("death -> first step of attempt 1, job's pool (median s)",
         f"{pooled:.2f}  {sorted(restart)}"),
        ("death -> first step of attempt 1, --cold (median s)",
         f"{cold:.2f}  {sorted(restart_cold)}"),
        ("ratio restart / fresh: pool, cold (targets <= 0.5, <= 1.3)",
         f"{pooled / median(fresh):.2f}  {cold / median(fresh):.2f}"),
        ("death -> first step after it, torchrun --max-restarts 3, c10d (median s)",
         f"{median(restart_torchrun):.2f}  {sorted(restart_torchrun)}"),
        ("torchrun: restarts that needed more than one attempt",
         f"{sum(a > 1 for a in TORCHRUN_ATTEMPTS)} of {len(TORCHRUN_ATTEMPTS)} "
         f"(attempts {TORCHRUN_ATTEMPTS})"),
        ("ratio restart pool / restart cold", f"{pooled / cold:.2f}"),
        ("ratio restart pool / torchrun's restart (target <= 0.5)",
         f"{pooled / median(restart_torchrun):.2f}"),
        ("ratio fresh / fresh --cold (the pool's start, at nice 10)",
         f"{median(fresh) / median(fresh_cold):.2f}"),
        ("steps lost (checkpoint every 10, killed at 25)", f"{sorted(lost)}"),
    ])


if __name__ == "__main__":
    main()
