"""The doctor's compute probe on the 3-node testbed (2+1+1 ranks): how far apart balanced nodes
are, and how far a node capped to 25 % of a CPU stands out. Needs root (testbed, cgroup v1 cpu).

What ``doctor.compute.SLOW_NODE`` (a node's slowest rank vs the other nodes' median) must sit
between: above every balanced run's largest ratio (no false report), below the capped node's
smallest. Also the probe's cost: doctor's time with and without the all-reduce step.

    .venv/bin/python benchmarks/doctor_slow_node.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import PTCLUSTER, ROOT, show

sys.path.insert(0, str(ROOT))
from ptcluster.doctor.compute import SLOW_NODE  # noqa: E402
from tests.support.testbed import Testbed, cpu_capped  # noqa: E402


def ratios(path: Path, cwd: Path) -> dict[str, float]:
    out = subprocess.run(PTCLUSTER + ["doctor", "--cluster", str(path), "--json"], cwd=cwd,
                         capture_output=True, text=True, timeout=300)
    report = json.loads(out.stdout)
    found = {}
    for f in report["findings"]:
        if f["check"] == "compute":
            found[f["host"]] = float(f["detail"].split(", ")[1].split("x")[0])
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, Testbed(3) as bed:
        cwd = Path(tmp)
        path = cwd / "c.yaml"
        path.write_text(bed.cluster_yaml([2, 1, 1], python=sys.executable, workdir=str(cwd)))
        ratios(path, cwd)  # warm up
        balanced = [ratios(path, cwd) for _ in range(args.repeat)]
        slow = bed.nodes[2]
        with cpu_capped(slow, 25):
            capped = [ratios(path, cwd) for _ in range(args.repeat)]
    worst = max(max(r.values()) for r in balanced)
    others = max(max(v for h, v in r.items() if h != slow.name) for r in capped)
    least = min(r[slow.name] for r in capped)
    show([
        ("balanced: largest ratio of any node", f"{worst:.2f}  "
         f"{[round(max(r.values()), 2) for r in balanced]}"),
        (f"capped {slow.name}: its smallest ratio", f"{least:.2f}  "
         f"{[round(r[slow.name], 2) for r in capped]}"),
        ("capped: largest ratio of another node", f"{others:.2f}"),
        ("SLOW_NODE", f"{SLOW_NODE}  "
         f"({'between' if worst < SLOW_NODE < least else 'NOT between'})"),
    ])


if __name__ == "__main__":
    main()
