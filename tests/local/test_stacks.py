"""Hang stacks without a cluster: the dump parser and the straggler rule on recorded dumps, and
the node side for real (the real shim and probe in a child process, the guard's real rank server,
/proc, signals). The head's hang rule and the supervisor's hang path: ``unit/test_hang.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ptcluster.control.protocol import ControlError, alive, ask
from ptcluster.control.server import ControlServer
from ptcluster.launch.stacks.report import RankStack, StackReport, parse_faulthandler, rank_stack
from ptcluster.node.guard.outbox import Outbox
from ptcluster.node.guard.progress import ProgressMeter, find_pyspy
from ptcluster.node.guard.rank_server import RankServer
from ptcluster.node.rank import shim

TORCH = "/venv/lib/python3.11/site-packages/torch/distributed"
SHIM_FRAMES = ('  File "ptcluster-shim", line 141 in run_in_process\n'
               '  File "ptcluster-shim", line 200 in <module>\n'
               '  File "<string>", line 1 in <module>\n')
PROBE_THREAD = ('Thread 0x00007f0000000002 (most recent call first):\n'
                '  File "ptcluster-stack-probe", line 70 in _serve\n'
                '  File "/usr/lib/python3.11/threading.py", line 975 in run\n'
                '  File "/usr/lib/python3.11/threading.py", line 1038 in _bootstrap_inner\n'
                '  File "/usr/lib/python3.11/threading.py", line 995 in _bootstrap\n\n')


def dump(*inner: str, current: bool = True) -> str:
    """A faulthandler dump of a rank: the probe's thread, then the main thread with ``inner``
    frames (innermost first) above the user's module and the shim."""
    head = "Current thread" if current else "Thread"
    frames = "".join(f"  {f}\n" for f in inner)
    return (PROBE_THREAD + f"{head} 0x00007f0000000001 (most recent call first):\n" + frames
            + '  File "train.py", line 120 in <module>\n' + SHIM_FRAMES)


IN_ALL_REDUCE = dump(f'File "{TORCH}/distributed_c10d.py", line 3252 in all_reduce',
                     f'File "{TORCH}/c10d_logger.py", line 83 in wrapper',
                     'File "train.py", line 88 in train_step')
IN_LOAD = dump('File "data.py", line 40 in load_batch', 'File "train.py", line 86 in train_step')


def test_parse_keeps_the_users_frames_of_the_main_thread_only() -> None:
    (main,) = parse_faulthandler(IN_LOAD)
    assert main.main and [(f.file, f.line, f.func) for f in main.frames] == [
        ("data.py", 40, "load_batch"), ("train.py", 86, "train_step"),
        ("train.py", 120, "<module>")]  # no shim, no boot code, no probe thread


def test_parse_other_threads_and_odd_lines() -> None:
    text = ("Thread 0x00007f00000000aa (most recent call first):\n"
            '  File "loader.py", line ??? in worker\n  <no Python frame>\n\n'
            + IN_LOAD + "  ...\n")
    threads = parse_faulthandler(text)
    assert [t.main for t in threads] == [True, False]  # the main thread first
    assert threads[1].frames[0].func == "worker" and threads[1].frames[0].line == 0
    assert parse_faulthandler("") == [] and parse_faulthandler("garbage\n") == []


@pytest.mark.parametrize("text, where", [
    (IN_ALL_REDUCE, "all_reduce at train.py:88 (in train_step)"),
    (IN_LOAD, "in load_batch at data.py:40"),
    (dump(), "in <module> at train.py:120"),
])
def test_where_a_rank_is(text: str, where: str) -> None:
    assert rank_stack(0, "n1", {"text": text}).where() == where


def rs(rank: int, host: str, text: str, fr: dict | None = None, **raw: object) -> RankStack:
    return rank_stack(rank, host, {"text": text, "pid": 100 + rank, "fr": fr, **raw})


def fr(enq: int, comp: int, op: str = "gloo:all_reduce", ops: dict | None = None) -> dict:
    active = [{"pg": "default_pg", "seq": enq, "op": op}] if enq > comp else []
    return {"counts": {"enqueued": enq, "completed": comp, "waiting": ["0"] if enq > comp
                       else []}, "active": active, "ops": ops}


