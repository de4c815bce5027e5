"""`run --hang-timeout` and `ptcluster stacks` on the 3-node testbed (real sshd, real gloo).

Each hang is a real one (a rank asleep before a collective, a desync, a rank holding the GIL in
C): the report must name the right rank, its host, function and line. `stacks` on a healthy job
must leave its result unchanged, and a link cut stays a lost node even with a hang timeout.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ptcluster.launch.lost import TABLE as LOST
from tests.support.head import Head, closing_table, job_id_when_started, only_run, run_head

pytestmark = [pytest.mark.testbed, pytest.mark.slow]
PY = sys.executable
HANG = "4"

SLEEPY = textwrap.dedent("""
    import sys, time, torch, torch.distributed as dist

    def load_batch(rank, late):
        if rank == late:
            time.sleep(600)  # MARK
        return torch.ones(8)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for step in range(4):
        t = load_batch(rank, int(sys.argv[1])) if step == 2 else torch.ones(8)
        dist.all_reduce(t)
        print("step", step, flush=True)
""")

DESYNC = textwrap.dedent("""
    import sys, torch, torch.distributed as dist

    def log_metrics():
        dist.all_reduce(torch.ones(100))  # only one rank logs: a collective the others skip

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for step in range(4):
        if rank == int(sys.argv[1]) and step == 1:
            log_metrics()
        dist.all_reduce(torch.ones(100))  # MARK
        print("step", step, flush=True)
    dist.barrier()
    print("done", flush=True)
""")

HOLDS_GIL = textwrap.dedent("""
    import ctypes, sys, torch, torch.distributed as dist

    def read_sensor():
        while True:  # C code that keeps the GIL (and, like real C code, retries after EINTR)
            ctypes.PyDLL(None).sleep(600)  # MARK

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for step in range(4):
        if rank == int(sys.argv[1]) and step == 2:
            read_sensor()
        dist.all_reduce(torch.ones(8))
        print("step", step, flush=True)
""")

TRAIN = textwrap.dedent("""
    # argv[1], if given: a file; every rank waits at step 10 until it exists (so that a test
    # can ask for stacks while the job surely runs, however loaded the machine).
    import hashlib, os, sys, time, torch, torch.distributed as dist
    hold = sys.argv[1] if len(sys.argv) > 1 else None
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(60):
        x = torch.randn(32, 64, generator=gen)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        print("step", step, flush=True)
        while step == 10 and hold and not os.path.exists(hold):
            time.sleep(0.1)
        time.sleep(0.1)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    print("digest", digest, flush=True)
""")

SLEEPER = textwrap.dedent("""
    import time, torch, torch.distributed as dist
    from datetime import timedelta
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    print("ready", flush=True)
    t = torch.ones(1)
    for i in range(600):
        dist.all_reduce(t)
        time.sleep(0.2)
