"""`ptcluster doctor` on 1 vs 3 (and 8) testbed nodes. Needs root (it builds the testbed).

Target: 3 nodes <= 1.5x one node. Each node pays for one torch import in the probe (plus the
all-reduce job's torchrun and ranks, unless --skip-allreduce).

    .venv/bin/python benchmarks/doctor_scaling.py [--repeat 3] [--max-nodes 8] [--skip-allreduce]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from _common import PTCLUSTER, ROOT, median, show, timed

sys.path.insert(0, str(ROOT))
from tests.testbed import Testbed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-nodes", type=int, default=8)
    ap.add_argument("--skip-allreduce", action="store_true")
    args = ap.parse_args()
    counts = [k for k in (1, 3, 8) if k <= args.max_nodes]
    extra = ["--skip-allreduce"] if args.skip_allreduce else []
    times: dict[int, list[float]] = {k: [] for k in counts}
    with tempfile.TemporaryDirectory() as tmp, Testbed(max(counts)) as bed:
        cwd = Path(tmp)
        files = {}
        for k in counts:
            files[k] = cwd / f"c{k}.yaml"
            files[k].write_text(bed.cluster_yaml([1] * k, python=sys.executable,
                                                 workdir=str(cwd)))
        timed(PTCLUSTER + ["doctor", "--cluster", str(files[1])] + extra, cwd)  # warm up
        for _ in range(args.repeat):
            for k in counts:
                times[k].append(timed(PTCLUSTER + ["doctor", "--cluster", str(files[k])]
                                      + extra, cwd))
    rows = [(f"{k} node(s) (median s)", f"{median(times[k]):.2f}  {sorted(times[k])}")
            for k in counts]
    if 3 in times:
        rows.append(("ratio 3/1", f"{median(times[3]) / median(times[1]):.2f}  (target <= 1.5)"))
    if 8 in times:
        rows.append(("ratio 8/1", f"{median(times[8]) / median(times[1]):.2f}"))
    show(rows)


if __name__ == "__main__":
    main()