def test_straggler_by_the_flight_recorder_names_the_collective() -> None:
    report = StackReport(ranks=[rs(0, "n1", IN_ALL_REDUCE, fr(9, 8)),
                                rs(1, "n2", IN_LOAD, fr(8, 8)),
                                rs(2, "n3", IN_ALL_REDUCE, fr(9, 8))])
    late, why = report.straggler()
    assert [r.rank for r in late] == [1]
    assert why == "not in the collective the others wait in (gloo:all_reduce #9)"
    assert [g.label() for g in report.groups()] == [
        "ranks 0,2 on n1,n3: all_reduce #9 at train.py:88 (in train_step)",
        "rank 1 on n2: in load_batch at data.py:40"]
    lines = report.lines()
    assert lines[0].startswith("straggler: rank 1 on n2 (pid 101): in load_batch at data.py:40")
    assert lines.index("rank 1 on n2:") < lines.index("rank 0 on n1:")  # its stack first too


def test_a_report_with_no_rank_says_none_runs_yet() -> None:
    """Asked as soon as ``ps`` says running, before any rank's probe was up: it printed "no
    single rank differs from the others" and an empty "ranks by place:"."""
    lines = StackReport(ranks=[], reason="asked by `ptcluster stacks`").lines()
    assert lines == ["asked by `ptcluster stacks`",
                     "no straggler named: no rank of the job runs yet (or any more) on the "
                     "nodes that answered: ask again once the job prints its first lines"]


def test_straggler_by_stack_when_the_rank_cannot_answer() -> None:
    """A rank whose GIL is held answers no recorder question: its stack decides."""
    report = StackReport(ranks=[rs(0, "n1", IN_LOAD, None, note="its probe thread did not answer"),
                                rs(1, "n2", IN_ALL_REDUCE, fr(4, 3)),
                                rs(2, "n2", IN_ALL_REDUCE, fr(4, 3))])
    assert [r.rank for r in report.straggler()[0]] == [0]
    assert report.headline().startswith("straggler rank 0 on n1: in load_batch at data.py:40")


def test_desync_by_the_recorders_history() -> None:
    extra = {"gloo:all_reduce": 5}
    usual = {"gloo:all_reduce": 4, "gloo:barrier": 1}
    barrier = dump(f'File "{TORCH}/distributed_c10d.py", line 4800 in barrier',
                   'File "train.py", line 95 in main')
    report = StackReport(ranks=[rs(0, "n1", barrier, fr(5, 4, "gloo:barrier", usual)),
                                rs(1, "n2", IN_ALL_REDUCE, fr(5, 4, ops=extra)),
                                rs(2, "n3", barrier, fr(5, 4, "gloo:barrier", usual))])
    late, why = report.straggler()
    assert [r.rank for r in late] == [1]
    assert why == ("its collectives differ from the others' (a desync): issued "
                   "5 gloo:all_reduce, the others 4; 0 gloo:barrier, the others 1")


def test_desync_by_stack_alone_and_no_straggler_when_all_agree() -> None:
    barrier = dump(f'File "{TORCH}/distributed_c10d.py", line 4800 in barrier',
                   'File "train.py", line 95 in main')
    report = StackReport(ranks=[rs(0, "n1", barrier), rs(1, "n2", IN_ALL_REDUCE),
                                rs(2, "n3", barrier)])
    assert [r.rank for r in report.straggler()[0]] == [1]
    same = StackReport(ranks=[rs(0, "n1", IN_ALL_REDUCE), rs(1, "n2", IN_ALL_REDUCE)])
    assert same.named()[::2] == ([], "same-collective")


def test_a_rank_without_a_stack_is_named_when_the_others_have_one() -> None:
    report = StackReport(ranks=[rs(0, "n1", IN_ALL_REDUCE),
                                rs(1, "n2", "", error="no stack came back"),
                                rs(2, "n3", IN_ALL_REDUCE)])
    late, why = report.straggler()
    assert [r.rank for r in late] == [1] and why == "it gave no stack while the others did"
    assert report.to_json()["straggler"] == {"ranks": [1], "why": why, "rule": "no-stack"}


# -- the head's rule -------------------------------------------------------------------------
# -- the node side, for real -----------------------------------------------------------------
SHIM = Path(shim.__file__)


