"""A restart's ranks from the job's own warm pool (``run --max-restarts``, issue 45 item 3;
``node/guard/job_pool.py``), on this machine, real processes: the second attempt's ranks are
forked from the pool the first attempt's guard started and see what cold ones see; the pool
ends with the job, and with a guard killed by SIGKILL; ``--cold`` starts none."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ptcluster.node.sharing.leases import LEASE_DIR
from tests.local.test_warm import SHOW, left_behind, pools, rank_lines
from tests.support.head import Head, job_id_when_started, only_run, run_head

pytestmark = pytest.mark.slow

WAIT_FOR_POOL = textwrap.dedent("""
    import glob, json, os, sys, time
    def job_pool():
        folder = os.path.join(os.environ["XDG_RUNTIME_DIR"], f"ptcluster-{os.getuid()}", "warm")
        for path in glob.glob(folder + "/pool-*.json"):
            try:
                with open(path) as f:
                    if json.load(f).get("job"):
                        return True
            except (OSError, ValueError):
                pass
        return False
    if os.environ["PTCLUSTER_ATTEMPT"] == "0":
        while not job_pool():  # (the pool says it is ready once it listens)
            time.sleep(0.1)
        {first}
        sys.exit(1)
""")
FAILS_ONCE = WAIT_FOR_POOL.replace("{first}", "pass") + SHOW.replace("sys.exit(3)", "sys.exit(0)")
"""Attempt 0 fails once the job's pool is ready; attempt 1 prints what a rank sees."""
VANISHES = WAIT_FOR_POOL.replace("{first}", "os.unlink(sys.argv[0])")
"""Attempt 0 removes its script once the pool is ready and fails: attempt 1's guard refuses."""
HANGS = WAIT_FOR_POOL.replace("{first}", "print('up', flush=True); time.sleep(600)")
"""Attempt 0 waits for the pool, then says ``up`` and sleeps; attempt 1 ends well."""


@pytest.fixture
def node(tmp_path: Path):
    """A project folder, this test's own runtime directory (its pools' folder); after the test
    no process of it left (no ``warm stop``: a job's pool must end by itself)."""
    runtime = Path(tempfile.mkdtemp(prefix="pr", dir="/tmp"))
    try:
        yield tmp_path, {"XDG_RUNTIME_DIR": str(runtime)}
    finally:
        left = left_behind(runtime, wait=15.0)
        shutil.rmtree(runtime, ignore_errors=True)
    assert not left, f"processes left behind: {left}"


def test_a_restart_forks_its_ranks_from_the_jobs_pool_as_a_cold_start_would(node) -> None:
    folder, env = node
    (folder / "job.py").write_text(FAILS_ONCE)
    runs = {}
    for mode in ("warm", "cold"):
        args = ["run", "--nproc", "2", "--max-restarts", "1",
                "--run-dir", f"runs-{mode}",
                *(["--cold"] if mode == "cold" else []), "job.py", "x", "--y=1"]
        if mode == "cold":  # (attempt 0 waits for a job's pool, which --cold never starts)
            (folder / "job.py").write_text(FAILS_ONCE.replace("while not job_pool()",
                                                              "while False"))
        rc, head = run_head(args, folder, env=env)
        assert rc == 0, (mode, head.err)
        runs[mode] = head, only_run(folder / f"runs-{mode}")[1]
        assert not left_behind(Path(env["XDG_RUNTIME_DIR"]), wait=5.0), mode
    (warm, warm_summary), (cold, cold_summary) = runs["warm"], runs["cold"]
    assert [a["warm"] for a in warm_summary["attempts"]] == [{"localhost": False},
                                                             {"localhost": True}]
    assert [a["warm"] for a in cold_summary["attempts"]] == [{"localhost": False}] * 2
    assert warm_summary["nodes"][0]["warm"] is True
    cold_lines, warm_lines = rank_lines(cold), rank_lines(warm)
    assert len(cold_lines) > 40 and any("env RANK=1" in line for line in cold_lines), cold.err
    differ = [(c, w) for c, w in zip(cold_lines, warm_lines, strict=True) if c != w]
    # what ARCHITECTURE.md says a warm rank can tell: no agent store serves it
    assert differ == [(f"[localhost:{r}] agent store True", f"[localhost:{r}] agent store False")
                      for r in (0, 1)]
    assert pools(env, folder) == []


