"""What `ssh: {reuse: S}` saves: `doctor --skip-allreduce` then `run` of a no-op job on k
testbed nodes, with a new ssh connection per command (today's default) and with reuse (the
first command of the pair leaves a master per node, the second goes through it; the masters are
ended before each pair, so every pair pays one handshake per node). Needs root (the testbed).

Figures: medians over --repeat pairs, seconds, and their ratio (same run, same machine).

    .venv/bin/python benchmarks/ssh_reuse.py [--repeat 5] [--nodes 3]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import PTCLUSTER, ROOT, median, show

sys.path.insert(0, str(ROOT))
from tests.support.testbed import Testbed  # noqa: E402


def pair(cluster: Path, cwd: Path, env: dict[str, str]) -> tuple[float, float]:
    times = []
    for args in (["doctor", "--skip-allreduce"], ["run", "noop.py"]):
        t0 = time.perf_counter()
        proc = subprocess.run(PTCLUSTER + [args[0], "--cluster", str(cluster), *args[1:]],
                              cwd=cwd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"{args[0]} failed:\n{proc.stderr[-3000:]}")
        times.append(time.perf_counter() - t0)
    return times[0], times[1]


def end_masters(bed: Testbed, sockets: Path, k: int) -> None:
    for node in bed.nodes[:k]:
        subprocess.run(["ssh", "-F", str(bed.ssh_config), "-o", f"ControlPath={sockets}/%C",
                        "-O", "exit", node.name], capture_output=True, timeout=10)


def main() -> None:
    import os

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--nodes", type=int, default=3)
    args = ap.parse_args()
    k = args.nodes
    runtime = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    sockets = runtime / "ptcluster-ssh"
    with tempfile.TemporaryDirectory() as tmp, Testbed(k) as bed:
        cwd = Path(tmp)
        (cwd / "noop.py").write_text("print('ok')\n")
        plain = cwd / "plain.yaml"
        plain.write_text(bed.cluster_yaml([1] * k, python=sys.executable, workdir=str(cwd)))
        reuse = cwd / "reuse.yaml"
        reuse.write_text(plain.read_text().replace("ssh: {", "ssh: {reuse: 60, "))
        pair(plain, cwd, env)  # warm caches
        got: dict[str, list[tuple[float, float]]] = {"plain": [], "reuse": []}
        try:
            for _ in range(args.repeat):
                got["plain"].append(pair(plain, cwd, env))
                end_masters(bed, sockets, k)
                got["reuse"].append(pair(reuse, cwd, env))
        finally:
            end_masters(bed, sockets, k)
    rows = []
    for name, samples in got.items():
        d, r = median([s[0] for s in samples]), median([s[1] for s in samples])
        rows.append((f"{name}: doctor / run / both (s)", f"{d:.2f} / {r:.2f} / {d + r:.2f}"))
    p = [a + b for a, b in got["plain"]]
    q = [a + b for a, b in got["reuse"]]
    pr = [s[1] for s in got["plain"]]
    qr = [s[1] for s in got["reuse"]]
    rows.append(("ratio reuse / plain, run after doctor", f"{median(qr) / median(pr):.2f}"))
    rows.append(("ratio reuse / plain, both", f"{median(q) / median(p):.2f}"))
    show([(f"{k} testbed node(s), {args.repeat} pairs", "")] + rows)


if __name__ == "__main__":
    main()
