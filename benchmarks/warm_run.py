"""`ptcluster run --warm --nproc 2` (a warm pool already up) vs `torchrun --standalone
--nproc-per-node 2` (and the cold `ptcluster run`): seconds from the command to the first rank's
first line, for a script that imports torch first, as training scripts do. Runs alternate (this
machine is noisy); the ratio of medians is printed. Target (issue 45): warm <= 0.4x torchrun,
with the same rank output as a cold run (checked once, whole runs).

    .venv/bin/python benchmarks/warm_run.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from _common import PTCLUSTER, TORCHRUN, median, show, time_to_line

SCRIPT = """import os
import torch
print("rank", os.environ["RANK"], "first line, torch", torch.__version__, flush=True)
"""


def first_line(line: str) -> bool:
    return "first line" in line


def rank_output(argv: list[str], cwd: Path, env: dict[str, str]) -> list[str]:
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(argv)}\n{proc.stderr[-2000:]}")
    return sorted(line for line in proc.stdout.splitlines() if line.startswith("["))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir="/tmp") as run:
        cwd = Path(tmp)
        (cwd / "first.py").write_text(SCRIPT)
        env = {**os.environ, "XDG_RUNTIME_DIR": run}  # (this benchmark's own pool)
        os.environ["XDG_RUNTIME_DIR"] = run
        cold = PTCLUSTER + ["run", "--nproc", "2", "--run-dir", "runs", "first.py"]
        warm = PTCLUSTER + ["run", "--nproc", "2", "--warm", "--run-dir", "runs", "first.py"]
        base = TORCHRUN + ["--standalone", "--nproc-per-node", "2", "first.py"]
        try:
            same = rank_output(warm, cwd, env) == rank_output(cold, cwd, env)  # (pool up)
            t_base, t_warm, t_cold = [], [], []
            for _ in range(args.repeat):
                t_base.append(time_to_line(base, cwd, first_line)[0])
                t_warm.append(time_to_line(warm, cwd, first_line)[0])
                t_cold.append(time_to_line(cold, cwd, first_line)[0])
        finally:
            subprocess.run(PTCLUSTER + ["warm", "stop"], cwd=cwd, env=env, capture_output=True)
    rows = [
        ("torchrun --standalone (median s)", f"{median(t_base):.2f}  {sorted(t_base)}"),
        ("ptcluster run --warm (median s)", f"{median(t_warm):.2f}  {sorted(t_warm)}"),
        ("ptcluster run, cold (median s)", f"{median(t_cold):.2f}  {sorted(t_cold)}"),
        ("ratio warm/torchrun", f"{median(t_warm) / median(t_base):.3f}  (target <= 0.4)"),
        ("ratio cold/torchrun", f"{median(t_cold) / median(t_base):.3f}"),
        ("rank output warm == cold", str(same)),
    ]
    show(rows)


if __name__ == "__main__":
    main()