def test_a_restart_refused_by_its_guard_ends_the_pool_the_last_attempt_kept(node) -> None:
    folder, env = node
    (folder / "job.py").write_text(VANISHES)
    rc, head = run_head(["run", "--nproc", "2", "--max-restarts", "1",
                         "--run-dir", "runs",
                         "job.py"], folder, env=env)
    summary = only_run(folder / "runs")[1]
    assert rc != 0 and len(summary["attempts"]) == 2, head.err
    assert summary["attempts"][1]["cause"]["code"].startswith("guard."), summary["attempts"]
    # (the pool waits JOB_POOL_WITHIN = 60 s for a guard that never comes, but for let_go)
    assert not left_behind(Path(env["XDG_RUNTIME_DIR"]), wait=10.0)
    assert pools(env, folder) == []


@pytest.mark.parametrize("attempt", [0, 1], ids=["its-parent", "its-holder"])
def test_a_guard_killed_with_sigkill_leaves_no_pool(node, attempt: int) -> None:
    """Attempt 0's guard started the pool (its child: PDEATHSIG); attempt 1's holds the pool
    attempt 0 kept, and its ranks come from it (the pool's end of its ``own`` connection)."""
    folder, env = node
    (folder / "job.py").write_text(HANGS if attempt == 0 else WAIT_FOR_POOL.replace(
        "{first}", "pass") + "print('up', flush=True); time.sleep(600)\n")
    runs = folder / "runs"
    head = Head(["run", "--nproc", "2", "--max-restarts", "1",
                 "--run-dir", str(runs),
                 "job.py"], folder, env=env)
    try:
        job_id = job_id_when_started(runs)
        head.wait_for("] up")
        (pool,) = pools(env, folder)
        assert inet_sockets(pool["pid"]) == [] and not holds_a_lease(pool["pid"])
        # the job's, not the user's own: `ps` says whose restarts; `warm stop` leaves it
        assert pool["job"] == f"{job_id}@localhost", pool
        stop = subprocess.run([sys.executable, "-m", "ptcluster", "warm", "stop"], cwd=folder,
                              env={**os.environ, **env}, capture_output=True, text=True,
                              timeout=60)
        assert stop.returncode == 0, stop
        assert [p["pid"] for p in pools(env, folder)] == [pool["pid"]]
        (guard,) = guards(job_id)
        os.kill(guard, signal.SIGKILL)
        assert gone(pool["pid"]), "the job's pool outlived its guard"
        head.wait(120)
    finally:
        if head.proc.poll() is None:
            head.kill()
    assert pools(env, folder) == []


def inet_sockets(pid: int) -> list[str]:
    """The TCP and UDP sockets (listening or not) among ``pid``'s descriptors."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            inodes.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    found = []
    for table in ("tcp", "tcp6", "udp", "udp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                if f"socket:[{line.split()[9]}]" in inodes:
                    found.append(f"{table} {line.split()[1]}")
    return found


def holds_a_lease(pid: int) -> bool:
    """Whether a lease file (``node.sharing.leases``: ``/run/lock/ptcluster-*``) names ``pid``."""
    for path in Path(LEASE_DIR).glob("ptcluster-*.json"):
        try:
            if json.loads(path.read_text()).get("pid") == pid:
                return True
        except (OSError, ValueError):  # (one that went while we read)
            pass
    return False


def guards(job_id: str) -> list[int]:
    """The live guards of job ``job_id`` on this machine (``... guard JOB_ID``)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if args[-3:] == [b"guard", job_id.encode(), b""]:  # (NUL-terminated)
            found.append(int(entry))
    return found


def test_a_stop_by_the_user_ends_the_pool_at_once(node) -> None:
    """Ctrl-C: no attempt follows, so no guard keeps the pool for one (``stop``'s ``final``)."""
    folder, env = node
    (folder / "job.py").write_text(HANGS)
    head = Head(["run", "--nproc", "2", "--max-restarts", "1", "job.py"],
                folder, env=env)
    try:
        head.wait_for("] up")
        (pool,) = pools(env, folder)
        head.proc.send_signal(signal.SIGINT)
        assert head.wait(120) != 0
    finally:
        if head.proc.poll() is None:
            head.kill()
    assert gone(pool["pid"], within=5.0), "the pool waits for an attempt that never comes"


