"""`ptcluster setup` on 3 bare testbed nodes: a full setup, then no-op re-runs against
`ptcluster doctor --skip-allreduce` on the same nodes, in one run. Needs root (it builds the
bare testbed) and scripts/prepare_testbed.sh's artifacts (the head's pip is pointed at them:
nothing is downloaded).

Reports where the full setup's time goes (per step, the median over the nodes; the head's
wheelhouse), that each wheel crossed to each node once (a re-run copies nothing), and the
ratio no-op re-run / doctor --skip-allreduce. Target: <= 1.5.

    sudo .venv/bin/python benchmarks/setup_time.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import PTCLUSTER, ROOT, median, show, timed

sys.path.insert(0, str(ROOT))
from tests import bare  # noqa: E402
from tests.bare import BareNode, BareOptions  # noqa: E402
from tests.testbed import Testbed  # noqa: E402

ENV = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(bare.WHEELS)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, Testbed(3, bare=BareOptions(nodes=(
            BareNode(sudo="password"), BareNode(sudo="nopasswd"), BareNode(ufw=True)))) as bed:
        cwd = Path(tmp)
        pw = cwd / "pw"
        pw.write_text(bare.PASSWORD + "\n")
        os.chmod(pw, 0o600)
        cfg = cwd / "c.yaml"
        cfg.write_text("nodes:\n" + "".join(f"  - host: {n.name}\n" for n in bed.nodes)
                       + f"workdir: ~/proj\nssh: {{config_file: {bed.ssh_config}, "
                       f"identity_file: {cwd / 'key'}}}\n")
        setup = PTCLUSTER + ["setup", "--cluster", str(cfg), "--password-file", str(pw),
                             "--wheelhouse", str(cwd / "wh"), "--json"]
        t0 = time.perf_counter()
        full = subprocess.run(setup + ["--accept-new-host-keys"], cwd=cwd, capture_output=True,
                              text=True, env={**os.environ, **ENV})
        full_s = time.perf_counter() - t0
        if full.returncode != 0:
            raise SystemExit(f"setup failed:\n{full.stdout[-3000:]}\n{full.stderr[-2000:]}")
        report = json.loads(full.stdout)
        noop, doctor = [], []
        timed(PTCLUSTER + ["doctor", "--cluster", str(cfg), "--skip-allreduce"], cwd)  # warm
        copies = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            again = subprocess.run(setup, cwd=cwd, capture_output=True, text=True,
                                   env={**os.environ, **ENV})
            noop.append(time.perf_counter() - t0)
            data = json.loads(again.stdout)
            copies.append(sum(a["step"] == "wheels" for n in data["nodes"]
                              for a in n["applied"]))
            doctor.append(timed(PTCLUSTER + ["doctor", "--cluster", str(cfg),
                                             "--skip-allreduce"], cwd))
    steps: dict[str, list[float]] = {}
    for node in report["nodes"]:
        for step, s in node["seconds"].items():
            steps.setdefault(step, []).append(s)
    wheels_copied = [a["detail"] for n in report["nodes"] for a in n["applied"]
                     if a["step"] == "wheels"]
    rows = [("full setup, 3 nodes (s)", f"{full_s:.1f}"),
            ("  head wheelhouse (download once)", f"{report['wheelhouse_s']}")]
    rows += [(f"  {step} (median over nodes)", f"{statistics.median(v):.1f}")
             for step, v in sorted(steps.items(), key=lambda kv: -statistics.median(kv[1]))]
    rows += [("  wheels copied, per node", "; ".join(wheels_copied)),
             ("re-runs that copied wheels", f"{sum(copies)} of {len(copies)}"),
             ("no-op re-run (median s)", f"{median(noop):.2f}  {[round(t, 2) for t in noop]}"),
             ("doctor --skip-allreduce (median s)",
              f"{median(doctor):.2f}  {[round(t, 2) for t in doctor]}"),
             ("ratio re-run / doctor", f"{median(noop) / median(doctor):.2f}  (target <= 1.5)")]
    show(rows)


if __name__ == "__main__":
    main()
