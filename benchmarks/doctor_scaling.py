"""`ptcluster doctor` on 1 vs 3 (and 8) testbed nodes. Needs root (it builds the testbed).

Target (with --skip-allreduce): 3 nodes <= 1.3x one node, and under 2.5 s. The probe imports
no torch (that is the all-reduce's job), so what each node adds is mostly its ssh connection:
the "ssh only" rows time k parallel `ssh node true` on the same testbed, the floor doctor
cannot go below. On the testbed every node's sshd shares the head's CPUs, so these rows also
show how much of the scaling is the testbed's, not doctor's.

    .venv/bin/python benchmarks/doctor_scaling.py [--repeat 3] [--max-nodes 8] [--skip-allreduce]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from _common import PTCLUSTER, ROOT, median, show, ssh_only, timed

sys.path.insert(0, str(ROOT))
from tests.support.testbed import Testbed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-nodes", type=int, default=8)
    ap.add_argument("--skip-allreduce", action="store_true")
    args = ap.parse_args()
    counts = [k for k in (1, 3, 8) if k <= args.max_nodes]
    extra = ["--skip-allreduce"] if args.skip_allreduce else []
    times: dict[int, list[float]] = {k: [] for k in counts}
    ssh: dict[int, list[float]] = {k: [] for k in counts}
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
                ssh[k].append(ssh_only(bed, k))
    rows = [(f"{k} node(s) (median s)", f"{median(times[k]):.2f}  "
             f"{[round(t, 2) for t in sorted(times[k])]}") for k in counts]
    rows += [(f"{k} node(s) ssh only", f"{median(ssh[k]):.2f}") for k in counts]
    if 3 in times:
        target = "  (target <= 1.3, and 3 nodes < 2.5 s)" if args.skip_allreduce else ""
        rows.append(("ratio 3/1", f"{median(times[3]) / median(times[1]):.2f}{target}"))
        rows.append(("ratio 3/1 ssh only", f"{median(ssh[3]) / median(ssh[1]):.2f}"))
    if 8 in times:
        rows.append(("ratio 8/1", f"{median(times[8]) / median(times[1]):.2f}"))
    show(rows)


if __name__ == "__main__":
    main()
