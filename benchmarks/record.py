"""Run one benchmark and keep what it printed as its latest figures, with when, on what code and on
what machine: ``benchmarks/results/NAME.txt``, which the docs site's benchmarks page shows.

The benchmark runs as it would by hand (this interpreter, the repository's root as the working
folder, ``src/`` first on the path); its output is shown as it comes and kept whole. The record
starts with ``key: value`` lines (benchmark, command, date, commit, machine, python, torch,
seconds, exit), then a blank line, then the output. A run that exits non-zero is kept too: the
figures of a failed target are figures. The commit is the checkout's ``HEAD`` when the run
started; when the code the benchmarks run (``src/``, ``benchmarks/``, ``tests/``, ``scripts/``)
differed from it, the record says so.

    .venv/bin/python benchmarks/record.py NAME [the benchmark's own options]
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("PTCLUSTER_BENCH_RESULTS") or ROOT / "benchmarks" / "results")
"""Where the records go (the variable: a test's own folder)."""
CODE = ("src", "benchmarks", "tests", "scripts")
"""What a benchmark's figures depend on (its results folder aside)."""


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    name, args = argv[0].removesuffix(".py"), argv[1:]
    script = ROOT / "benchmarks" / f"{name}.py"
    if name.startswith("_") or name == "record" or not script.is_file():
        print(f"no benchmark named {name!r} in benchmarks/", file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    command = f"benchmarks/{name}.py {shlex.join(args)}".strip()
    started, code = datetime.datetime.now(datetime.timezone.utc), commit()
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(script), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    out = []
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        out.append(line)
    rc = proc.wait()
    fields = {"benchmark": name, "command": command,
              "date": started.strftime("%Y-%m-%d %H:%M UTC"), "commit": code,
              "machine": machine(), "python": platform.python_version(), "torch": torch(),
              "seconds": f"{time.monotonic() - t0:.0f}", "exit": str(rc)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.txt"
    path.write_text("".join(f"{k}: {v}\n" for k, v in fields.items()) + "\n" + "".join(out))
    print(f"recorded in {path} (exit {rc})", file=sys.stderr)
    return rc


def read(path: Path) -> tuple[dict[str, str], str]:
    """A record's fields and the output it kept."""
    head, _, output = path.read_text().partition("\n\n")
    fields = dict(line.split(": ", 1) for line in head.splitlines())
    return fields, output


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()

    head = git("log", "-1", "--format=%h %cs")
    if not head:
        return "unknown (not a git checkout)"
    changed = [line for line in git("status", "--porcelain", "--", *CODE).splitlines()
               if not line[3:].startswith("benchmarks/results/")]
    return head + (f" with {len(changed)} changed file(s)" if changed else "")


def machine() -> str:
    model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = " ".join(line.split(":", 1)[1].split())
                break
        mem = next(line for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal:"))
        gib = f"{int(mem.split()[1]) / 2**20:.0f} GiB"
    except (OSError, StopIteration):
        gib = "?"
    return f"{os.cpu_count()} cores ({model}), {gib}, Linux {platform.release()}"


def torch() -> str:
    try:
        from importlib.metadata import version
        return version("torch")
    except Exception:  # noqa: BLE001 - not installed is an answer too
        return "not installed"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
