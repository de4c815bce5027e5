"""`ptcluster run` on the local cluster: real torchrun, real gloo, real signals."""

from __future__ import annotations

import signal
import textwrap
import time

import pytest

from tests.jobs import Head, job_id_when_started, only_run, run_head
from tests.procs import job_processes

pytestmark = pytest.mark.slow

RANKS_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    out = sys.argv[1]
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    with open(os.path.join(out, f"rank{os.environ['RANK']}.txt"), "w") as f:
        f.write(" ".join([os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"],
                          str(int(t.item())), os.environ.get("GLOO_SOCKET_IFNAME", ""),
                          os.environ.get("PTCLUSTER_BACKEND", "")]))
    print(f"rank {dist.get_rank()} says hello")
    print(f"to stderr from {dist.get_rank()}", file=sys.stderr)
    dist.destroy_process_group()
""")

FAIL_SCRIPT = textwrap.dedent("""
    import os, sys, time, torch.distributed as dist
    dist.init_process_group("gloo")
    if dist.get_rank() == int(sys.argv[1]):
        print("about to fail", flush=True)
        time.sleep(0.5)
        sys.exit(3)
    time.sleep(120)
""")

SLEEP_SCRIPT = textwrap.dedent("""
    import time, torch.distributed as dist
    dist.init_process_group("gloo")
    print("ready", flush=True)
    for _ in range(1200):
        time.sleep(0.1)
""")


def test_two_rank_gloo_job_env_prefixes_logs_summary(tmp_path, no_leftovers) -> None:
    (tmp_path / "ranks.py").write_text(RANKS_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    code, head = run_head(["run", "--nproc", "2", "--run-dir", "runs", "ranks.py", str(out)],
                          cwd=tmp_path)
    job_id, summary = only_run(tmp_path / "runs")
    no_leftovers.append(job_id)
    assert code == 0, head.output()
    # RANK LOCAL_RANK WORLD_SIZE all_reduce(sum of rank+1) GLOO_SOCKET_IFNAME backend
    assert (out / "rank0.txt").read_text() == "0 0 2 3 lo auto"
    assert (out / "rank1.txt").read_text() == "1 1 2 3 lo auto"
    assert "[localhost:0] rank 0 says hello" in head.lines
    assert "[localhost:1] rank 1 says hello" in head.lines
    assert "[localhost:1] to stderr from 1" in head.lines
    run = tmp_path / "runs" / job_id
    assert "rank 1 says hello" in (run / "rank1.log").read_text()
    assert "rank 0 says hello" not in (run / "rank1.log").read_text()
    assert summary["ok"] is True and [r["exit_code"] for r in summary["ranks"]] == [0, 0]
    assert any("logs: runs/" + job_id in line for line in head.err)


def test_failing_rank_exit_1_root_cause_first(tmp_path, no_leftovers) -> None:
    (tmp_path / "fail.py").write_text(FAIL_SCRIPT)
    t0 = time.monotonic()
    code, head = run_head(["run", "--nproc", "2", "--run-dir", "runs", "fail.py", "1"],
                          cwd=tmp_path)
    elapsed = time.monotonic() - t0
    job_id, summary = only_run(tmp_path / "runs")
    no_leftovers.append(job_id)
    assert code == 1, head.output()
    assert elapsed < 60  # the sleeping rank 0 was ended, not waited for (120 s)
    rc = summary["root_cause"]
    assert rc["rank"] == 1 and rc["exit_code"] == 3 and rc["host"] == "localhost"
    assert "about to fail" in rc["last_lines"]
    text = "\n".join(head.err)
    assert "Root cause (first observed failure): rank 1 on localhost: exited with code 3" in text
    assert summary["ranks"][1]["status"] == "exit 3"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_head_ends_every_process(tmp_path, sig, no_leftovers) -> None:
    (tmp_path / "sleep.py").write_text(SLEEP_SCRIPT)
    head = Head(["run", "--nproc", "2", "--run-dir", "runs", "sleep.py"], cwd=tmp_path)
    try:
        job_id = job_id_when_started(tmp_path / "runs")
        no_leftovers.append(job_id)
        head.wait_for("ready", count=2)
        assert len(job_processes(job_id)) >= 3  # torchrun + 2 ranks (+ guard)
        t0 = time.monotonic()
        head.signal(sig)
        code = head.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        if head.proc.poll() is None:
            head.kill()
    assert code != 0
    assert took < 10, f"head took {took:.1f} s to end the job"
    assert job_processes(job_id, wait=1.0) == []


def test_sigkill_of_head_group_leaves_nothing(tmp_path, no_leftovers) -> None:
    (tmp_path / "sleep.py").write_text(SLEEP_SCRIPT)
    head = Head(["run", "--nproc", "2", "--run-dir", "runs", "sleep.py"], cwd=tmp_path)
    job_id = job_id_when_started(tmp_path / "runs")
    no_leftovers.append(job_id)
    head.wait_for("ready", count=2)
    head.kill()  # SIGKILL to the head's whole process group: no cleanup code runs there
    assert job_processes(job_id, wait=15.0) == []
