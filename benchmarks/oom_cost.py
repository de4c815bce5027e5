"""What naming an OOM kill or a GPU's Xid costs the user in waiting: seconds from a rank's death
to the head's exit when the kernel's OOM killer kills it, or when it SIGKILLs itself right after
writing an Xid in the driver's format with its pid into the kernel's log, beside a plain SIGKILL
run the same way in the same run (``ptcluster run --nproc 2`` on this machine: rank 0 moves
itself into a cgroup v1 memory group limited to 64 MiB, waits 2.5 s, then allocates past the
limit, or writes the Xid and SIGKILLs itself, or only SIGKILLs itself; rank 1 sleeps). Runs
alternate; medians compared. Target: each named case adds <= 2 s. The Xid runs end with the
driver's load line in the log (their Xid is history then, as after a real reload).

A rank's death is its ``ended_at`` in ``summary.json`` (the shim's clock when its program's
wait returned: this machine's wall clock, as the head's exit here). Needs root (the memory
group, ``/dev/kmsg``).

    PYTHONPATH=src .venv/bin/python benchmarks/oom_cost.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, show

MEMORY_V1 = Path("/sys/fs/cgroup/memory")
RANK = """import os, signal, sys, time
if os.environ["RANK"] != "0":
    time.sleep(120)
    sys.exit(0)
with open(os.path.join(sys.argv[2], "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(2.5)
if sys.argv[1] == "xid":
    with open("/dev/kmsg", "w") as log:
        log.write(f"NVRM: Xid (PCI:0000:3b:00): 79, pid={os.getpid()}, name=pt_main_thread, "
                  "GPU has fallen off the bus.\\n")
if sys.argv[1] in ("kill", "xid"):
    os.kill(os.getpid(), signal.SIGKILL)
hog = []
while True:
    hog.append(bytearray(8 << 20))
"""


def one(cwd: Path, how: str) -> tuple[float, str]:
    """(seconds from rank 0's death to the head's exit, the root cause's kind)."""
    group = MEMORY_V1 / f"ptc-bench-oom-{os.getpid()}-{time.monotonic_ns()}"
    group.mkdir()
    runs = cwd / f"runs-{time.monotonic_ns()}"
    try:
        (group / "memory.limit_in_bytes").write_text(str(64 << 20))
        proc = subprocess.run([sys.executable, "-m", "ptcluster", "run", "--nproc", "2",
                               "--run-dir", str(runs), "rank.py", how, str(group)], cwd=cwd,
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        exited = time.time()
    finally:
        if how == "xid":
            with open("/dev/kmsg", "w") as log:
                log.write("NVRM: loading NVIDIA UNIX x86_64 Kernel Module (ptcluster's "
                          "benchmark: its Xid is history)\n")
        for pid in (group / "cgroup.procs").read_text().split():
            os.kill(int(pid), signal.SIGKILL)
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    (run,) = [p for p in runs.iterdir() if p.is_dir()]
    summary = json.loads((run / "summary.json").read_text())
    if proc.returncode != 1 or summary["root_cause"]["rank"] != 0:
        raise SystemExit(f"unexpected end ({proc.returncode}):\n{proc.stderr[-2000:]}")
    expected = {"kill": "rank", "oom": "oom", "xid": "gpu"}[how]
    if summary["root_cause"]["kind"] != expected:
        raise SystemExit(f"{how}: root cause {summary['root_cause']['kind']}, not {expected}: "
                         f"{summary['root_cause']['message']}")
    died = next(r["ended_at"] for r in summary["ranks"] if r["rank"] == 0)
    return exited - died, summary["root_cause"]["kind"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if os.getuid() != 0 or not (MEMORY_V1 / "cgroup.procs").exists():
        raise SystemExit("needs root and the cgroup v1 memory controller")
    took: dict[str, list[float]] = {"kill": [], "oom": [], "xid": []}
    kinds: dict[str, set[str]] = {"kill": set(), "oom": set(), "xid": set()}
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        (cwd / "rank.py").write_text(RANK)
        for _ in range(args.repeat):
            for how in ("kill", "oom", "xid"):
                seconds, kind = one(cwd, how)
                took[how].append(seconds)
                kinds[how].add(kind)
    kill, oom, xid = (statistics.median(took[how]) for how in ("kill", "oom", "xid"))
    show([
        ("plain SIGKILL: rank death -> head exit, median (s)",
         f"{kill:.2f}  (runs: {', '.join(f'{t:.2f}' for t in took['kill'])}; "
         f"kind {'/'.join(sorted(kinds['kill']))})"),
        ("OOM kill, named: rank death -> head exit, median (s)",
         f"{oom:.2f}  (runs: {', '.join(f'{t:.2f}' for t in took['oom'])}; "
         f"kind {'/'.join(sorted(kinds['oom']))})"),
        ("Xid then SIGKILL, named: rank death -> head exit, median (s)",
         f"{xid:.2f}  (runs: {', '.join(f'{t:.2f}' for t in took['xid'])}; "
         f"kind {'/'.join(sorted(kinds['xid']))})"),
        ("OOM minus plain (s)", f"{oom - kill:+.2f}  (target <= +2.00)"),
        ("Xid minus plain (s)", f"{xid - kill:+.2f}  (target <= +2.00)"),
        ("OOM / plain, Xid / plain", f"{oom / kill:.2f}x, {xid / kill:.2f}x"),
    ])


if __name__ == "__main__":
    main()
