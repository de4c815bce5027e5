"""`run --max-restarts`: time from a rank's death to the first step of the next attempt, against
a fresh launch of the same job (from `ptcluster run` to its first step); and the work lost.

The job (2 local ranks, gloo): init, then steps of one all_reduce each, a "checkpoint" (its step
in a file, reported with ``ptcluster.checkpoint_saved``) every 10 steps; in attempt 0 rank 1
SIGKILLs itself at step 25. The next attempt resumes from the file. Every step prints its wall
time, so both figures are measured on the same clock. Runs alternate. Target: restart <= 1.3x.

    .venv/bin/python benchmarks/restart.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
import time
from pathlib import Path

from _common import PTCLUSTER, median, show

JOB = """import os, signal, sys, time
import torch, torch.distributed as dist
import ptcluster
dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), os.environ["PTCLUSTER_ATTEMPT"]
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
LINE = re.compile(r"\] (step=(\d+) attempt=(\d+)|dying) t=([\d.]+)")


def run(cwd: Path, kill: bool) -> tuple[float, int]:
    """(seconds: launch -> first step, or death -> first step of attempt 1; steps lost)."""
    (cwd / "ckpt").unlink(missing_ok=True)
    argv = PTCLUSTER + ["run", "--nproc", "2", "--run-dir", "runs", "--max-restarts", "1",
                        "job.py"] + (["kill"] if kill else [])
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
        elif first is None and m.group(3) == ("1" if kill else "0"):
            first, resumed = t, int(m.group(2)) - 1
    assert first is not None, proc.stdout[-2000:]
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
        for _ in range(args.repeat):
            fresh.append(run(cwd, kill=False)[0])
            took, steps = run(cwd, kill=True)
            restart.append(took)
            lost.append(steps)
    show([
        ("fresh launch -> first step (median s)", f"{median(fresh):.2f}  {sorted(fresh)}"),
        ("death -> first step of attempt 1 (median s)",
         f"{median(restart):.2f}  {sorted(restart)}"),
        ("ratio restart / fresh (target <= 1.3)", f"{median(restart) / median(fresh):.2f}"),
        ("steps lost (checkpoint every 10, killed at 25)", f"{sorted(lost)}"),
    ])


if __name__ == "__main__":
    main()
