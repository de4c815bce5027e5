"""Fan-out: a no-op job on 1, 2, 4 and 8 testbed nodes (1 slot each), and 3 testbed nodes vs
local torchrun with 3 processes. Needs root (it builds the namespace testbed).

Figures per node count, medians over --repeat runs:
- total: `ptcluster run` from start to exit (init_process_group + barrier on every rank);
- ready: from the channels' start until every node's guard has connected and passed its
  checks, as the runner reports it ("all N node(s) ready in X s"): the launcher's own fan-out
  (ssh + guard), before torch is imported anywhere;
- ssh only: k parallel `ssh node true`, the floor of any fan-out over ssh on this testbed.
Targets: ready 8/1 <= 1.5; 3 testbed nodes / local torchrun x3 <= 1.5. On the testbed every
node's sshd and guard run on the head's 2 cores, so every node adds its ssh handshake (client
and server) and a Python start to the same CPUs: compare "ready" with "ssh only".

    .venv/bin/python benchmarks/launch_fanout.py [--repeat 3] [--max-nodes 8]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import PTCLUSTER, ROOT, TORCHRUN, median, show, ssh_only, timed

sys.path.insert(0, str(ROOT))
from tests.support.testbed import Testbed  # noqa: E402

NOOP = """import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


def run_once(cluster: Path, cwd: Path) -> tuple[float, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(PTCLUSTER + ["run", "--cluster", str(cluster), "--run-dir", "runs",
                                         "noop.py"], cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    ready = float("nan")
    assert proc.stderr is not None
    err = []
    for line in proc.stderr:
        err.append(line)
        if "node(s) ready in " in line:
            ready = float(line.split("node(s) ready in ")[1].split()[0])
    if proc.wait() != 0:
        raise SystemExit(f"run failed on {cluster}:\n" + "".join(err[-30:]))
    return time.perf_counter() - t0, ready


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-nodes", type=int, default=8)
    args = ap.parse_args()
    counts = [k for k in (1, 2, 4, 8) if k <= args.max_nodes]
    rows, totals = [], {}
    with tempfile.TemporaryDirectory() as tmp, Testbed(max(counts + [3])) as bed:
        cwd = Path(tmp)
        (cwd / "noop.py").write_text(NOOP)
        clusters = {}
        for k in sorted(set(counts + [3])):
            clusters[k] = cwd / f"c{k}.yaml"
            clusters[k].write_text(bed.cluster_yaml([1] * k, python=sys.executable,
                                                    workdir=str(cwd)))
        run_once(clusters[1], cwd)  # warm caches
        samples: dict[int, list[tuple[float, float]]] = {k: [] for k in clusters}
        ssh: dict[int, list[float]] = {k: [] for k in clusters}
        local: list[float] = []
        for _ in range(args.repeat):
            for k in clusters:
                samples[k].append(run_once(clusters[k], cwd))
                ssh[k].append(ssh_only(bed, k))
            local.append(timed(TORCHRUN + ["--standalone", "--nproc-per-node", "3", "noop.py"],
                               cwd))
        for k in sorted(clusters):
            total = median([t for t, _ in samples[k]])
            ready = median([r for _, r in samples[k]])
            totals[k] = (total, ready)
            rows.append((f"{k} node(s): total / ready / ssh only (s)",
                         f"{total:.2f} / {ready:.2f} / {median(ssh[k]):.2f}"))
    rows.append(("local torchrun x3 (s)", f"{median(local):.2f}"))
    if 8 in totals:
        rows.append(("ratio total 8/1", f"{totals[8][0] / totals[1][0]:.2f}"))
        rows.append(("ratio ready 8/1", f"{totals[8][1] / totals[1][1]:.2f}  (target <= 1.5)"))
        rows.append(("ratio ssh only 8/1", f"{median(ssh[8]) / median(ssh[1]):.2f}"))
    rows.append(("ratio 3 testbed nodes / local torchrun x3",
                 f"{totals[3][0] / median(local):.2f}  (target <= 1.5)"))
    show(rows)


if __name__ == "__main__":
    main()
