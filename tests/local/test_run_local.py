"""`ptcluster run` on the local cluster: real torchrun, real gloo, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.head import Head, by_rank, job_id_when_started, only_run, run_head
from tests.support.procs import job_processes

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
    shim = os.environ.get("PTCLUSTER_SHIM", "")
    with open(os.path.join(out, f"env{os.environ['RANK']}.txt"), "w") as f:
        f.write(f"{max(len(v) for v in os.environ.values())} {shim} {os.path.isfile(shim)}")
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
    # Code is not in a rank's environment: the shim's path is, in the guard's temp dir (gone
    # with the job); the longest value is configuration (the user's PATH and the like).
    longest, shim, there = (out / "env0.txt").read_text().split()
    assert there == "True" and shim.endswith("/shim.py") and not os.path.exists(shim)
    assert int(longest) < max(len(v) for v in os.environ.values()) + 1000
    # each rank's lines, stdout and stderr, labelled with its node and rank, and its log
    said = {who: sorted(lines) for who, lines in by_rank(head.lines).items()}
    assert said == {("localhost", r): sorted([f"rank {r} says hello", f"to stderr from {r}"])
                    for r in (0, 1)}, head.output()
    run = tmp_path / "runs" / job_id
    assert sorted((run / "rank1.log").read_text().splitlines()) == said["localhost", 1]
    assert summary["ok"] is True and [r["exit_code"] for r in summary["ranks"]] == [0, 0]
    (node,) = summary["nodes"]  # what its guard reported: where peers reach it, torchrun's pid
    assert node["address"] == "127.0.0.1" and node["torchrun_pid"] > 1, node
    assert any("logs: runs/" + job_id in line for line in head.err)


def test_failing_rank_exit_1_root_cause_first(tmp_path, no_leftovers) -> None:
    (tmp_path / "fail.py").write_text(FAIL_SCRIPT)
    code, head = run_head(["run", "--nproc", "2", "--run-dir", "runs", "fail.py", "1"],
                          cwd=tmp_path, timeout=100)  # rank 0 is ended, not waited for (120 s)
    job_id, summary = only_run(tmp_path / "runs")
    no_leftovers.append(job_id)
    assert code == 1, head.output()
    assert summary["ranks"][0]["status"] == "stopped (job teardown)"
    rc = summary["root_cause"]
    assert rc["rank"] == 1 and rc["exit_code"] == 3 and rc["host"] == "localhost"
    assert rc["last_lines"] == ["about to fail"]
    text = "\n".join(head.err)
    assert f"Root cause (first observed failure): rank 1 on localhost: {rc['message']}" in text
    assert summary["ranks"][1]["status"] == "exit 3"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_head_ends_every_process(tmp_path, sig, no_leftovers) -> None:
    (tmp_path / "sleep.py").write_text(SLEEP_SCRIPT)
    head = Head(["run", "--nproc", "2", "--run-dir", "runs", "sleep.py"], cwd=tmp_path)
    try:
        job_id = job_id_when_started(tmp_path / "runs")
        no_leftovers.append(job_id)
        head.wait_for("ready", count=2)
        cmds = [cmd for _, cmd in job_processes(job_id)]
        assert len(cmds) == 6  # guard + torchrun + 2 x (shim + rank)
        assert sum("zlib" in cmd for cmd in cmds) == 1  # the guard is seen by the check
        head.signal(sig)
        code = head.wait(timeout=60)
    finally:
        if head.proc.poll() is None:
            head.kill()
    assert code == 128 + sig, head.output()
    assert job_processes(job_id, wait=5.0) == []
    _, summary = only_run(tmp_path / "runs")
    assert summary["interrupted"] and summary["nodes"][0]["reason"].startswith(
        "stopped by the head")  # the guard ended it in order; no channel was cut
    assert "Traceback" not in "\n".join(head.err) and "SignalException" not in \
        "\n".join(head.err + head.lines)
    # ... while the node log keeps what torchrun said about the signal it got from the guard.
    (node_log,) = (tmp_path / "runs" / job_id).glob("node0-*.log")
    assert "death signal" in node_log.read_text()


def test_sigkill_of_head_group_leaves_nothing(tmp_path, no_leftovers) -> None:
    (tmp_path / "sleep.py").write_text(SLEEP_SCRIPT)
    head = Head(["run", "--nproc", "2", "--run-dir", "runs", "sleep.py"], cwd=tmp_path)
    job_id = job_id_when_started(tmp_path / "runs")
    no_leftovers.append(job_id)
    head.wait_for("ready", count=2)
    head.kill()  # SIGKILL to the head's whole process group: no cleanup code runs there
    assert job_processes(job_id, wait=15.0) == []


EXITS_SCRIPT = textwrap.dedent("""
    import os, signal, sys, torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()
    rank = dist.get_rank()
    print(f"rank {rank} leaving", flush=True)
    if sys.argv[1] == "os_exit":
        os._exit(0)  # no interpreter shutdown, no atexit: the exit status is still 0
    if sys.argv[1] == "abort_at_exit":  # a library that crashes in the interpreter's shutdown
        dist.destroy_process_group()
        if rank == 1:
            import atexit; atexit.register(os.abort)
        if rank == 0 or sys.argv[2] == "exit":
            sys.exit(0)  # else: rank 1's program returns
    else:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        import time; time.sleep(120)
