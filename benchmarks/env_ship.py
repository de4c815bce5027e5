"""The project's environment on 3 bare nodes (issue 42's figures): a lock of >= 40 MB of wheels
(made here: incompressible, 8 packages of one big file each; or real ones, ``--wheels``: e.g.
numpy, scipy, scikit-learn and their dependencies from setup's wheelhouse, thousands of files,
whose install costs what a real project's does) plus the uv wheel that travels with it.

- first: the environment step for all nodes (resolve stands in: the wheels are given), against
  one machine's own `uv pip install` from a local folder of the same wheels (a fresh uv cache,
  copies, as the nodes do) and the same done with pip (`pip --python ENV install`);
- unchanged: a whole run (the launcher as a library: plan, guards, torchrun, one rank per node,
  a script that prints a line) with `requirements` whose environment every node has, against
  the same run without `requirements`, interleaved, median of each (the goal: <= 0.3 s more);
  and the environment step alone (the head's records read, nothing asked: `venvs.known`);
  `choose` is memoized here, as a resolve from the head's cache is;
- head egress: bytes of wheels sent over the channels, per run, against the wheels' bytes.

Needs root (the testbed) and a uv wheel (PTC_UV_WHEEL, or the testbed's cache).

    .venv/bin/python benchmarks/env_ship.py [--repeat 5] [--mb 48] [--wheels WHEEL ...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ROOT, median, show

sys.path.insert(0, str(ROOT))
from ptcluster.launch.api import prepare  # noqa: E402
from ptcluster.launch.plan import Target  # noqa: E402
from ptcluster.launch.runner import Runner  # noqa: E402
from ptcluster.remote.connect import transports  # noqa: E402
from ptcluster.venvs.known import KnownNodes  # noqa: E402
from ptcluster.venvs.runenv import Environment, use_environment  # noqa: E402
from tests.support import testbed as tb  # noqa: E402
from tests.support.bare import BareNode, BareOptions  # noqa: E402
from tests.support.wheels import uv_wheel  # noqa: E402
from tests.testbed.test_venvs import USER, Project  # noqa: E402


def local_install(files: list[Path], tool: str, uv: Path, work: Path) -> float:
    """Seconds for this machine's own venv + install of ``files`` (a fresh venv and cache)."""
    env_dir = work / f"env-{tool}-{time.monotonic_ns()}"
    cache = work / f"cache-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    if tool == "uv":
        steps = [[str(uv), "venv", "--quiet", "--python", "/usr/bin/python3", str(env_dir)],
                 [str(uv), "pip", "install", "--quiet", "--offline", "--no-index", "--no-deps",
                  "--link-mode", "copy", "--cache-dir", str(cache), "--python",
                  str(env_dir / "bin" / "python"), *map(str, files)]]
    else:
        steps = [["/usr/bin/python3", "-m", "venv", "--without-pip", str(env_dir)],
                 [sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"),
                  "install", "--quiet", "--no-index", "--no-deps", "--no-cache-dir",
                  *map(str, files)]]
    for argv in steps:
        subprocess.run(argv, check=True, capture_output=True, timeout=600)
    return time.perf_counter() - t0


NOOP = "import sys\nprint('noop', sys.executable)\n"


def one_run(project: Project, run_dir: Path, choose: object | None,
            known: KnownNodes) -> tuple[float, float]:
    """Seconds for one run of noop.py on every node (with the environment step when
    ``choose``): what ``ptcluster run`` does after its cluster file is read; and the seconds
    until every guard was ready (its prechecks: the environment's check among them), as the
    run's status line says it."""
    t0 = time.perf_counter()
    spec, env = project.spec, None
    if choose is not None:
        used: Environment = use_environment(spec, choose, project.locate, source="bench",
                                            known=known)
        if not used.expected:
            raise SystemExit("the environment was not expected from the head's records")
        spec, env = used.spec, used.to_json()
    plan = prepare(spec, Target(script="noop.py"))
    notes: list[str] = []
    result = Runner(plan, transports(spec), run_dir / plan.job_id, environment=env,
                    on_status=notes.append).run()
    took = time.perf_counter() - t0
    if not result.ok:
        raise SystemExit(f"run failed: {result.failures}")
    ready = next(float(n.split(" ready in ")[1].split()[0]) for n in notes if " ready in " in n)
    return took, ready


