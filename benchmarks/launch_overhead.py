"""`ptcluster run --nproc 2` vs `torchrun --standalone --nproc-per-node 2` on a no-op job.

The job only does init_process_group + barrier, so the figure is launcher overhead. Runs
alternate (this machine is noisy); the ratio of medians is printed. Target: <= 1.10.

    .venv/bin/python benchmarks/launch_overhead.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _common import PTCLUSTER, TORCHRUN, median, show, timed

NOOP = """import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        (cwd / "noop.py").write_text(NOOP)
        ours = PTCLUSTER + ["run", "--nproc", "2", "--run-dir", "runs", "noop.py"]
        base = TORCHRUN + ["--standalone", "--nproc-per-node", "2", "noop.py"]
        timed(base, cwd), timed(ours, cwd)  # warm the page cache for both
        t_ours, t_base = [], []
        for _ in range(args.repeat):
            t_base.append(timed(base, cwd))
            t_ours.append(timed(ours, cwd))
    show([
        ("torchrun --standalone (median s)", f"{median(t_base):.2f}  {sorted(t_base)}"),
        ("ptcluster run (median s)", f"{median(t_ours):.2f}  {sorted(t_ours)}"),
        ("ratio ptcluster/torchrun", f"{median(t_ours) / median(t_base):.3f}  (target <= 1.10)"),
    ])


if __name__ == "__main__":
    main()
