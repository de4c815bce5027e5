"""What the straggler report costs a job: steps/s of a balanced DDP job (gloo, 3 testbed nodes x
1 rank, ``tests/straggler_job.py``) with the guards' timing frames (the default) and without
them (``PTCLUSTER_STRAGGLER: "0"`` in ``env:``), runs alternated, medians compared. Target
>= 0.98x. The measure runs in the guards only (/proc every 2 s): nothing in the ranks changes.
Needs root (testbed).

    PYTHONPATH=src .venv/bin/python benchmarks/straggler_cost.py [--repeat 4] [--seconds 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from _common import ROOT, show
from straggler_threshold import run_job

sys.path.insert(0, str(ROOT))
from tests.testbed import Testbed  # noqa: E402


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
    show([("without timing frames (steps/s)", f"{off:.2f}  {rates['off']}"),
          ("with them (steps/s)", f"{on:.2f}  {rates['on']}"),
          ("ratio", f"{on / off:.3f}x (target >= 0.98x)")])


if __name__ == "__main__":
    main()