""")

RAISE_SCRIPT = textwrap.dedent("""
    import time, torch.distributed as dist
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        print("working", flush=True)
        raise RuntimeError("boom on purpose")
    time.sleep(120)
""")


def test_os_exit_0_is_success_with_torchrun_log_settings(tmp_path, no_leftovers) -> None:
    """Exit status comes from the shim, not from torchrun's output: a user's torchrun log
    template (which changes its line prefixes) and os._exit(0) are both fine."""
    (tmp_path / "exits.py").write_text(EXITS_SCRIPT)
    code, head = run_head(["run", "--nproc", "2", "--run-dir", "runs", "exits.py", "os_exit"],
                          cwd=tmp_path,
                          env={"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "<<${role_name}${rank}>>"})
    job_id, summary = only_run(tmp_path / "runs")
    no_leftovers.append(job_id)
    assert code == 0, head.output()
    assert [r["status"] for r in summary["ranks"]] == ["ok", "ok"]
    assert by_rank(head.lines) == {("localhost", r): [f"rank {r} leaving"] for r in (0, 1)}, \
        head.output()  # (the user's torchrun template changes none of our prefixes)


def test_rank_killed_by_a_signal_is_named(tmp_path, no_leftovers) -> None:
    (tmp_path / "exits.py").write_text(EXITS_SCRIPT)
    code, head = run_head(["run", "--nproc", "2", "--run-dir", "runs", "exits.py", "kill"],
                          cwd=tmp_path)
    job_id, summary = only_run(tmp_path / "runs")
    no_leftovers.append(job_id)
    assert code == 1, head.output()
    assert summary["root_cause"]["rank"] == 1 and summary["root_cause"]["exit_code"] == -9
    assert summary["root_cause"]["kind"] == "rank"
    assert f"rank 1 on localhost: {summary['root_cause']['message']}" in "\n".join(head.err)
    assert "returned" not in summary["root_cause"]["message"]
    assert summary["ranks"][0]["status"] == "stopped (job teardown)"


@pytest.mark.parametrize("how", ["return", "exit"])
def test_a_rank_that_dies_after_its_program_returned_is_told_apart(tmp_path, no_leftovers,
                                                                  how) -> None:
    """Its program had ended (returned, or sys.exit(0)): the report says so and names the
    likely cause, not only SIGABRT."""
    (tmp_path / "exits.py").write_text(EXITS_SCRIPT)
    code, head = run_head(["run", "--nproc", "2", "--run-dir", "runs", "exits.py",
                           "abort_at_exit", how], cwd=tmp_path)
    job_id, summary = only_run(tmp_path / "runs")
    no_leftovers.append(job_id)
    assert code == 1, head.output()  # the exit status is what the kernel gave: not hidden
    rc = summary["root_cause"]
    assert (rc["rank"], rc["exit_code"]) == (1, -signal.SIGABRT), rc
    assert rc["message"] == ("killed by SIGABRT after its program had returned, in the "
                             "interpreter's shutdown"), rc
    assert "PR 179291" in rc["fix"], rc


def test_root_cause_shows_the_traceback(tmp_path, no_leftovers) -> None:
    (tmp_path / "boom.py").write_text(RAISE_SCRIPT)
    code, head = run_head(["run", "--nproc", "2", "--run-dir", "runs", "boom.py"], cwd=tmp_path)
    job_id, summary = only_run(tmp_path / "runs")
    no_leftovers.append(job_id)
    assert code == 1, head.output()
    rc = summary["root_cause"]
    assert rc["rank"] == 1 and rc["exit_code"] == 1
    # (torch's own excepthook prefixes a distributed rank's traceback with "[rank1]: ")
    assert rc["last_lines"][-1].endswith("RuntimeError: boom on purpose")
    assert "working" in rc["last_lines"]
    assert any(line.endswith("RuntimeError: boom on purpose") and line.startswith("    ")
               for line in head.err), head.output()


@pytest.mark.parametrize("target, problem, fields", [
    (["missing.py"], "guard.script-missing", {"script": "missing.py"}),
    (["-m", "no_such_module_xyz.sub"], "guard.module-missing",
     {"module": "no_such_module_xyz.sub"}),
])
def test_missing_target_refused_before_any_rank_starts(tmp_path, target, problem, fields,
                                                       no_leftovers) -> None:
    code, head = run_head(["run", "--nproc", "2", "--run-dir", "runs", *target], cwd=tmp_path)
    job_id, summary = only_run(tmp_path / "runs")
    no_leftovers.append(job_id)
    assert code == 1, head.output()
    err = "\n".join(head.err)
    cause = summary["root_cause"]
    assert cause["code"] == problem and fields.items() <= cause["fields"].items(), cause
    assert f"Root cause (first observed failure): localhost: {cause['message']}" in err
    assert f"  code {problem}" in head.err and "Fix:" in err
    assert all(r["status"] == "not started" for r in summary["ranks"])
    assert "Traceback" not in err and not head.lines


def test_unwritable_run_dir_is_one_error_line(tmp_path, cli, monkeypatch) -> None:
    (tmp_path / "sleep.py").write_text(SLEEP_SCRIPT)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PTCLUSTER_CLUSTER", raising=False)
    code, out, err = cli("run", "--nproc", "2", "--run-dir", "/proc/nope", "sleep.py")
    assert code == 1, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Fix:" in errors[0] and "Traceback" not in err, err
    assert cli.problem.code == "run.run-dir-unwritable"
    assert cli.problem.fields["path"].startswith("/proc/nope/") and not out


FLOOD_SCRIPT = textwrap.dedent("""
    import sys, time
    out = sys.stdout
    start = time.monotonic()
    n = 0
    while time.monotonic() - start < float(sys.argv[1]):
        out.write("".join(f"line {n + i} of a flood\\n" for i in range(1000)))
        n += 1000
    out.flush()
    print(f"total {n}", flush=True)