def memo(choose: Any) -> Any:
    """``choose`` once per platform (a resolve from the head's cache stands in for it)."""
    seen: dict[Any, Any] = {}
    return lambda platform: seen[platform] if platform in seen else seen.setdefault(
        platform, choose(platform))


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--mb", type=int, default=48)
    ap.add_argument("--wheels", nargs="*", type=Path, default=[], metavar="WHEEL",
                    help="real wheels for the lock (for this machine's Python), not made ones")
    args = ap.parse_args()
    load_at_start = load()
    uv = uv_wheel()
    if uv is None:
        raise SystemExit("no uv wheel: set PTC_UV_WHEEL")
    with tempfile.TemporaryDirectory(prefix="env-ship-", dir="/var/tmp") as tmp, tb.Testbed(
            3, bare=BareOptions(nodes=tuple(BareNode(sudo="none", extra_users=((USER, "pw"),))
                                            for _ in range(3)))) as bed:
        bed.trust_host_keys()
        for node in bed.nodes:
            bed.root_exec(node, "sh", "-c", "cat > /etc/hosts", input=bed.hosts_text)
        project = Project(bed, Path(tmp))
        per = args.mb * 2**20 // 8
        wheels = [project.given(p) for p in args.wheels] or \
            [project.wheel(f"pkg{i}", "1.0", padding=per) for i in range(8)]
        choose = memo(project.choose(*wheels))
        known = KnownNodes(Path(tmp) / "known")
        t0 = time.perf_counter()
        first = use_environment(project.spec, choose, project.locate, source="bench",
                                known=known)
        first_s = time.perf_counter() - t0
        (env,) = first.shipped.envs.values()
        wheel_bytes = sum(w.size for w in (*env.wheels, *env.tools))
        unchanged, second_bytes = [], 0
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            again = use_environment(project.spec, choose, project.locate, source="bench",
                                    known=known)
            unchanged.append(time.perf_counter() - t0)
            second_bytes = max(second_bytes, again.shipped.bytes_sent)
        for node in bed.nodes:
            bed.root_exec(node, "sh", "-c", f"cat > /home/{USER}/proj/noop.py && chown "
                          f"{USER}:{USER} /home/{USER}/proj/noop.py", input=NOOP)
        runs = Path(tmp) / "runs"
        runs.mkdir()
        one_run(project, runs, choose, known)  # (warm: both kinds once, not counted)
        one_run(project, runs, None, known)
        plain, with_env, plain_ready, env_ready = [], [], [], []
        for _ in range(args.repeat):
            for times, ready, how in ((plain, plain_ready, None), (with_env, env_ready, choose)):
                took, until = one_run(project, runs, how, known)
                times.append(took)
                ready.append(until)
        files = [project.locate(w) for w in env.wheels]
        uv_bin = Path(tmp) / "uv"
        import zipfile

        with zipfile.ZipFile(uv) as z:
            uv_bin.write_bytes(z.read(next(n for n in z.namelist()
                                           if n.endswith(".data/scripts/uv"))))
        os.chmod(uv_bin, 0o755)
        one_uv = median([local_install(files, "uv", uv_bin, Path(tmp)) for _ in range(3)])
        one_pip = median([local_install(files, "pip", uv_bin, Path(tmp)) for _ in range(3)])
        builds = {h: n.seconds for h, n in first.shipped.nodes.items()}
    show([
        ("load (1, 5, 15 min) at start, at end", f"{load_at_start}; {load()}"),
        ("wheels", f"{len(env.wheels)} + uv, {wheel_bytes / 2**20:.1f} MiB ("
         f"{', '.join(p.name.split('-')[0] for p in args.wheels) or 'made here'})"),
        ("first run, environment step, 3 nodes", f"{first_s:.2f} s (builds: " + ", ".join(
            f"{h} {s:.2f} s" for h, s in builds.items()) + ")"),
        ("one machine's own uv pip install", f"{one_uv:.2f} s (median of 3)"),
        ("one machine's own pip install", f"{one_pip:.2f} s (median of 3)"),
        ("ratio first / own uv (goal <= 2.0 here)", f"{first_s / one_uv:.2f}"),
        ("ratio first / own pip (goal <= 0.5)", f"{first_s / one_pip:.2f}"),
        ("run without requirements", f"{median(plain):.2f} s (median of {args.repeat}: "
         + ", ".join(f"{t:.2f}" for t in plain) + ")"),
        ("run, unchanged environment", f"{median(with_env):.2f} s (median of {args.repeat}: "
         + ", ".join(f"{t:.2f}" for t in with_env) + ")"),
        ("unchanged: added to a run (goal <= 0.3 s)",
         f"{median(with_env) - median(plain):.2f} s (difference of the medians; of each pair: "
         f"{median([e - p for e, p in zip(with_env, plain, strict=True)]):.2f} s)"),
        ("every guard ready, without / with (medians)",
         f"{median(plain_ready):.2f} s / {median(env_ready):.2f} s (the guard's check of the "
         "environment is in the second)"),
        ("unchanged: environment step alone", f"{median(unchanged):.3f} s (median of "
         f"{args.repeat}; no session: the head's records)"),
        ("head egress, first run / wheel bytes (goal <= 3.1)",
         f"{first.shipped.bytes_sent / wheel_bytes:.3f}"),
        ("head egress of wheels, unchanged run (goal < 1 MiB)", f"{second_bytes} bytes"),
    ])


if __name__ == "__main__":
    main()
