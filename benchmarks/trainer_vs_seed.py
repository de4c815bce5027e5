"""Reference trainer vs the seed recipe (benchmarks/seed_recipe.py), world size 2, same data/model.

(a) samples/s with our trainer forced to the recipe's settings (batch 64, SGD lr 0.01, no
    momentum),
    both under torchrun: target >= 1.0x (our structure adds no overhead).
(b) wall time from launch to test accuracy >= 0.90 with each one's defaults, ours under
    `ptcluster run`, the recipe under torchrun: target ours >= 3x faster.

    .venv/bin/python benchmarks/trainer_vs_seed.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import PTCLUSTER, ROOT, TORCHRUN, median, show, time_to_line

SEED = str(ROOT / "benchmarks" / "seed_recipe.py")
OURS = ["-m", "ptcluster.examples.mnist", "--dataset", "digits"]


def rate(argv: list[str], cwd: Path) -> float:
    out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=True).stdout
    return float(re.search(r"final .*samples_per_s=([\d.]+)", out).group(1))


def elapsed(line: str) -> float:
    return float(re.search(r"elapsed=([\d.]+)s", line).group(1))


def reached(line: str) -> bool:
    m = re.search(r"test_accuracy=([\d.]+)", line)
    return bool(m) and "final" not in line and float(m.group(1)) >= 0.90


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=10, help="epochs for the throughput runs")
    args = ap.parse_args()
    tr = TORCHRUN + ["--standalone", "--nproc-per-node", "2"]
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        ours_rates, seed_rates, ours_t, seed_t, ours_e, seed_e = [], [], [], [], [], []
        for _ in range(args.repeat):
            seed_rates.append(rate(tr + [SEED, "--epochs", str(args.epochs)], cwd))
            ours_rates.append(rate(tr + OURS + ["--epochs", str(args.epochs), "--batch-size",
                                                "64", "--optimizer", "sgd", "--lr", "0.01",
                                                "--momentum", "0"], cwd))
            t, line = time_to_line(tr + [SEED, "--epochs", "200"], cwd, reached)
            seed_t.append(t)
            seed_e.append(elapsed(line))
            t, line = time_to_line(PTCLUSTER + ["run", "--nproc", "2", "--run-dir", "runs"]
                                   + OURS + ["--epochs", "50"], cwd, reached)
            ours_t.append(t)
            ours_e.append(elapsed(line))
    show([
        ("(a) seed recipe samples/s (median)", f"{median(seed_rates):.0f}  {sorted(seed_rates)}"),
        ("(a) ours, recipe settings samples/s", f"{median(ours_rates):.0f}  {sorted(ours_rates)}"),
        ("(a) ratio ours/seed", f"{median(ours_rates) / median(seed_rates):.2f}  "
                                "(target >= 1.0)"),
        ("(b) seed: launch -> acc 0.90 (s)", f"{median(seed_t):.1f}  {sorted(seed_t)}"),
        ("(b) ours: launch -> acc 0.90 (s)", f"{median(ours_t):.1f}  {sorted(ours_t)}"),
        ("(b) speed-up seed/ours, launch -> 0.90", f"{median(seed_t) / median(ours_t):.2f}x  "
                                                  "(target >= 3x)"),
        ("(b) seed: training start -> 0.90 (s)", f"{median(seed_e):.2f}  {sorted(seed_e)}"),
        ("(b) ours: training start -> 0.90 (s)", f"{median(ours_e):.2f}  {sorted(ours_e)}"),
        ("(b) speed-up seed/ours, training only", f"{median(seed_e) / median(ours_e):.2f}x"),
    ])


if __name__ == "__main__":
    sys.exit(main())
