"""What the straggler report costs a job: steps/s of a balanced DDP job (gloo, 3 testbed nodes x
1 rank, ``tests/programs/straggler_job.py``) with the guards' timing frames (the default) and
without them (``PTCLUSTER_STRAGGLER: "0"`` in ``env:``), runs alternated, medians compared. Target
>= 0.98x. The measure runs in the guards only (/proc every 2 s): nothing in the ranks changes.
Needs root (testbed).

    PYTHONPATH=src .venv/bin/python benchmarks/straggler_cost.py [--repeat 4] [--seconds 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, show
from straggler_threshold import run_job

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))
from ptcluster.node.guard.schedstat import SchedstatMeter  # noqa: E402
from ptcluster.node.wire import Kind, encode  # noqa: E402
from tests.support.testbed import Testbed  # noqa: E402


def guard_work(ranks: int = 8, n: int = 2000) -> float:
    """Microseconds of the guard's work for one timing frame of ``ranks`` ranks (this process
    stands in for each: the same /proc reads), the frame encoded."""
    meter, pid = SchedstatMeter(), os.getpid()
    pids = dict.fromkeys(range(ranks), pid)
    meter.sample(pids, {}, time.monotonic())
    t0 = time.perf_counter()
    for i in range(n):
        figures = meter.sample(pids, dict.fromkeys(range(ranks), i), time.monotonic() + i + 1)
        encode(Kind.TIMING, {"t": 0.0, "ranks": figures, "node": meter.node()})
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args()
    rates: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(dir=ROOT.parent) as tmp, Testbed(3) as bed:
        cwd = Path(tmp)
        paths = {}
        for name, extra in (("off", 'env: {PTCLUSTER_STRAGGLER: "0"}\n'), ("on", "")):
            paths[name] = cwd / f"{name}.yaml"
            paths[name].write_text(bed.cluster_yaml([1, 1, 1], python=sys.executable,
                                                    workdir=str(cwd), extra=extra))
        for i in range(args.repeat):
            for name in (("off", "on") if i % 2 == 0 else ("on", "off")):
                job = run_job(paths[name], cwd, args.seconds)
                if name == "off":
                    assert not job["straggler"]["trace"], "the off runs measured anyway"
                rates[name].append(job["steps_per_s"])
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    pairs = [b / a for a, b in zip(rates["off"], rates["on"], strict=True)]
    work = guard_work()
    show([("guard's work per frame of 8 ranks", f"{work:.0f} us every 2 s "
           f"({work / 2e6:.4%} of a core)"),
          ("run-to-run spread off (steps/s)", f"{min(rates['off']):.1f}-{max(rates['off']):.1f}"),
          ("pair ratios (on/off, each pair back to back)", str([round(p, 3) for p in pairs])),
          ("their geometric mean", f"{statistics.geometric_mean(pairs):.3f}x"),
          ("without timing frames (steps/s)", f"{off:.2f}  {rates['off']}"),
          ("with them (steps/s)", f"{on:.2f}  {rates['on']}"),
          ("ratio", f"{on / off:.3f}x (target >= 0.98x)")])


if __name__ == "__main__":
    main()
