"""The straggler report on the 3-node testbed (1+1+1 ranks, a real DDP job over gloo,
``tests/programs/straggler_job.py``): how far apart balanced ranks are, how far a rank on a node
capped to a share of a CPU stands out, and after how many of rank 0's steps it is named. Needs root
(testbed, cgroup v1 cpu).

The measure (``node.guard.schedstat``, ``launch.supervise.straggler``): each rank's main-thread
wait share from ``/proc/PID/task/PID/schedstat`` in its guard; the ratio is a rank's busy share
(1 - wait share) over the other ranks' median, per evaluation (every 2 s, windows of 6 s). What
``DEFAULT_THRESHOLD`` must sit between: above every balanced run's peak (no false report), below
what the capped rank keeps.

    PYTHONPATH=src .venv/bin/python benchmarks/straggler_threshold.py [--balanced 5] [--capped 3]
        [--percent 25] [--seconds 25] [--threshold X]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import ROOT, show

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))
from ptcluster.launch.supervise.straggler import DEFAULT_THRESHOLD  # noqa: E402
from tests.support.testbed import Testbed, cpu_capped  # noqa: E402

JOB = ROOT / "tests" / "programs" / "straggler_job.py"


def run_job(cluster: Path, cwd: Path, seconds: float, *extra: str) -> dict:
    """One job: its summary's straggler part, rank 0's step times, steps/s, console lines."""
    runs = cwd / f"runs-{os.urandom(4).hex()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-m", "ptcluster", "run", "--cluster", str(cluster),
                           "--run-dir", str(runs), *extra, str(JOB), "--seconds", str(seconds)],
                          cwd=cwd, capture_output=True, text=True, timeout=600, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"job failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    (run_dir,) = list(runs.iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [float(m.group(1)) for line in (run_dir / "rank0.log").read_text().splitlines()
             if (m := re.search(r"step \d+ t=([\d.]+)", line))]
    rate = next(float(line.split()[-1]) for line in proc.stdout.splitlines()
                if "steps_per_s" in line)
    return {"straggler": summary["straggler"], "steps": steps, "steps_per_s": rate,
            "console": [line for line in proc.stderr.splitlines() if "straggler" in line]}


def ratios(job: dict, rank: int) -> list[float]:
    """``rank``'s ratio at every evaluation of the run."""
    return [t["ratios"][str(rank)] for t in job["straggler"]["trace"]
            if str(rank) in t["ratios"]]


def spread(values: list[float]) -> str:
    if not values:
        return "no evaluation"
    q = statistics.quantiles(values, n=10) if len(values) > 1 else values * 9
    return (f"n={len(values)} min {min(values):.2f} p10 {q[0]:.2f} median "
            f"{statistics.median(values):.2f} max {max(values):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--balanced", type=int, default=5, help="balanced runs")
    ap.add_argument("--capped", type=int, default=3, help="runs with one node capped")
    ap.add_argument("--seconds", type=float, default=25.0)
    ap.add_argument("--percent", type=int, default=25, help="the capped node's CPU share")
    ap.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD)
    args = ap.parse_args()
    extra = ("--straggler-threshold", str(args.threshold))
    with tempfile.TemporaryDirectory(dir=ROOT.parent) as tmp, Testbed(3) as bed:
        cwd = Path(tmp)
        path = cwd / "c.yaml"
        path.write_text(bed.cluster_yaml([1, 1, 1], python=sys.executable, workdir=str(cwd)))
        balanced = [run_job(path, cwd, args.seconds, *extra) for _ in range(args.balanced)]
        slow = bed.nodes[2]
        with cpu_capped(slow, args.percent):
            capped = [run_job(path, cwd, args.seconds, *extra) for _ in range(args.capped)]
    rows = []
    peaks = []
    for i, job in enumerate(balanced):
        s = job["straggler"]
        every = [r for rank in (0, 1, 2) for r in ratios(job, rank)]
        peaks.append(max(every, default=0.0))
        rows.append((f"balanced #{i}", f"every rank's ratio: {spread(every)}; reports "
                     f"{len(s['history'])}; wait shares {[r['wait_share_job'] for r in s['ranks']]}"
                     f"; {job['steps_per_s']:.1f} steps/s"))
    lows = []
    for i, job in enumerate(capped):
        s = job["straggler"]
        mine = ratios(job, 2)
        others = [r for rank in (0, 1) for r in ratios(job, rank)]
        lows.append(min(mine, default=0.0))
        first = s["history"][0] if s["history"] else None
        rows.append((f"capped {args.percent}% #{i}: rank 2", spread(mine)))
        rows.append((f"capped #{i}: ranks 0,1", spread(others)))
        rows.append((f"capped #{i}: wait shares",
                     f"{[(r['rank'], r['wait_share_job']) for r in s['ranks']]}, "
                     f"{job['steps_per_s']:.1f} steps/s"))
        rows.append((f"capped #{i}: first report", "none" if first is None else
                     f"ranks {first['ranks']} after {sum(t < first['at'] for t in job['steps'])}"
                     f" of rank 0's {len(job['steps'])} steps, "
                     f"{first['at'] - job['steps'][0]:.1f} s after its first; changes "
                     f"{len(s['history'])}"))
        rows.append((f"capped #{i}: console", " | ".join(job["console"]) or "-"))
    rows.append(("balanced: peak ratio per run", f"{[round(p, 2) for p in peaks]}"))
    rows.append(("capped: rank 2's lowest ratio per run", f"{[round(x, 2) for x in lows]}"))
    rows.append(("threshold used", str(args.threshold)))
    show(rows)


if __name__ == "__main__":
    main()
