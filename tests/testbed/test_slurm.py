"""ptcluster under a real Slurm (slurmctld + one slurmd per testbed node,
tests/support/slurmbed.py).

`ptcluster run` inside `salloc` (nodes, addresses and slots from the allocation, an `srun` step
per node), a killed rank and `scancel` (nothing left on any node, no step left), `submit`
(script, log in the run dir) and preemption (`scancel -s USR2`: checkpoint, requeue, resume).

Slurm's node names (sl0..sl2) are not the nodes' hostnames and resolve nowhere: a run that used
them, or `hostname`, as addresses could not rendezvous.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from ptcluster.cluster.slurm import (
    job_port,
)
from tests.support.procs import job_processes
from tests.support.slurmbed import parent_pid

PY = sys.executable


RANKS = textwrap.dedent("""
    import json, os, socket, sys, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    info = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
            "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_NTASKS")}
    info["host"] = socket.gethostname()
    info["sum"] = t.item()
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(info, f)
    dist.destroy_process_group()
""")


SLEEPER = textwrap.dedent("""
    import os, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    print("ready pid", os.getpid(), flush=True)
    t = torch.ones(1)
    for _ in range(600):
        dist.all_reduce(t)
        time.sleep(0.2)
""")


@pytest.fixture(scope="module")
def slurm():
    from tests.support.slurmbed import SlurmBed, available
    from tests.support.testbed import bring_up

    bed = bring_up("Slurm testbed", available(), lambda: SlurmBed(3))
    try:
        yield bed
    finally:
        bed.close()


@pytest.fixture
def clean(slurm):
    """After each test: no job, no step, nothing of a job on any node."""
    yield slurm
    left = slurm.wait_no_jobs(timeout=30)
    slurm.cancel_all()
    procs = _wait_nodes_empty(slurm, 15)
    assert not left, f"Slurm jobs left: {left}"
    assert not procs, f"processes left on the nodes: {procs}"


def _wait_nodes_empty(slurm, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        procs = slurm.node_processes()
        if not procs or time.monotonic() > deadline:
            return procs
        time.sleep(0.1)


class Proc:
    """A client command (salloc …) with its output collected live."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        self.out: list[str] = []
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.out.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float = 90) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.out):
                if m := re.search(pattern, line):
                    return m
            if self.proc.poll() is not None and not self.thread.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r}:\n" + self.text())

    def ready_pids(self, n: int, timeout: float = 90) -> dict[int, int]:
        """rank -> pid, once ``n`` ranks of the sleeper said they are ready."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = {int(m.group(1)): int(m.group(2)) for line in list(self.out)
                    if (m := re.search(r":(\d+)\] ready pid (\d+)", line))}
            if len(pids) >= n:
                return pids
            time.sleep(0.05)
        raise AssertionError(f"not {n} ranks ready:\n" + self.text())

    def wait(self, timeout: float = 120) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        self.thread.join(5)
        return code

    def text(self) -> str:
        return "\n".join(self.out[-80:])


def salloc_run(slurm, tmp_path: Path, salloc: list[str], run: list[str]) -> Proc:
    (tmp_path / "ranks.py").write_text(RANKS)
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    return Proc(["salloc", *salloc, PY, "-m", "ptcluster", "run", "--run-dir",
                 str(tmp_path / "runs"), *run], slurm.env, tmp_path)


def the_run(tmp_path: Path) -> str:
    (run,) = [p.name for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    return run


@pytest.mark.testbed
@pytest.mark.slow
def test_salloc_run_2_1_1_on_the_allocations_nodes(clean, tmp_path) -> None:
    slurm = clean
    out = tmp_path / "out"
    out.mkdir()
    head = salloc_run(slurm, tmp_path, ["-N3", "-n4"], ["ranks.py", str(out)])
    assert head.wait() == 0, head.text()
    job = head.wait_for(r"using Slurm job (\d+): 3 node\(s\), 4 rank\(s\)").group(1)
    addrs = [n.addr for n in slurm.nodes]
    assert f"rendezvous {addrs[0]}:{job_port(job)}" in head.text()
    ranks = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4)}
    hosts = [slurm.nodes[i].name for i in (0, 0, 1, 2)]  # the nodes' own hostnames
    assert [ranks[r]["host"] for r in range(4)] == hosts
    assert [ranks[r]["LOCAL_RANK"] for r in range(4)] == ["0", "1", "0", "0"]
    assert all(info["sum"] == 10.0 and info["WORLD_SIZE"] == "4" for info in ranks.values())
    assert {info["MASTER_ADDR"] for info in ranks.values()} == {addrs[0]}
    assert {info["SLURM_JOB_ID"] for info in ranks.values()} == {job}
    # one step per node (0, 1, 2), every rank inside its node's step
    assert sorted({info["SLURM_STEP_ID"] for info in ranks.values()}) == ["0", "1", "2"]
    # not the step's "task 0 of 1", which Slurm-aware libraries would take for the world
    assert all(info["SLURM_PROCID"] is None and info["SLURM_NTASKS"] is None
               for info in ranks.values())
    assert not job_processes(the_run(tmp_path), wait=10)


@pytest.mark.testbed
@pytest.mark.slow
def test_doctor_in_an_allocation_probes_through_srun(clean, tmp_path) -> None:
    slurm = clean
    proc = Proc(["salloc", "-N3", PY, "-m", "ptcluster", "doctor", "--json"], slurm.env,
                tmp_path)
    assert proc.wait() == 0, proc.text()
    text = "\n".join(proc.out)
    report = json.loads(text[text.index("{"):text.rindex("}") + 1])
    assert report["ok"], text
    addrs = [n.addr for n in slurm.nodes]
    assert list(report["nodes"]) == addrs
    for i, addr in enumerate(addrs):
        facts = report["nodes"][addr]["facts"]
        assert facts["hostname"] == slurm.nodes[i].name  # it ran inside that node
        assert facts["slurm"]["node"] == f"sl{i}" and facts["slurm"]["affinity"] == [0, 1]
    checks = {(f["check"], f["status"]) for f in report["findings"]}
    assert {("slurm cpus", "ok"), ("slurm gpus", "ok"), ("all-reduce", "ok")} <= checks


@pytest.mark.testbed
@pytest.mark.slow
def test_monitor_env_and_bench_in_an_allocation(clean, tmp_path) -> None:
    slurm = clean
    addrs = [n.addr for n in slurm.nodes]
    mon = Proc(["salloc", "-N3", PY, "-m", "ptcluster", "-q", "monitor", "--once", "--json"],
               slurm.env, tmp_path)
    assert mon.wait() == 0, mon.text()
    text = "\n".join(line for line in mon.out if not line.startswith("salloc:"))
    rows = json.loads(text)["nodes"]
    assert [r["host"] for r in rows] == addrs and all(r["ok"] for r in rows), text
    assert [r["sample"]["hostname"] for r in rows] == [n.name for n in slurm.nodes]
    env = Proc(["salloc", "-N3", "-n4", PY, "-m", "ptcluster", "env"], slurm.env, tmp_path)
    assert env.wait() == 0, env.text()
    assert f"export MASTER_ADDR={addrs[0]}" in env.text()
    assert "export WORLD_SIZE=4" in env.text()
    bench = Proc(["salloc", "-N3", "-n4", PY, "-m", "ptcluster", "-q", "bench", "--op",
                  "all_reduce", "-b", "8", "-e", "64", "-n", "2", "-w", "1", "--json"],
                 slurm.env, tmp_path)
    assert bench.wait() == 0, bench.text()
    said = json.loads("\n".join(line for line in bench.out if not line.startswith("salloc:")))
    assert (said["world_size"], said["backend"], said["out_of_bounds"]) == (4, "gloo", 0), said
    assert said["rows"] and said["failure"] is None, said


@pytest.mark.testbed
@pytest.mark.slow
def test_a_killed_rank_ends_every_node_and_leaves_no_step(clean, tmp_path) -> None:
    slurm = clean
    head = salloc_run(slurm, tmp_path, ["-N3"], ["sleeper.py"])
    pids = head.ready_pids(3)
    os.kill(pids[1], signal.SIGKILL)
    assert head.wait() != 0
    text = head.text()
    assert "Root cause (first observed failure): rank 1 on " + slurm.nodes[1].addr in text, text
    assert not slurm.steps()
    assert not job_processes(the_run(tmp_path), wait=10)


@pytest.mark.testbed
@pytest.mark.slow
def test_ctrl_c_of_the_head_ends_every_step(clean, tmp_path) -> None:
    """The head's own teardown (not Slurm's) reaches the ranks through the srun steps."""
    slurm = clean
    head = salloc_run(slurm, tmp_path, ["-N3"], ["sleeper.py"])
    job = head.wait_for(r"using Slurm job (\d+)").group(1)
    head.ready_pids(3)
    run = the_run(tmp_path)
    heads = [int(p) for p in os.listdir("/proc")  # salloc's child: the ptcluster head
             if p.isdigit() and parent_pid(int(p)) == head.proc.pid]
    assert len(heads) == 1, heads
    os.kill(heads[0], signal.SIGINT)
    assert head.wait(timeout=60) != 0
    summary = json.loads((tmp_path / "runs" / run / "summary.json").read_text())
    assert (summary["outcome"], summary["signal"]) == ("interrupted", "SIGINT"), summary
    assert not job_processes(run, wait=15)
    assert not slurm.steps()
    assert slurm.jobs().get(job) in (None, "COMPLETED", "COMPLETING")


@pytest.mark.testbed
@pytest.mark.slow
def test_scancel_leaves_no_process_on_any_node(clean, tmp_path) -> None:
    slurm = clean
    head = salloc_run(slurm, tmp_path, ["-N3"], ["sleeper.py"])
    job = head.wait_for(r"using Slurm job (\d+)").group(1)
    head.ready_pids(3)
    run = the_run(tmp_path)
    assert job_processes(run)
    slurm.run("scancel", job)
    head.wait(timeout=60)
    text = head.text()
    assert f"ptcluster: Slurm ended job {job} (JobState=" in text, text
    # Slurm stopped it: not a failure of the job, and no node event passes for its root cause
    assert "Root cause" not in text, text
    assert "SignalException" not in text.split("What the nodes saw first")[-1], text
    summary = json.loads((tmp_path / "runs" / run / "summary.json").read_text())
    assert summary["ended_by"].startswith(f"Slurm ended job {job}") and summary["interrupted"]
    assert summary["outcome"] == "ended outside", summary
    # what the nodes saw first: a guard Slurm signalled, not a network or head that stalled
    saw = summary["root_cause"]
    assert (saw["code"], saw["fields"]) == ("run.guard-signalled",
                                            {"reason": "the guard got SIGTERM"}), saw
    assert not job_processes(run, wait=30)
    assert not _wait_nodes_empty(slurm, 10)
    assert not slurm.steps()


@pytest.mark.testbed
@pytest.mark.slow
def test_submit_then_usr2_checkpoints_requeues_and_resumes(clean, tmp_path) -> None:
    """`submit` runs the reference trainer; `scancel -s USR2` reaches every rank: the trainer
    saves its epoch, rank 0 requeues the job, and the next run resumes after that epoch."""
    slurm = clean
    ckpt = tmp_path / "ckpt"
    res = slurm.run(PY, "-m", "ptcluster", "submit", "--nodes", "3", "--nproc", "1",
                    "--run-dir", str(tmp_path / "runs"), "--", "-m", "ptcluster.examples.mnist",
                    "--dataset", "digits", "--epochs", "12", "--resume", "--checkpoint-dir",
                    str(ckpt))
    job = res.stdout.strip()
    assert job.isdigit(), res
    (run_dir,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    assert (run_dir / "job.sbatch").read_text().startswith("#!/bin/bash")
    log = run_dir / f"slurm-{job}.out"
    _wait_text(log, "epoch 3/12", 90)
    slurm.run("scancel", "-s", "USR2", job)
    _wait_text(log, f"requeueing Slurm job {job}", 30)
    deadline = time.monotonic() + 30
    while slurm.jobs().get(job) != "PENDING" and time.monotonic() < deadline:
        time.sleep(0.1)
    # Slurm holds a requeued job back for two minutes; a test need not wait for that
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    assert not slurm.wait_no_jobs(timeout=120), _tail(log)
    text = log.read_text()
    m = re.search(r"preempted \(SIGUSR2\) after epoch (\d+): checkpoint saved", text)
    assert m, _tail(log)
    saved = int(m.group(1))
    assert f"continuing at epoch {saved + 1}" in text, _tail(log)
    assert "final epochs=12" in text, _tail(log)
    assert f"ptcluster submit: job {job} (restart 1)" in text
    assert len([p for p in run_dir.iterdir() if p.is_dir()]) == 2  # one run dir per run
    state = slurm.run("scontrol", "show", "job", job, check=False).stdout
    assert not state or "JobState=COMPLETED" in state


def _wait_text(path: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} in {path}:\n{_tail(path)}")


def _tail(path: Path) -> str:
    return "\n".join(path.read_text().splitlines()[-60:]) if path.exists() else "(no log)"