""")

SCRIPTS = {"sleepy.py": SLEEPY, "desync.py": DESYNC, "gil.py": HOLDS_GIL, "train.py": TRAIN,
           "sleeper.py": SLEEPER}


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hang")
    for name, text in SCRIPTS.items():
        (root / name).write_text(text)
    return root


def mark_line(script: str) -> int:
    return next(i for i, line in enumerate(SCRIPTS[script].splitlines(), 1) if "# MARK" in line)


def cluster(testbed, job_dir: Path) -> str:
    return testbed.write_cluster(job_dir, [1, 1, 1], python=PY)


def run_hang(testbed, job_dir: Path, no_leftovers,
             *args: str) -> tuple[int, Head, dict, Path]:
    runs = job_dir / f"runs-{time.monotonic_ns()}"
    code, head = run_head(["run", "--cluster", cluster(testbed, job_dir), "--run-dir", str(runs),
                           "--hang-timeout", HANG, *args], cwd=job_dir, timeout=120)
    job_id, summary = only_run(runs)
    no_leftovers.append(job_id)
    return code, head, summary, runs / job_id


@pytest.mark.parametrize("script, late, func, line_of", [
    ("sleepy.py", 1, "load_batch", "sleepy.py"),
    ("desync.py", 2, "<module>", "desync.py"),
    ("gil.py", 0, "read_sensor", "gil.py"),
])
def test_the_report_names_the_rank_host_function_and_line(testbed, job_dir, no_leftovers,
                                                          script, late, func, line_of) -> None:
    code, head, summary, run_dir = run_hang(testbed, job_dir, no_leftovers, script, str(late))
    assert code == 4, head.output()
    report = summary["hang_report"]
    assert report["straggler"]["ranks"] == [late], json.dumps(report, indent=1)
    entry = report["ranks"][late]
    assert entry["host"] == testbed.nodes[late].name  # slots 1,1,1: rank i on node i
    frames = [t for t in entry["threads"] if t["main"]][0]["frames"]
    user = [f for f in frames if not f["file"].startswith("/")]
    assert (user[0]["func"], user[0]["line"]) == (func, mark_line(script)), frames
    assert summary["root_cause"]["kind"] == "hang" and summary["root_cause"]["rank"] == late
    # the closing table (and summary.json) say which rank hung, apart from those stopped
    statuses = {r["rank"]: r["status"] for r in summary["ranks"]}
    assert statuses == {r: "hung (named by the hang report)" if r == late else
                        "stopped (job teardown)" for r in range(3)}, statuses
    assert {r: row["status"] for r, row in closing_table(head.err).items()} == statuses, \
        head.output()
    err = "\n".join(head.err)
    first = next(line for line in head.err if line.startswith("straggler:"))
    assert first.startswith(f"straggler: rank {late} on {testbed.nodes[late].name}: "), err
    assert f"{script}:{mark_line(script)}" in first, err
    saved = (run_dir / "hang-stacks.txt").read_text()
    assert saved.splitlines()[1].startswith(f"straggler: rank {late} on "), saved


def digest(lines: list[str]) -> set[str]:
    return {m.group(1) for line in lines if (m := re.search(r"\] digest (\w+)", line))}


def test_stacks_on_a_healthy_job_leaves_it_running_and_its_result_unchanged(
        testbed, job_dir, no_leftovers) -> None:
    runs = job_dir / f"runs-{time.monotonic_ns()}"
    hold = job_dir / f"go-on-{time.monotonic_ns()}"
    head = Head(["run", "--cluster", cluster(testbed, job_dir), "--run-dir", str(runs),
                 "train.py", str(hold)], cwd=job_dir)
    try:
        job_id = job_id_when_started(runs)
        no_leftovers.append(job_id)
        head.wait_for("step 10", count=3)
        asked = []
        for _ in range(3):
            asked.append(subprocess.run([PY, "-m", "ptcluster", "stacks", "--run-dir",
                                         str(runs)], cwd=job_dir, capture_output=True,
                                        text=True, timeout=60))
            time.sleep(0.5)
        hold.touch()
        code = head.wait(timeout=120)
    finally:
        if head.proc.poll() is None:
            head.kill()
    assert code == 0, head.output()
    for proc in asked:
        assert proc.returncode == 0, proc.stderr
        places = [line for line in proc.stdout.splitlines() if line.startswith("  rank")]
        ranks = {n for line in places  # "ranks 0-1,3 on …": spans
                 for part in re.match(r"  ranks? ([\d,-]+) on", line).group(1).split(",")
                 for n in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)}
        assert ranks == {0, 1, 2}, proc.stdout
        assert "train.py:" in proc.stdout and "saved in" in proc.stderr
    assert len(list((runs / job_id).glob("stacks-*.txt"))) == 3
    with_stacks = digest(head.lines)
    code, plain = run_head(["run", "--cluster", cluster(testbed, job_dir), "--run-dir",
                            str(job_dir / f"runs-{time.monotonic_ns()}"), "train.py"],
                           cwd=job_dir, timeout=120)
    assert code == 0, plain.output()
    assert len(with_stacks) == 1 and with_stacks == digest(plain.lines)


def test_stacks_without_a_running_job_is_a_clear_error(cli, job_dir) -> None:
    code, _, err = cli("stacks", "--run-dir", str(job_dir / "none"))
    assert code == 2 and cli.problem.code == "cli.no-running-job", err
    assert cli.problem.fields == {"runs": str(job_dir / "none")} and "Fix:" in err
    code, _, err = cli("stacks", "--run-dir", str(job_dir / "none"), "20261207-no-such-job")
    assert code == 2 and cli.problem.code == "cli.no-run-dir", err


def test_a_link_cut_with_a_hang_timeout_is_a_lost_node(testbed, job_dir, no_leftovers) -> None:
    victim = testbed.nodes[2]
    runs = job_dir / f"runs-{time.monotonic_ns()}"
    head = Head(["run", "--cluster", cluster(testbed, job_dir), "--run-dir", str(runs),
                 "--hang-timeout", "3", "sleeper.py"], cwd=job_dir)
    try:
        no_leftovers.append(job_id_when_started(runs))
        head.wait_for("ready", count=3)
        time.sleep(1.0)
        testbed.cut_link(victim)
        code = head.wait(timeout=90)
    finally:
        testbed.restore_link(victim)
        head.kill()
    _, summary = only_run(runs)
    assert code == 1, head.output()
    assert summary["hang_report"] is None
    assert "hang" not in [f["kind"] for f in summary["failures"]], summary["failures"]
    root = summary["root_cause"]
    # (lost, then asked once more: its failure says what the probe found, run.lost-*)
    assert (root["host"], root["kind"]) == (victim.name, "lost"), root
    assert root["code"] in {e.code for e in LOST}, root
