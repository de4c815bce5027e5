"""`ptcluster bench` vs a bare torch.distributed timing loop: 4 MiB all_reduce, 2 local ranks.

Both: gloo, 5 warm-ups, 50 timed iterations, time averaged over ranks; the bare loop runs under
`torchrun --standalone`. Alternating runs; prints the median time of each and their ratio.
Target: within +-10%.

    .venv/bin/python benchmarks/bench_vs_reference.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path

from _common import PTCLUSTER, TORCHRUN, median, show

BARE = """import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
x = torch.ones(1 << 20)
for _ in range(5):
    dist.all_reduce(x)
dist.barrier()
t0 = time.perf_counter()
for _ in range(50):
    dist.all_reduce(x)
t = torch.tensor([(time.perf_counter() - t0) / 50], dtype=torch.float64)
dist.all_reduce(t)
if dist.get_rank() == 0:
    print(f"bare_us={t.item() / dist.get_world_size() * 1e6:.2f}", flush=True)
dist.destroy_process_group()
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    ours, bare = [], []
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        (cwd / "bare.py").write_text(BARE)
        for _ in range(args.repeat):
            out = subprocess.run(TORCHRUN + ["--standalone", "--nproc-per-node", "2", "bare.py"],
                                 cwd=cwd, capture_output=True, text=True, check=True).stdout
            bare.append(float(re.search(r"bare_us=([\d.]+)", out).group(1)))
            out = subprocess.run(PTCLUSTER + ["bench", "--nproc", "2", "-b", "4M", "-e", "4M",
                                              "-n", "50", "-w", "5", "-c", "0", "--json"],
                                 cwd=cwd, capture_output=True, text=True, check=True).stdout
            ours.append(json.loads(out)["rows"][0]["time_us"])
    show([
        ("bare loop, 4 MiB all_reduce (median us)", f"{median(bare):.0f}  {sorted(bare)}"),
        ("ptcluster bench (median us)", f"{median(ours):.0f}  {sorted(ours)}"),
        ("ratio ptcluster/bare", f"{median(ours) / median(bare):.3f}  (target 0.90..1.10)"),
    ])


if __name__ == "__main__":
    main()