def test_a_stop_that_comes_after_the_attempt_ended_ends_the_pool_its_guard_kept(
        node, monkeypatch) -> None:
    """A Ctrl-C that comes once an attempt has ended (``run --wait``'s poll, between
    attempts): its guard, told no ``final``, kept the job's pool for a restart; the runner,
    which then restarts nothing, ends it at once (not left to its 60 s). The runner's own
    loop on this machine, its attempt real; the stop asked the moment the attempt returned."""
    from ptcluster.cluster import local_cluster
    from ptcluster.launch.api import prepare
    from ptcluster.launch.plan import Target
    from ptcluster.launch.runner import Restarts, Runner
    from ptcluster.launch.supervise.restart import RestartPolicy
    from ptcluster.remote.connect import transports

    folder, env = node
    (folder / "job.py").write_text(WAIT_FOR_POOL.replace("{first}", "pass"))
    monkeypatch.chdir(folder)
    monkeypatch.setenv("XDG_RUNTIME_DIR", env["XDG_RUNTIME_DIR"])
    spec, target = local_cluster(2), Target(script="job.py")
    runner = Runner(prepare(spec, target, max_restarts=1), transports(spec), folder / "run",
                    restarts=Restarts(RestartPolicy(max_restarts=1, min_nodes=1), spec, target))
    new_attempt, kept = runner.new_attempt, []

    class StoppedAfter:
        def __init__(self) -> None:
            self.attempt = new_attempt()

        def run(self, before, t0):
            got = self.attempt.run(before, t0)
            kept.extend(p["pid"] for p in pools(env, folder))  # (its guard kept it: the 60 s)
            runner.request_stop("interrupted", signal.SIGINT)
            return got

    runner.new_attempt = StoppedAfter  # type: ignore[method-assign]
    result = runner.run()
    assert not result.ok and len(result.attempts) == 1, result.failures
    assert len(kept) == 1, "attempt 0's guard kept no pool"
    assert [n.kept_pool for n in result.nodes] == [True]  # (its exit frame said so: asked)
    assert gone(kept[0], within=5.0), "the kept pool waits for an attempt that never comes"
    assert pools(env, folder) == []


def gone(pid: int, within: float = 15.0) -> bool:
    """Whether ``pid`` ends (or is a zombie) within ``within`` s."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.1)
    return False



def test_a_pool_that_fails_at_its_fork_beside_forked_ranks_is_launched_again_all_cold(
        tmp_path) -> None:
    """A node whose warm pool cannot fork its ranks after the other nodes' have forked theirs
    refuses (``guard.pool-lost``: pooled and cold ranks never meet); the runner launches the
    same attempt again with every node's ranks cold, not counted as a restart, with or
    without --max-restarts. The runner's own loop, its attempts told apart by what they see."""
    from ptcluster.cluster import parse_cluster_text
    from ptcluster.errors import Problem
    from ptcluster.launch.plan import Target, plan_launch
    from ptcluster.launch.result import AttemptRecord, Failure, FailureKind, RunResult
    from ptcluster.launch.runner import Runner
    from ptcluster.node.guard.refusal import POOL_LOST

    plan = plan_launch(parse_cluster_text("nodes:\n  - {host: a, slots: 1}\n  - {host: b, "
                                          "slots: 1}\n", "c.yaml"),
                       Target(script="t.py"), port=29500, job_id="J")
    notes: list[str] = []
    runner = Runner(plan, {}, tmp_path / "run", on_status=notes.append)
    pooled: list[bool] = []

    class Try:
        def run(self, before, t0):
            pooled.append(runner.ctx.opts.pooled)
            lost = len(pooled) == 1
            failures = [Failure(host="b", rank=None, kind=FailureKind.GUARD,
                                problem=Problem.of(POOL_LOST, "b", why="refused"))] \
                if lost else []
            result = RunResult(job_id="J", run_dir=tmp_path, ranks=[], nodes=[],
                               failures=failures, interrupted=False, duration=0.0)
            record = AttemptRecord(number=0, hosts=["a", "b"], world_size=2,
                                   master_port=29500, started_at=0.0, ok=not lost)
            return SimpleNamespace(killed_by="", cut_off=[]), result, record

    runner.new_attempt = Try  # type: ignore[method-assign]
    result = runner.run()
    assert pooled == [True, False] and result.ok and len(result.attempts) == 1, notes
    assert any(n.startswith("b: its warm pool failed at the fork") for n in notes), notes
    assert [(f.host, f.code) for f in runner.went_cold] == [("b", POOL_LOST.code)]
