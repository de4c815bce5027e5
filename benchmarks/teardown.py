"""How fast ptcluster ends a job everywhere, on a 3-node testbed (root). Prints seconds per fault
against the targets of the multi-node issue; plain torchrun's figures on the same kind of
testbed (../shared/TESTBED.md) are > 120 s for the first four (it never ends them).

    .venv/bin/python benchmarks/teardown.py
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, show

sys.path.insert(0, str(ROOT))
from tests.support.head import Head, job_id_when_started  # noqa: E402
from tests.support.procs import job_processes  # noqa: E402
from tests.support.testbed import Testbed  # noqa: E402

SLEEPER = """import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
print("ready", flush=True)
t = torch.ones(1)
for _ in range(3000):
    dist.all_reduce(t)
    time.sleep(0.2)
"""


def gone_after(job_id: str, t0: float, limit: float = 90) -> float:
    left = job_processes(job_id, wait=limit)
    return float("inf") if left else time.monotonic() - t0


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp, Testbed(3) as bed:
        cwd = Path(tmp)
        (cwd / "sleeper.py").write_text(SLEEPER)
        ports = iter(range(29700, 29800))

        def start() -> tuple[Head, str]:
            cfg = cwd / f"c{time.monotonic_ns()}.yaml"
            cfg.write_text(bed.cluster_yaml([1, 1, 1], python=sys.executable, workdir=str(cwd),
                                            port=next(ports)))
            runs = cwd / f"runs{time.monotonic_ns()}"
            head = Head(["run", "--cluster", str(cfg), "--run-dir", str(runs), "sleeper.py"],
                        cwd=cwd)
            job = job_id_when_started(runs)
            head.wait_for("ready", count=3)
            return head, job

        head, job = start()
        t0 = time.monotonic()
        head.signal(signal.SIGINT)
        rows.append(("Ctrl-C on the head -> no process on any node (s)",
                     f"{gone_after(job, t0):.1f}  (target <= 10)"))
        head.kill()

        head, job = start()
        t0 = time.monotonic()
        head.kill()
        rows.append(("SIGKILL of the head's group -> nodes clean (s)",
                     f"{gone_after(job, t0):.1f}  (target <= 15)"))

        head, job = start()
        victim = bed.nodes[1]
        t0 = time.monotonic()
        for pid, _ in job_processes(job):
            if bed.node_of_pid(pid) == victim:
                os.kill(pid, signal.SIGKILL)
        head.wait(timeout=90)
        rows.append(("a node's processes SIGKILLed -> head exits 1 (s)",
                     f"{time.monotonic() - t0:.1f}  (target <= 10)"))
        rows.append(("   ... and every node clean (s)", f"{gone_after(job, t0):.1f}"))

        head, job = start()
        victim = bed.nodes[2]
        t0 = time.monotonic()
        bed.cut_link(victim)
        head.wait(timeout=120)
        rows.append(("link cut -> head exits 1 naming the node (s)",
                     f"{time.monotonic() - t0:.1f}  (target <= 45)"))
        others = [p for p, _ in job_processes(job) if bed.node_of_pid(p) != victim]
        rows.append(("   ... other nodes clean at that moment", "yes" if not others else
                     f"no: {others}"))
        rows.append(("   ... cut-off node clean (s)",
                     f"{gone_after(job, t0, 120):.1f}  (target <= 60)"))
        bed.restore_link(victim)

        cfg = cwd / "unreach.yaml"
        cfg.write_text(bed.cluster_yaml([1, 1], hosts=[bed.nodes[0].name, bed.unused_addr],
                                        python=sys.executable, workdir=str(cwd)))
        t0 = time.monotonic()
        head = Head(["run", "--cluster", str(cfg), "--run-dir", str(cwd / "r"), "sleeper.py"],
                    cwd=cwd)
        head.wait(timeout=60)
        rows.append(("unreachable node -> refused before launch (s)",
                     f"{time.monotonic() - t0:.1f}  (ssh ConnectTimeout 5 in the testbed)"))
    show(rows)


if __name__ == "__main__":
    main()
