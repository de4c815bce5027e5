"""``ptcluster push`` (issue 44's figures): a set of --mb MiB in --files files (random:
incompressible) to 3 and to 8 nodes of a namespace testbed (the nodes share this machine's
cores and disk; each node its own folder, as the namespaces share the file system).

- head egress: the bytes the head's bridge interface sent during the push (its counter: the
  channels, ssh and all), against the set's size; at 8 nodes the relay runs (goal <= 1.5x);
- wall time at 3 nodes (by default relayed: ``remote.relay.RELAY_MIN``; and with
  ``--no-relay``: the head sends to each node) against one `rsync -a` of the same set to one
  node over ssh (goal <= 2x), the two alternated ``--rounds`` times and their medians compared
  (other work on the machine moves either by a factor of two from one run to the next);
- the CPU time the two take, every process of the run (the head, ssh, each node's sshd and
  program: one cgroup), where the kernel has a cpuacct (v1) or cpu.stat (v2) group: unlike wall
  time, not moved by other work on the machine;
- a second push of the unchanged set: the bytes the head sent (goal < 1 MiB).

Needs root (the testbed).

    .venv/bin/python benchmarks/push.py [--mb 512] [--files 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, show

sys.path.insert(0, str(ROOT))
from ptcluster.cluster.load import load_cluster_file  # noqa: E402
from ptcluster.push.scan import scan  # noqa: E402
from ptcluster.push.send import PushResult, push  # noqa: E402
from ptcluster.remote.connect import transports  # noqa: E402
from ptcluster.remote.group import Member  # noqa: E402
from tests.support import testbed as tb  # noqa: E402


class CpuClock:
    """CPU seconds of this process and everything it starts from now on (its own cgroup,
    made here; None where none can be made)."""

    def __init__(self) -> None:
        self.usage: Path | None = None
        for folder, name in ((Path("/sys/fs/cgroup/cpuacct"), "cpuacct.usage"),
                             (Path("/sys/fs/cgroup"), "cpu.stat")):
            group = folder / f"bench-push-{os.getpid()}"
            try:
                group.mkdir()
                (group / "cgroup.procs").write_text(str(os.getpid()))
            except OSError:
                continue
            self.usage, self.home = group / name, folder
            return

    def now(self) -> float | None:
        if self.usage is None:
            return None
        text = self.usage.read_text()
        if self.usage.name == "cpu.stat":  # ("usage_usec N" first)
            return int(text.split()[1]) / 1e6
        return int(text) / 1e9

    def close(self) -> None:
        if self.usage is not None:
            (self.home / "cgroup.procs").write_text(str(os.getpid()))
            try:
                self.usage.parent.rmdir()
            except OSError:
                pass


def spent(clock: CpuClock, since: float | None) -> float:
    now = clock.now()
    return now - since if now is not None and since is not None else float("nan")


def tx(dev: str) -> int:
    return int(Path(f"/sys/class/net/{dev}/statistics/tx_bytes").read_text())


def once(bed: tb.Testbed, work: Path, n: int, src: Path, clock: CpuClock,
         relay: bool | None = None) -> tuple[PushResult, float, int, PushResult, int, float]:
    spec = load_cluster_file(bed.write_cluster(work, [1] * n), trusted=True)
    reach = transports(spec)
    members = [Member(x.host, reach[x.host], sys.executable, {"dest": str(work / f"{n}-{i}")})
               for i, x in enumerate(spec.nodes)]
    listing = scan(src)
    before, t0, cpu = tx(bed.bridge), time.perf_counter(), clock.now()
    first = push(members, listing, relay=relay)
    took, egress, cpu = time.perf_counter() - t0, tx(bed.bridge) - before, spent(clock, cpu)
    before = tx(bed.bridge)
    second = push(members, scan(src), relay=relay)
    again = tx(bed.bridge) - before
    assert first.ok and second.ok, (first.failed, second.failed)
    for i in range(n):
        shutil.rmtree(work / f"{n}-{i}")
    return first, took, egress, second, again, cpu


def rsync(bed: tb.Testbed, src: Path, work: Path, clock: CpuClock) -> tuple[float, float]:
    """Seconds and CPU seconds for one `rsync -a` of ``src`` to the first node (its copy
    removed after)."""
    t0, cpu = time.perf_counter(), clock.now()
    subprocess.run(["rsync", "-a", "-e", f"ssh -F {bed.ssh_config}", f"{src}/",
                    f"{bed.nodes[0].name}:{work}/rsync/"], check=True, capture_output=True,
                   timeout=1200)
    took, cpu = time.perf_counter() - t0, spent(clock, cpu)
    shutil.rmtree(work / "rsync")
    return took, cpu


def _each(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--files", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    clock = CpuClock()
    with tempfile.TemporaryDirectory(prefix="push-", dir="/var/tmp") as tmp, \
            tb.Testbed(8) as bed:
        work = Path(tmp)
        src = work / "src"
        per = args.mb * 2**20 // args.files
        for i in range(args.files):
            path = src / f"shard-{i % 16:02d}" / f"part-{i:04d}.bin"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(os.urandom(per))
        size = per * args.files
        rsyncs, threes, cpus = [], [], []
        for _ in range(max(args.rounds, 1)):  # (alternated: the same load for both)
            took, cpu = rsync(bed, src, work, clock)
            three = once(bed, work, 3, src, clock)
            rsyncs.append(took)
            threes.append(three[1])
            cpus.append((cpu, three[5]))
        rsync_s, three_s = statistics.median(rsyncs), statistics.median(threes)
        rsync_cpu, three_cpu = (statistics.median(c[i] for c in cpus) for i in (0, 1))
        three_direct = once(bed, work, 3, src, clock, relay=False)
        eight = once(bed, work, 8, src, clock)
    clock.close()
    show([
        ("set", f"{size / 2**20:.0f} MiB in {args.files} files"),
        ("one rsync -a to one node", f"{rsync_s:.2f} s median of {_each(rsyncs)}"),
        ("push to 3 nodes (default)", f"{three_s:.2f} s median of {_each(threes)}, head egress "
         f"{three[2] / size:.2f}x, chain of {len(three[0].chain)}"),
        ("ratio push 3 nodes / one rsync (goal <= 2.0)", f"{three_s / rsync_s:.2f} (medians)"),
        ("CPU time: one rsync; push to 3 nodes", f"{rsync_cpu:.2f} s; {three_cpu:.2f} s "
         f"(ratio {three_cpu / rsync_cpu:.2f}; --no-relay {three_direct[5]:.2f} s; medians, "
         "every process of the run)"),
        ("push to 3 nodes, --no-relay", f"{three_direct[1]:.2f} s, head egress "
         f"{three_direct[2] / size:.2f}x; ratio to one rsync {three_direct[1] / rsync_s:.2f}"),
        ("push to 8 nodes (relay)", f"{eight[1]:.2f} s, chain of {len(eight[0].chain)}"),
        ("head egress at 8 nodes / size (goal <= 1.5)", f"{eight[2] / size:.3f} (bridge counter; "
         f"file bytes sent by the head: {eight[0].bytes_sent / size:.3f})"),
        ("second push, 3 nodes: head egress (goal < 1 MiB)",
         f"{three[4]} bytes (file bytes {three[3].bytes_sent})"),
        ("second push, 8 nodes: head egress (goal < 1 MiB)",
         f"{eight[4]} bytes (file bytes {eight[3].bytes_sent})"),
    ])


if __name__ == "__main__":
    main()