@pytest.fixture
def rank_server(tmp_path):
    server = RankServer(str(tmp_path / "g.sock"), Outbox(lambda data: None, 0.0))
    procs: list[subprocess.Popen[bytes]] = []

    def start(rank: int, code: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PTCLUSTER_GUARD_SOCK": server.path, "RANK": str(rank)}
        env.pop(shim.SHIM_VAR, None)
        proc = subprocess.Popen([sys.executable, "-u", str(SHIM), "-c", code], env=env,
                                start_new_session=True)
        procs.append(proc)
        return proc

    yield server, start
    for proc in procs:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait()
    server.close(1.0)


def wait_ready(server: RankServer, ranks: set[int], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while set(server.probes.ready) != ranks:
        assert time.monotonic() < deadline, f"probes ready: {set(server.probes.ready)}"
        time.sleep(0.05)


SLEEPS = ("import time\ndef load_batch():\n    time.sleep(60)\nprint('go', flush=True)\n"
          "load_batch()\n")
HOLDS_GIL = ("import ctypes\ndef read_sensor():\n    while True:\n"
             "        ctypes.PyDLL(None).sleep(60)\nread_sensor()\n")
BUSY = "while True:\n    sum(range(10000))\n"


def test_stacks_of_real_ranks_a_sleeping_one_and_one_holding_the_gil(rank_server) -> None:
    server, start = rank_server
    start(0, SLEEPS)
    start(1, HOLDS_GIL)
    wait_ready(server, {0, 1})
    want = {0: "in load_batch at <string>:3", 1: "in read_sensor at <string>:4"}
    deadline = time.monotonic() + 30  # (until both are in the call they stay in)
    while True:
        raw = server.probes.collect()
        report = StackReport(ranks=[rank_stack(int(r), "n", v) for r, v in raw.items()])
        where = {r.rank: r.where() for r in report.ranks}
        if where == want or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert where == want
    # the sleeping rank's own thread answers; the one holding the GIL needs the signal
    assert (raw["0"]["how"], raw["1"]["how"]) == ("probe thread", "signal (faulthandler)")
    assert all(v["ms"] is not None and v["ms"] < 1000 for v in raw.values())
    if find_pyspy() is not None:  # the `stacks` extra (installed for the tests): native frames
        native = report.ranks[[r.rank for r in report.ranks].index(1)].native
        assert "read_sensor" in native and "sleep (libc" in native, native


def test_progress_meter_tells_a_busy_rank_from_an_idle_one(rank_server) -> None:
    server, start = rank_server
    start(0, SLEEPS)
    start(1, BUSY)
    wait_ready(server, {0, 1})
    meter = ProgressMeter(server.probes)
    meter.sample()
    time.sleep(2.5)
    idle = meter.sample()
    assert idle["1"] == 0.0 and idle["0"] >= 2.0, idle


def test_control_socket_answers_its_owner_in_a_deep_run_dir(tmp_path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)  # longer than a socket path may be
    deep.mkdir(parents=True)
    asked: list[dict] = []
    server = ControlServer(deep, lambda request: asked.append(request) or {"ok": True})
    try:
        assert (deep / "control.sock").stat().st_mode & 0o777 == 0o600
        assert alive(deep) and asked == []  # looking is not asking
        assert ask(deep, {"cmd": "stacks"}) == {"ok": True} and asked == [{"cmd": "stacks"}]
    finally:
        server.close()
    assert not alive(deep)
    with pytest.raises(ControlError) as refused:
        ask(deep, {"cmd": "stacks"})
    assert refused.value.code == "control.no-job"


def test_the_head_door_answers_each_request_kind_without_the_loop() -> None:
    """control.server.HeadDoor, the socket's handler: kill checks the job and the signal and
    names the asker; KILL is two stop requests (a second Ctrl-C); straggler figures come at
    once when no loop runs; an unknown kind is refused by name."""
    from ptcluster.control.protocol import kill_request, stacks_request, straggler_request
    from ptcluster.control.server import HeadDoor

    stops: list[str] = []
    posted: list[object] = []
    door = HeadDoor("J1", posted.append, stops.append)
    by = {"host": "h", "user": "u"}
    assert door.answer(kill_request("J2", "TERM", by)) == {
        "ok": False, "error": "this head runs job J1, not J2"}
    assert door.answer(kill_request("J1", "HUP", by)) == {
        "ok": False, "error": "unknown signal 'HUP'"}
    assert stops == [] and door.killed_by == ""
    assert door.answer(kill_request("J1", "KILL", by)) == {"ok": True, "job_id": "J1",
                                                            "pid": os.getpid()}
    assert stops == ["ended by `ptcluster kill` from h (u)"] * 2
    door.figures = (3, {"ranks": [1]})
    door.job = {"attempt": 1, "world_size": 4, "nodes": 2}  # (as the loop sets it: `--serve`)
    assert door.answer(straggler_request()) == {"ok": True, "straggler": {"ranks": [1]},
                                                "job": {"attempt": 1, "world_size": 4,
                                                        "nodes": 2}}
    assert posted == []  # (no loop: nothing asked of it)
    assert door.answer({"cmd": "nope"}) == {"ok": False, "error": "unknown request 'nope'"}
    door.looping = True
    assert door.stacks(timeout=0.01) == {"ok": False, "error": "no stacks report within 0 s"}
    assert len(posted) == 1 and posted[0].what == stacks_request()["cmd"]