""")


def start_flood(tmp_path: Path, seconds: int) -> subprocess.Popen[bytes]:
    """`ptcluster run` of a 1-rank job printing as fast as it can, stdout and stderr piped."""
    (tmp_path / "flood.py").write_text(FLOOD_SCRIPT)
    return subprocess.Popen([sys.executable, "-m", "ptcluster", "run", "--nproc", "1",
                             "--run-dir", "runs", "flood.py", str(seconds)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def test_paused_console_never_stops_the_job(tmp_path, no_leftovers) -> None:
    """Nobody reads the head's stdout for longer than the guards' heartbeat timeout (15 s),
    while the ranks print flat out: the job still ends well, every line is in the logs, and
    the console says how many lines it skipped."""
    proc = start_flood(tmp_path, seconds=20)
    try:
        time.sleep(25)  # the console is "paused": its pipe is full and nobody reads it
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    job_id, summary = only_run(tmp_path / "runs")
    no_leftovers.append(job_id)
    assert proc.returncode == 0, err.decode()[-3000:]
    log = (tmp_path / "runs" / job_id / "rank0.log").read_text().splitlines()
    total = int(log[-1].split()[1])
    assert total > 100_000 and len(log) == total + 1  # every line, in order
    assert log[0] == "line 0 of a flood" and log[-2] == f"line {total - 1} of a flood"
    assert b"line(s) not shown (the console fell behind), see" in out
    assert summary["console_dropped"] > 0  # the count the console printed
    assert f"{summary['console_dropped']} line(s) were not shown".encode() in err


def test_closed_stdout_the_job_goes_on_into_its_logs(tmp_path, no_leftovers) -> None:
    """`ptcluster run … | head -2`: the console is gone, the job is not."""
    proc = start_flood(tmp_path, seconds=3)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        proc.stdout.close()
        err = proc.stderr.read().decode() if proc.stderr else ""
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    job_id, summary = only_run(tmp_path / "runs")
    no_leftovers.append(job_id)
    assert code == 0, err[-3000:]
    assert f"ptcluster: stdout was closed; the job goes on, its output is in runs/{job_id}/" \
        in err.splitlines() and "Traceback" not in err, err  # said once, as it is
    assert summary["ok"] is True
    assert (tmp_path / "runs" / job_id / "rank0.log").read_text().splitlines()[-1]\
        .startswith("total ")
