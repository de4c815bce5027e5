"""`ptcluster setup` on 3 bare testbed nodes: a full setup, then no-op re-runs against
`ptcluster doctor --skip-allreduce` on the same nodes, in one run. Needs root (it builds the
bare testbed) and scripts/prepare_testbed.sh's artifacts (the head's pip is pointed at them:
nothing is downloaded).

Reports where the full setup's time goes (per step, the median over the nodes; the head's
wheelhouse), that each wheel crossed to each node once (a re-run copies nothing), and the
ratio no-op re-run / doctor --skip-allreduce (target: <= 1.5). The re-runs and the doctors
alternate (which goes first alternates too), each as the whole command; beside them the floor
of any command here, 3 parallel `ssh node true`. Where a re-run's time goes: the command's
start and exit (wall minus what setup itself counted), and per node the time from starting ssh
to having the node's facts (setup's `connect_and_facts`, doctor's `ssh_s`). The machine is
shared: only ratios within one run mean anything.

    sudo .venv/bin/python benchmarks/setup_time.py [--repeat 9]
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
from typing import Any

from _common import PTCLUSTER, ROOT, median, show, ssh_only

sys.path.insert(0, str(ROOT))
from tests.support import bare  # noqa: E402
from tests.support.bare import BareNode, BareOptions  # noqa: E402
from tests.support.testbed import Testbed  # noqa: E402

ENV = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(bare.WHEELS)}


def timed_json(argv: list[str], cwd: Path) -> tuple[float, dict[str, Any]]:
    """(wall seconds, the command's JSON output); a failed command ends the benchmark."""
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **ENV})
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(argv)}\n{proc.stdout[-3000:]}"
                         f"\n{proc.stderr[-2000:]}")
    return took, json.loads(proc.stdout)


def spread(values: list[float]) -> str:
    return f"{median(values):.2f}  {[round(v, 2) for v in values]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=9)
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
        doctor = PTCLUSTER + ["doctor", "--cluster", str(cfg), "--skip-allreduce", "--json"]
        full_s, report = timed_json(setup + ["--accept-new-host-keys"], cwd)
        first_s, _ = timed_json(setup, cwd)
        timed_json(doctor, cwd)  # warm
        runs: dict[str, list[float]] = {k: [] for k in (
            "setup", "doctor", "ssh", "setup start+exit", "setup to facts", "doctor to facts")}
        copies = 0
        for i in range(args.repeat):
            for what in (("setup", "doctor") if i % 2 == 0 else ("doctor", "setup")):
                took, data = timed_json(setup if what == "setup" else doctor, cwd)
                runs[what].append(took)
                if what == "setup":
                    copies += sum(a["step"] == "wheels" for n in data["nodes"]
                                  for a in n["applied"])
                    runs["setup start+exit"].append(took - data["duration_s"])
                    runs["setup to facts"].append(statistics.median(
                        n["seconds"]["connect_and_facts"] for n in data["nodes"]))
                else:
                    runs["doctor to facts"].append(statistics.median(
                        n["ssh_s"] for n in data["nodes"].values()))
            runs["ssh"].append(ssh_only(bed, 3, cwd / "key"))
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
             ("first re-run after it (s)", f"{first_s:.2f}"),
             ("re-runs that copied wheels", f"{copies} of {args.repeat}"),
             ("no-op re-run (median s)", spread(runs["setup"])),
             ("  command start+exit", spread(runs["setup start+exit"])),
             ("  ssh start to facts (median node)", spread(runs["setup to facts"])),
             ("doctor --skip-allreduce (median s)", spread(runs["doctor"])),
             ("  ssh start to facts (median node)", spread(runs["doctor to facts"])),
             ("3 parallel `ssh node true` (s)", spread(runs["ssh"])),
             ("ratio re-run / doctor", f"{median(runs['setup']) / median(runs['doctor']):.2f}"
              "  (target <= 1.5)")]
    show(rows)


if __name__ == "__main__":
    main()
