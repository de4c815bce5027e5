"""`ptcluster run` inside a Slurm allocation vs the same job over ssh and vs `srun torchrun`.

On the Slurm testbed (3 namespace nodes, slurmctld + a slurmd per node; root), inside one
`salloc -N3` allocation, a no-op job (init_process_group + barrier, 1 rank per node) is run,
alternating:
  slurm   ptcluster run noop.py                 (nodes from the allocation, an srun step each)
  ssh     ptcluster run --cluster FILE noop.py  (the same nodes over ssh)
  srun    srun --overlap -N3 --ntasks-per-node=1 torchrun --nnodes 3 --rdzv-backend c10d
          --rdzv-endpoint NODE0_ADDR:PORT noop.py   (the hand-written line, done right: the
          endpoint is the NodeAddr, since the node names resolve nowhere)
Ratios of medians are printed; targets: slurm/ssh <= 1.2, slurm/srun <= 1.2. Then the time
from `scancel` of a running `ptcluster run` job to no process left on any node.

    sudo .venv/bin/python benchmarks/slurm_launch.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import PTCLUSTER, ROOT, TORCHRUN, median, show, timed

sys.path.insert(0, str(ROOT))
from tests.support.slurmbed import SlurmBed  # noqa: E402

NOOP = """import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""

SLEEPER = """import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
print("ready", flush=True)
t = torch.ones(1)
for _ in range(3000):
    dist.all_reduce(t)
    time.sleep(0.1)
"""


def inner(args: argparse.Namespace) -> None:
    """Inside the allocation: the three ways, alternating."""
    cwd = Path(args.dir)
    env = dict(os.environ)
    no_slurm = {k: v for k, v in env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    slurm = PTCLUSTER + ["run", "--run-dir", "runs", "noop.py"]
    ssh = PTCLUSTER + ["run", "--cluster", args.cluster, "--run-dir", "runs", "noop.py"]
    port = 29400 + int(env["SLURM_JOB_ID"]) % 100
    srun = ["srun", "--overlap", "-N3", "--ntasks-per-node=1", "--quiet", *TORCHRUN,
            "--nnodes", "3", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-id", env["SLURM_JOB_ID"], "--rdzv-endpoint", f"{args.master}:{port}",
            "noop.py"]
    ways = {"slurm": (slurm, env), "ssh": (ssh, no_slurm), "srun": (srun, env)}
    for argv, e in ways.values():  # warm the page cache for each
        timed(argv, cwd, e)
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(args.repeat):
        for name, (argv, e) in ways.items():
            times[name].append(timed(argv, cwd, e))
    rows = [(f"{name} (median s)", f"{median(t):.2f}  {[round(x, 2) for x in sorted(t)]}")
            for name, t in times.items()]
    rows += [
        ("ratio slurm/ssh", f"{median(times['slurm']) / median(times['ssh']):.3f}  "
                            "(target <= 1.2)"),
        ("ratio slurm/srun torchrun", f"{median(times['slurm']) / median(times['srun']):.3f}  "
                                      "(target <= 1.2)"),
    ]
    show(rows)


def cancel_time(bed: SlurmBed, cwd: Path) -> float:
    """Seconds from `scancel` of a running job to no process of it on any node."""
    head = subprocess.Popen(["salloc", "-N3", *PTCLUSTER, "run", "--run-dir", "runs",
                             "sleeper.py"], cwd=cwd, env=bed.env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    assert head.stdout is not None
    ready = 0
    for line in head.stdout:
        ready += "ready" in line
        if ready == 3:
            break
    (job,) = bed.jobs()
    t0 = time.perf_counter()
    bed.run("scancel", job)
    while bed.node_processes() or bed.jobs():
        time.sleep(0.02)
        if time.perf_counter() - t0 > 120:
            raise SystemExit(f"processes left after scancel: {bed.node_processes()}")
    took = time.perf_counter() - t0
    head.wait(timeout=60)
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--cluster", help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner:
        inner(args)
        return
    with SlurmBed(3) as bed, tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        (cwd / "noop.py").write_text(NOOP)
        (cwd / "sleeper.py").write_text(SLEEPER)
        cluster = cwd / "cluster.yaml"
        cluster.write_text(bed.bed.cluster_yaml([1, 1, 1], hosts=[n.addr for n in bed.nodes]))
        proc = subprocess.run(
            ["salloc", "-N3", sys.executable, __file__, "--inner", "--repeat", str(args.repeat),
             "--dir", str(cwd), "--cluster", str(cluster), "--master", bed.nodes[0].addr],
            cwd=cwd, env=bed.env, text=True, capture_output=True)
        print(proc.stdout, end="")
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-3000:])
        cancels = [cancel_time(bed, cwd) for _ in range(3)]
        show([("scancel -> no process left (median s)",
               f"{median(cancels):.2f}  {[round(x, 2) for x in sorted(cancels)]}")])


if __name__ == "__main__":
    main()
