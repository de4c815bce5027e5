"""The node side without ssh or torch: the real shim talking to the guard's real rank server
over its Unix socket, frames checked as the head would decode them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ptcluster.launch.supervise import events as ev
from ptcluster.node.guard.outbox import HOLD_BYTES, Outbox
from ptcluster.node.guard.rank_server import RankServer
from ptcluster.node.rank import shim

SHIM = Path(shim.__file__)


def run_ranks(tmp_path: Path, code: str, ranks: tuple[int, ...] = (3,), wait: float = 3.0,
              hold: float = 0.0) -> list[tuple[float, bytes]]:
    """Run ``python -c code`` as each of ``ranks`` under the shim, all at once, with a rank
    server whose output is held ``hold`` s: every write it made, with its time."""
    writes: list[tuple[float, bytes]] = []
    server = RankServer(str(tmp_path / "g.sock"),
                        Outbox(lambda data: writes.append((time.monotonic(), data)), hold))
    procs = []
    for rank in ranks:
        env = {**os.environ, "PTCLUSTER_GUARD_SOCK": server.path, "RANK": str(rank),
               "LOCAL_RANK": "1"}
        env.pop(shim.SHIM_VAR, None)
        procs.append(subprocess.Popen([sys.executable, "-u", str(SHIM), "-c", code], env=env))
    for proc in procs:
        proc.wait(timeout=60)
    server.close(wait)
    return writes


def decoded(data: bytes) -> list[ev.Event]:
    return [ev.decode("n", line) for line in data.decode().splitlines()]


def run_rank(tmp_path: Path, code: str, wait: float = 3.0) -> list[ev.Event]:
    """Run ``python -c code`` as rank 3 under the shim; the frames the guard sent, decoded."""
    return decoded(b"".join(data for _, data in run_ranks(tmp_path, code, wait=wait)))


def texts(events: list[ev.Event], stream: str) -> list[str]:
    return [e.text for e in events if isinstance(e, ev.RankOutput) and e.stream == stream]


def test_output_by_stream_and_exit_after_the_last_line(tmp_path) -> None:
    events = run_rank(tmp_path, "import sys\nprint('out 1')\nprint('err 1', file=sys.stderr)\n"
                                "raise ValueError('bad value')")
    assert texts(events, "out") == ["out 1"]
    err = texts(events, "err")
    assert err[0] == "err 1" and err[-1] == "ValueError: bad value"
    assert err[1] == "Traceback (most recent call last):" and "shim" not in " ".join(err)
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "RankStart" and kinds[-1] == "RankExit"  # after every output line
    (error,) = [e for e in events if isinstance(e, ev.RankError)]
    assert error.rank == 3 and error.text == "ValueError: bad value"
    assert events[-1] == ev.RankExit("n", 3, 1, events[-1].node_time, events[-1].duration)


@pytest.mark.parametrize("code, status", [
    ("import os; os._exit(0)", 0),
    ("import sys; sys.exit(7)", 7),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL),
    ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGTERM),
])
def test_exit_status_as_the_kernel_gave_it(tmp_path, code, status) -> None:
    events = run_rank(tmp_path, code)
    (exit_event,) = [e for e in events if isinstance(e, ev.RankExit)]
    assert exit_event.code == status


def test_progress_bars_and_prompts_become_lines(tmp_path) -> None:
    events = run_rank(tmp_path, "import sys, time\n"
                                "sys.stdout.write('10%\\r20%\\r30%\\r\\n')\n"
                                "sys.stdout.write('a\\r\\nb\\n')\n"
                                "sys.stdout.write('name? ')\nsys.stdout.flush()\ntime.sleep(2.5)\n"
                                "print('done')")
    assert texts(events, "out") == ["10%", "20%", "30%", "a", "b", "name? ", "done"]


def test_a_child_holding_stdout_delays_the_exit_only_boundedly(tmp_path) -> None:
    """The rank leaves a background child that keeps its stdout: the exit is sent anyway after
    EXIT_WAIT (the child's later lines still arrive while it runs)."""
    events = run_rank(tmp_path, "import subprocess, sys\n"
                                "subprocess.Popen([sys.executable, '-c', "
                                "'import time; time.sleep(6)'])\nprint('parent done')", wait=10)
    assert texts(events, "out") == ["parent done"]
    assert any(isinstance(e, ev.RankExit) and e.code == 0 for e in events)


def test_held_output_goes_in_few_writes_and_each_ranks_exit_after_its_lines(tmp_path) -> None:
    """Four ranks print five lines each, 0.1 s apart, under a hold longer than the job: their
    20 lines reach the head in at most one write per start or exit (records are never held, and
    take the output held before them along), every rank's exit after its own last line."""
    writes = run_ranks(tmp_path, "import time\nfor i in range(5):\n    print('line', i)\n"
                                 "    time.sleep(0.1)", ranks=(0, 1, 2, 3), hold=30.0)
    events = decoded(b"".join(data for _, data in writes))
    for rank in range(4):
        mine = [e for e in events if getattr(e, "rank", None) == rank]
        assert [e.text for e in mine if isinstance(e, ev.RankOutput)] == \
            [f"line {i}" for i in range(5)]
        assert isinstance(mine[-1], ev.RankExit) and mine[-1].code == 0
    with_output = [decoded(data) for _, data in writes if b"\no " in b"\n" + data]
    assert 1 <= len(with_output) <= 8, with_output  # (a start or an exit each)
    assert not any(isinstance(frames[-1], ev.RankOutput) for frames in with_output)


def test_held_output_goes_when_its_hold_is_up(tmp_path) -> None:
    """A line, then 1.5 s of silence: it goes alone once its 0.3 s hold is up, not at once
    and not with the exit."""
    writes = run_ranks(tmp_path, "import time\nprint('early')\ntime.sleep(1.5)", hold=0.3)
    (start_at, _), = [(t, d) for t, d in writes if d.startswith(b"rstart ")]
    (line_at, line), = [(t, d) for t, d in writes if b"o 3 early" in d]
    (exit_at, _), = [(t, d) for t, d in writes if b"rexit " in d]
    assert b"rexit" not in line and exit_at - line_at > 0.5, writes
    assert line_at - start_at >= 0.25, writes  # (held: printed right after the start)


def test_the_outbox_keeps_the_order_and_a_bounded_hold() -> None:
    writes: list[bytes] = []
    box = Outbox(writes.append, 60.0)
    box.later(b"o 0 a\n")
    box.later(b"o 1 b\n")
    assert writes == [] and box.due() is not None
    box.now(b"hb {}\n")
    assert writes == [b"o 0 a\no 1 b\nhb {}\n"] and box.due() is None
    big = b"o 0 " + b"x" * (HOLD_BYTES // 4) + b"\n"
    for _ in range(4):
        box.later(big)
    assert writes[1:] == [big * 4]  # past HOLD_BYTES it goes at once
    box.later(b"o 0 c\n")
    box.flush_due()  # (its hold is not up)
    assert len(writes) == 2
    box.flush()
    assert writes[2] == b"o 0 c\n"
    box.later(b"o 0 e\n")
    box.later(b"o 1 f\n", came=time.monotonic() - 61.0)  # held from when it came: the
    assert box.due() == 0.0  # earliest line decides, whichever was added first
    box.flush_due()
    assert writes[3] == b"o 0 e\no 1 f\n"
    unheld: list[bytes] = []
    Outbox(unheld.append, 0.0).later(b"o 0 d\n")
    assert unheld == [b"o 0 d\n"]


@pytest.mark.no_job  # the program is missing: nothing starts
@pytest.mark.parametrize("transport, words", [
    ("ssh", "install the OpenSSH client"),
    ("srun", "Slurm's clients"),
    ("local", "set python: to an interpreter that exists"),
])
def test_a_channel_that_cannot_start_names_the_local_program_that_is_missing(
        tmp_path, monkeypatch, transport, words) -> None:
    """ssh or srun missing on the head is not a bad `python:` (the node's interpreter)."""
    from ptcluster.cluster import SshSpec
    from ptcluster.errors import Problem
    from ptcluster.node import GUARD
    from ptcluster.remote.channel import NodeChannel, start_all
    from ptcluster.remote.slurm import SrunTransport
    from ptcluster.remote.transport import LocalTransport, SshTransport

    monkeypatch.setenv("PATH", str(tmp_path))  # nothing to start here
    t = {"ssh": SshTransport(host="n1", ssh=SshSpec()),
         "srun": SrunTransport(host="10.0.0.1", node="n1", job_id="7"),
         "local": LocalTransport(host="localhost")}[transport]
    channel = NodeChannel(t, "/no/such/python" if transport == "local" else "python3", GUARD,
                          {}, on_frames=lambda lines: None, on_closed=lambda code, err: None)
    errors: list[Problem] = []
    assert start_all([channel], lambda c, said: errors.append(said)) == []
    ((problem, fix),) = [(said.what, said.fix or "") for said in errors]
    assert problem.startswith("cannot start"), problem
    assert words in fix, fix


@pytest.mark.no_job  # (the guard is never told to go)
@pytest.mark.parametrize("every", [0.2, 0.6])
def test_the_guard_beats_as_often_as_its_config_says(tmp_path, every) -> None:
    """The real guard, started by the real channel on this machine: its heartbeats come every
    ``heartbeat_every`` s of the config the head gives it (longer on large clusters)."""
    import threading
    import time

    from ptcluster.cluster import local_cluster
    from ptcluster.launch.options import RunOptions
    from ptcluster.launch.plan import Target, new_job_id, plan_launch
    from ptcluster.node import GUARD
    from ptcluster.remote.channel import NodeChannel, close_all, start_all
    from ptcluster.remote.transport import LocalTransport

    (tmp_path / "t.py").write_text("")
    # a job id of its own: a fixed one is refused while another test run's guard holds it
    plan = plan_launch(local_cluster(1), Target(script=str(tmp_path / "t.py")), port=0,
                       job_id=new_job_id())
    opts = RunOptions(heartbeat_interval=every)
    cfg = plan.nodes[0].guard_config(plan, opts)
    assert cfg["heartbeat_every"] == every
    beats: list[float] = []
    seen: list[str] = []
    ready = threading.Event()

    def frames(lines: list[str]) -> None:
        for line in lines:
            if line.startswith("hb "):
                beats.append(time.monotonic())
            elif line.startswith(("ready ", "error ")):
                seen.append(line)
                ready.set()

    channel = NodeChannel(LocalTransport(host="localhost"), sys.executable, GUARD, cfg,
                          on_frames=frames, on_closed=lambda code, err: None, heartbeat=every)
    started = start_all([channel], lambda c, said: None)
    try:
        assert ready.wait(30), channel.stderr
        assert seen[0].startswith("ready "), seen
        time.sleep(0.3 + 6 * every)
    finally:
        close_all(started, timeout=10)
    gaps = [b - a for a, b in zip(beats, beats[1:], strict=False)]
    assert len(gaps) >= 4, beats
    gaps.sort()  # (the median: a loaded machine may delay a beat or two)
    assert 0.75 * every <= gaps[len(gaps) // 2] <= 1.4 * every, gaps


# -- the guard's pure parts ----------------------------------------------------------------------
def test_the_ranks_env_is_the_plan_with_the_leased_gpus_and_no_srun_task_identity(
        monkeypatch, tmp_path) -> None:
    from ptcluster.node.guard import spawn

    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    cfg = {"env": {"OMP_NUM_THREADS": "1"}, "env_defaults": {"OMP_NUM_THREADS": "4", "X": "y"}}
    facts = {"gpus": {"indices": [2, 3], "visible": "2,3"}, "interface": "eth1"}
    env = spawn.rank_env(cfg, facts, str(tmp_path), "/s.sock")
    assert "SLURM_PROCID" not in env and env["SLURM_JOB_ID"] == "77"  # the job's stay
    assert env["OMP_NUM_THREADS"] == "1" and env["X"] == "y"  # the plan, then its defaults
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["NCCL_SOCKET_IFNAME"] == "ib0" and env["GLOO_SOCKET_IFNAME"] == "eth1"
    assert env["PET_LOG_DIR"] == str(tmp_path) and env[spawn.SHIM_VAR].startswith(str(tmp_path))
    assert env[spawn.SOCK_VAR] == "/s.sock"
    argv = ["torchrun", "--master-port", "29500", "t.py"]
    spawn.use_port(argv, 29517)
    assert argv == ["torchrun", "--master-port", "29517", "t.py"]


@pytest.mark.parametrize(("backend", "gpus", "theirs", "told"), [
    ("gloo", None, None, "true"), ("auto", None, None, "true"), (None, None, None, "true"),
    ("nccl", None, None, None), ("gloo", {"indices": [0], "visible": "0"}, None, None),
    ("auto", {"visible": "1", "why": "set by Slurm"}, None, None), ("gloo", None, "false", "false"),
])
def test_a_cpu_nodes_gloo_ranks_tell_accelerate_to_use_the_cpu(
        backend, gpus, theirs, told, monkeypatch, tmp_path) -> None:
    """Accelerate >= 1.16 counts a CPU job's ranks only with ``ACCELERATE_USE_CPU``: set where
    the node has no GPU and the job runs gloo, unless the user's env says otherwise."""
    from ptcluster.node.guard import spawn

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    cfg = {"env": {**({"PTCLUSTER_BACKEND": backend} if backend else {}),
                   **({"ACCELERATE_USE_CPU": theirs} if theirs else {})}}
    env = spawn.rank_env(cfg, {"gpus": gpus} if gpus else {}, str(tmp_path), "/s.sock")
    assert env.get("ACCELERATE_USE_CPU") == told


def test_the_first_stop_request_is_the_one_told() -> None:
    import signal as sig

    from ptcluster.node.guard.link import StopRequest

    stop = StopRequest()
    assert not stop.is_set()
    stop.request("the guard got SIGTERM", signum=sig.SIGTERM)
    stop.request("stopped by the head", by_head=True)
    assert stop.is_set() and stop.reason == "the guard got SIGTERM"
    assert stop.signal == "SIGTERM" and not stop.by_head


def test_gpus_asked_for_are_checked_and_a_refusal_names_who_holds_them() -> None:
    from ptcluster.node.guard import gpus
    from ptcluster.node.guard.refusal import GuardError

    assert gpus._candidates("auto", 2, 4) == ([0, 1, 2, 3], 2)
    assert gpus._candidates([3, 1], 8, 4) == ([3, 1], 2)
    with pytest.raises(GuardError) as info:
        gpus._candidates([0, 5, 6], 3, 4)
    assert (info.value.code, info.value.fields["missing"]) == ("guard.gpu-not-there", "5-6")
    refusal = gpus._refusal(2, 1, {"job J (alice)": [0, 1]}, {"alice"}, 4)
    assert refusal.busy and refusal.code == "guard.gpus-busy"
    assert refusal.fields == {"need": "2", "free": "1", "held": "GPUs 0-1 are in use by job J "
                              "(alice)", "other": ", choose other GPUs (gpus: [2, 3])",
                              "ask": ", or ask alice"}
    # (the one rendering, kept once: the table's fix with those values)
    assert refusal.fix == "wait for them (run --wait), choose other GPUs (gpus: [2, 3]), " \
                          "or ask alice"
