"""What one `srun` step per node costs the head and slurmctld, against one step for all nodes
(issue 18, item 7), measured on the Slurm testbed (3 nodes, slurmctld in node 0; root).

Inside one `salloc -N3 --no-shell` allocation, each "node program" is `cat`: a task whose stdin
and stdout Slurm forwards, as a guard's channel. Two shapes:
  per node  K steps `srun --overlap -N1 -n1 --nodelist NODE --quiet cat` (ptcluster's today;
            round robin over the 3 nodes, so K stands for K nodes on the head and slurmctld;
            a real node would hold one such step, not K/3)
  one step  `srun --overlap -N3 --ntasks-per-node=K/3 --overcommit --label --quiet cat`
            (K tasks in one step; stdin is broadcast to every task)
Each is ready when every task has echoed a line written to its srun; then, while all run, the
head's srun processes, threads, descriptors, listening TCP ports and memory are counted, and
slurmctld's CPU time for creating the steps; then EOF to every srun, and the time and
slurmctld's CPU until every srun is gone (its idle rate beside them; CPU times are in clock
ticks, 10 ms); the sruns' own CPU, start to exit. Counts are exact; times are from a shared
2-core machine.

    sudo .venv/bin/python benchmarks/slurm_steps.py [--tasks 3,24,96]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import selectors
import subprocess
import sys
import time
from pathlib import Path

from _common import ROOT, show

sys.path.insert(0, str(ROOT))
from tests.support.slurmbed import SlurmBed  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def head_costs(pids: list[int]) -> dict[str, float]:
    """Over the srun processes: threads, descriptors, listening TCP ports, RSS and PSS (MiB:
    PSS shares each shared page among the processes that map it)."""
    out = {"processes": len(pids), "threads": 0.0, "fds": 0.0, "listening": 0.0, "rss": 0.0,
                           "pss": 0.0}
    for pid in pids:
        status = Path(f"/proc/{pid}/status").read_text()
        out["threads"] += int(re.search(r"^Threads:\s+(\d+)", status, re.M)[1])  # type: ignore
        out["rss"] += int(re.search(r"^VmRSS:\s+(\d+)", status, re.M)[1]) / 1024  # type: ignore
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        out["pss"] += int(re.search(r"^Pss:\s+(\d+)", rollup, re.M)[1]) / 1024  # type: ignore
        links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        out["fds"] += len(links)
        sockets = {link[8:-1] for link in links if link.startswith("socket:[")}
        for table in ("tcp", "tcp6"):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                f = line.split()
                out["listening"] += f[3] == "0A" and f[9] in sockets
    return out


def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_shape(bed: SlurmBed, job: str, argvs: list[list[str]], tasks: int,
              ctld: int) -> dict[str, float]:
    env = {k: v for k, v in bed.env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    s0, c0, t0 = children_cpu_s(), cpu_s(ctld), time.perf_counter()
    procs = [subprocess.Popen(["srun", f"--jobid={job}", "--overlap", "--quiet", *argv, "cat"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
             for argv in argvs]
    sel = selectors.DefaultSelector()
    for p in procs:
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write(b"ping\n")
        p.stdin.flush()
        sel.register(p.stdout.fileno(), selectors.EVENT_READ)
    echoed = 0
    while echoed < tasks:
        if time.perf_counter() - t0 > 300:
            raise SystemExit(f"only {echoed} of {tasks} tasks echoed")
        for key, _ in sel.select(timeout=1.0):
            echoed += os.read(key.fd, 1 << 16).count(b"ping\n")
    ready = time.perf_counter() - t0
    created = cpu_s(ctld) - c0
    costs = head_costs([p.pid for p in procs])
    c1, t1 = cpu_s(ctld), time.perf_counter()
    for p in procs:
        p.stdin.close()  # type: ignore[union-attr]
    for p in procs:
        p.wait(timeout=120)
    ended = time.perf_counter() - t1
    time.sleep(1.0)  # step completions reach slurmctld from slurmstepd, not from srun
    gone = cpu_s(ctld) - c1
    return {**costs, "ready": ready, "ended": ended, "ctld_create": created, "ctld_end": gone,
            "srun_cpu": children_cpu_s() - s0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="3,24,96", help="K values (multiples of 3)")
    args = ap.parse_args()
    ks = [int(k) for k in args.tasks.split(",")]
    with SlurmBed(3) as bed:
        alloc = bed.run("salloc", "-N3", "--no-shell", "-J", "steps")
        job = re.search(r"allocation (\d+)", alloc.stderr + alloc.stdout)[1]  # type: ignore
        ctld = int((bed.dir / "slurmctld.pid").read_text())
        c0 = cpu_s(ctld)
        time.sleep(3.0)
        idle = (cpu_s(ctld) - c0) / 3.0
        rows = [("slurmctld idle (CPU s per s)", f"{idle:.4f}")]
        for k in ks:
            per_node = [["-N1", "-n1", f"--nodelist={bed.names[i % 3]}", "--kill-on-bad-exit=1"]
                        for i in range(k)]
            one = [["-N3", f"--ntasks-per-node={k // 3}", "--overcommit", "--label"]]
            for shape, argvs in (("per node", per_node), ("one step", one)):
                r = run_shape(bed, job, argvs, k, ctld)
                steps = len(argvs)
                rows.append((f"K={k} {shape}: {steps} step(s)",
                             f"ready {r['ready']:.2f} s, ended {r['ended']:.2f} s after EOF"))
                rows.append(("  head: srun processes, threads, fds, listening ports",
                             f"{r['processes']:.0f}, {r['threads']:.0f}, {r['fds']:.0f}, "
                             f"{r['listening']:.0f}"))
                rows.append(("  head: srun memory, RSS / PSS MiB; srun CPU s",
                             f"{r['rss']:.0f} / {r['pss']:.0f}; {r['srun_cpu']:.2f}"))
                rows.append(("  slurmctld CPU ms: create, end (per step)",
                             f"{r['ctld_create'] * 1e3:.0f}, {r['ctld_end'] * 1e3:.0f} "
                             f"({r['ctld_create'] * 1e3 / steps:.1f}, "
                             f"{r['ctld_end'] * 1e3 / steps:.1f})"))
        bed.run("scancel", job)
    show(rows)


if __name__ == "__main__":
    main()
