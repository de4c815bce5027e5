"""`ptcluster kill` through the job's head (its control socket, found in the user's registry of
heads) and its fall back to the guards: the registry's safety on its own, the decision against
a real control server, and real local jobs ended from another process."""

from __future__ import annotations

import getpass
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from ptcluster.control import registry as heads
from ptcluster.control.kill import stop_through_head
from ptcluster.control.protocol import ask
from ptcluster.control.server import ControlServer
from ptcluster.rundir import RunDir
from tests.support.head import Head, job_id_when_started, only_run
from tests.support.procs import job_processes

SRC = Path(__file__).resolve().parents[2] / "src"
BY = {"host": "h1", "user": "u1"}
SLEEP_SCRIPT = textwrap.dedent("""
    import time, torch.distributed as dist
    dist.init_process_group("gloo")
    print("ready", flush=True)
    for _ in range(1200):
        time.sleep(0.1)
""")


@pytest.fixture
def state(tmp_path, monkeypatch) -> Path:
    """This test's own registry of heads (``$XDG_STATE_HOME``), for this process."""
    d = tmp_path / "state"
    monkeypatch.setenv("XDG_STATE_HOME", str(d))
    return d


def entry_path(state: Path, job_id: str) -> Path:
    return state / "ptcluster" / "heads" / f"{job_id}.json"


def plant(state: Path, record: dict) -> None:
    """An entry written by hand (a head of another machine, a dead one)."""
    d = state / "ptcluster" / "heads"
    d.mkdir(parents=True, mode=0o700, exist_ok=True)
    path = d / f"{record['job_id']}.json"
    path.write_text(json.dumps(record))
    path.chmod(0o600)


def dead_socket(run_dir: Path) -> None:
    """What a head killed by SIGKILL leaves: a socket file nobody listens on."""
    run_dir.mkdir(parents=True, exist_ok=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(RunDir(run_dir).control_socket))
    s.close()


# -- the registry -------------------------------------------------------------------------------
def test_register_find_unregister(state, tmp_path) -> None:
    heads.register("J1", tmp_path / "runs" / "J1")
    d = state / "ptcluster" / "heads"
    assert oct(d.stat().st_mode & 0o777) == "0o700"
    assert oct(entry_path(state, "J1").stat().st_mode & 0o777) == "0o600"
    entry = heads.find("J1")
    assert entry == heads.HeadEntry(job_id="J1", run_dir=tmp_path / "runs" / "J1",
                                    host=socket.gethostname(), pid=os.getpid())
    assert entry.here and heads.find("J2") is None
    heads.unregister("J1")
    assert heads.find("J1") is None and not entry_path(state, "J1").exists()


def test_a_job_id_that_is_not_a_plain_name_is_never_a_path(state, tmp_path) -> None:
    plant(state, {"job_id": "J1", "run_dir": str(tmp_path), "host": "x", "pid": 1})
    for bad in ("../heads/J1", "/etc/passwd", ".J1", "", "J1/x"):
        assert heads.find(bad) is None
        with pytest.raises(OSError):
            heads.register(bad, tmp_path)


def test_a_symlinked_or_shared_registry_is_refused(state, tmp_path) -> None:
    elsewhere = tmp_path / "elsewhere"
    plant(elsewhere, {"job_id": "J1", "run_dir": str(tmp_path), "host": "x", "pid": 1})
    (state / "ptcluster").mkdir(parents=True)
    (state / "ptcluster" / "heads").symlink_to(elsewhere / "ptcluster" / "heads")
    assert heads.find("J1") is None  # not followed
    with pytest.raises(OSError):
        heads.register("J2", tmp_path)
    assert not (elsewhere / "ptcluster" / "heads" / "J2.json").exists()
    (state / "ptcluster" / "heads").unlink()
    plant(state, {"job_id": "J1", "run_dir": str(tmp_path), "host": "x", "pid": 1})
    (state / "ptcluster" / "heads").chmod(0o755)  # readable by others: not the user's alone
    assert heads.find("J1") is None
    with pytest.raises(OSError, match="must be 700"):
        heads.register("J2", tmp_path)


def test_a_planted_or_foreign_entry_is_not_trusted(state, tmp_path) -> None:
    record = {"job_id": "J1", "run_dir": str(tmp_path), "host": socket.gethostname(), "pid": 1}
    plant(elsewhere := tmp_path / "other", record)
    heads.register("J0", tmp_path)  # makes the directory
    entry_path(state, "J1").symlink_to(entry_path(elsewhere, "J1"))
    assert heads.find("J1") is None
    entry_path(state, "J1").unlink()
    plant(state, {**record, "job_id": "J3"})  # an entry whose name is not its job
    entry_path(state, "J3").rename(entry_path(state, "J1"))
    assert heads.find("J1") is None
    if os.getuid() == 0:  # a file of another user in one's own directory
        plant(state, record)
        os.chown(entry_path(state, "J1"), 65534, 65534)
        assert heads.find("J1") is None


def test_a_new_head_removes_dead_heads_entries_of_this_machine_only(state, tmp_path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = int(gone.stdout)
    here = socket.gethostname()
    plant(state, {"job_id": "J1", "run_dir": str(tmp_path), "host": here, "pid": dead})
    plant(state, {"job_id": "J2", "run_dir": str(tmp_path), "host": "other", "pid": dead})
    heads.register("J3", tmp_path)
    assert heads.find("J1") is None and heads.find("J2") is not None


# -- asking a head ------------------------------------------------------------------------------
def test_a_head_that_takes_the_request_is_waited_for(state, tmp_path) -> None:
    asked: list[dict] = []
    server: ControlServer | None = None

    def handler(request: dict) -> dict:
        asked.append(request)
        threading.Timer(0.5, lambda: server and server.close()).start()  # the job ends
        return {"ok": True}

    server = ControlServer(tmp_path, handler, job_id="J1")
    assert not server.unregistered and heads.find("J1") is not None
    t0 = time.monotonic()
    got = stop_through_head("J1", "TERM", BY, wait=10.0)
    assert got.taken and got.ended and got.entry is not None, got
    assert 0.4 < time.monotonic() - t0 < 5.0
    assert asked == [{"cmd": "kill", "job_id": "J1", "signal": "TERM", "by": BY}]
    assert heads.find("J1") is None  # the server's close removed its entry


def test_a_head_still_stopping_at_the_timeout_is_said(state, tmp_path) -> None:
    server = ControlServer(tmp_path, lambda request: {"ok": True}, job_id="J1")
    try:
        got = stop_through_head("J1", "TERM", BY, wait=0.5)
        assert got.taken and not got.ended
    finally:
        server.close()


@pytest.mark.parametrize("case", ["none", "elsewhere", "stale", "refuses"])
def test_what_sends_kill_to_the_guards(state, tmp_path, case) -> None:
    here = socket.gethostname()
    run_dir = tmp_path / "run"
    server = None
    if case == "elsewhere":  # a home shared by machines: a head of another one
        plant(state, {"job_id": "J1", "run_dir": str(run_dir), "host": "n9", "pid": 1})
    elif case == "stale":
        dead_socket(run_dir)
        plant(state, {"job_id": "J1", "run_dir": str(run_dir), "host": here,
                      "pid": os.getpid()})
    elif case == "refuses":  # a head from before `kill` was a request
        server = ControlServer(tmp_path, lambda r: {"ok": False,
                                                    "error": "unknown request 'kill'"},
                               job_id="J1")
    try:
        got = stop_through_head("J1", "TERM", BY, wait=5.0)
    finally:
        if server is not None:
            server.close()
    assert not got.taken
    assert got.why_not == {"none": "", "elsewhere": "its head runs on n9",
                           "stale": f"the job of {run_dir} is no longer running (its head is "
                                    "gone)",
                           "refuses": "its head says: unknown request 'kill'"}[case]
    if case == "stale":
        assert heads.find("J1") is None  # forgotten: the next kill does not ask it
    if case == "elsewhere":
        assert heads.find("J1") is not None  # not this machine's to forget


def test_through_the_guards_every_node_is_asked_and_a_job_that_runs_nowhere_is_said() -> None:
    """The real kill program on this machine (the local transport): the job holds no lease
    here, so its guard is found nowhere: nothing signalled, nothing refused, nothing failed."""
    from ptcluster.cluster import local_cluster
    from ptcluster.control.kill import GuardsStop, stop_through_guards

    stop = stop_through_guards(local_cluster(1), "no-such-job-7f3e", "TERM", BY, timeout=30)
    assert stop == GuardsStop() and not stop.ok


def _as_nobody() -> tuple[list[str], dict[str, str]] | None:
    """argv and env to run ``/usr/bin/python3`` as nobody with this checkout's ptcluster, or
    None where that cannot be (not root, no setpriv, nobody cannot read the packages)."""
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        return None
    argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3"]
    env = {"PYTHONPATH": os.pathsep.join([str(SRC), *(p for p in sys.path
                                                       if p.endswith("site-packages"))]),
           "HOME": "/nonexistent"}
    probe = subprocess.run([*argv, "-c", "import ptcluster.cli"], cwd="/", env=env,
                           capture_output=True, text=True, timeout=30)
    return None if probe.returncode else (argv, env)


def _nobody(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python3 -c code`` as nobody (skips the test where it cannot)."""
    how = _as_nobody()
    if how is None:
        pytest.skip("cannot act as nobody here (needs root, setpriv, readable packages)")
    argv, env = how
    return subprocess.run([*argv, "-c", code, *args], cwd="/", env=env, capture_output=True,
                          text=True, timeout=60)


def test_only_the_owner_or_root_is_answered_on_the_socket() -> None:
    """The socket is 0600 (nobody cannot connect); and were it open to all, the server still
    answers only its own uid and root."""
    shared = Path(tempfile.mkdtemp(dir="/tmp", prefix="ptc-control-"))
    os.chmod(shared, 0o755)
    server = ControlServer(shared, lambda request: {"ok": True, "asked": request})
    code = ("import sys, json; from pathlib import Path\n"
            "from ptcluster.control.protocol import ControlError, ask\n"
            "try: print(json.dumps(ask(Path(sys.argv[1]), {'cmd': 'x'}, timeout=5, owner=0)))\n"
            "except ControlError as e: print(json.dumps([e.code, e.problem.fields]))")

    def refused() -> list:
        as_nobody = _nobody(code, str(shared))
        assert as_nobody.returncode == 0, as_nobody.stdout + as_nobody.stderr
        return json.loads(as_nobody.stdout)

    try:
        assert ask(shared, {"cmd": "x"}) == {"ok": True, "asked": {"cmd": "x"}}
        assert refused() == ["control.not-asked", {"why": "Permission denied"}]
        os.chmod(RunDir(shared).control_socket, 0o666)
        assert refused() == ["control.closed", {"run_dir": str(shared)}]  # the peer uid check
        assert ask(shared, {"cmd": "x"})["ok"]  # the owner still is
    finally:
        server.close()
        shutil.rmtree(shared, ignore_errors=True)


# -- real jobs ----------------------------------------------------------------------------------
def _start(tmp_path: Path, state: Path) -> tuple[Head, str]:
    (tmp_path / "sleep.py").write_text(SLEEP_SCRIPT)
    head = Head(["run", "--nproc", "2", "--run-dir", "runs", "sleep.py"], cwd=tmp_path,
                env={"XDG_STATE_HOME": str(state)})
    job_id = job_id_when_started(tmp_path / "runs")
    head.wait_for("ready", count=2)
    return head, job_id


def _kill(job_id: str, state: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`ptcluster kill` from another process (and another directory: no cluster file there)."""
    cwd.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "ptcluster", "kill", job_id], cwd=cwd,
                          env={**os.environ, "XDG_STATE_HOME": str(state)},
                          capture_output=True, text=True, timeout=120)


def _ended(head: Head, job_id: str, tmp_path: Path) -> dict:
    """The head exited 143 naming `ptcluster kill` as the cause; nothing of the job is left."""
    code = head.wait(timeout=120)
    assert code == 143, head.output()
    cause = f"ended by `ptcluster kill` from {socket.gethostname()} ({getpass.getuser()})"
    assert f"ptcluster: {cause}" in head.err, head.output()
    assert job_processes(job_id, wait=15.0) == []
    _, summary = only_run(tmp_path / "runs")
    assert summary["ended_by"] == cause and summary["interrupted"], summary
    return summary


@pytest.mark.slow
def test_kill_ends_a_local_job_through_its_head(tmp_path, no_leftovers) -> None:
    """Another user's kill is refused and the job goes on; the owner's, from another process
    and directory, reaches the head's control socket: the head stops every node in order (its
    guard says "stopped by the head", not a stop of its own), exits 143, says who."""
    state = tmp_path / "state"
    head, job_id = _start(tmp_path, state)
    no_leftovers.append(job_id)
    try:
        assert json.loads(entry_path(state, job_id).read_text()) == {
            "job_id": job_id, "run_dir": str(tmp_path / "runs" / job_id),
            "host": socket.gethostname(), "pid": head.proc.pid}
        if _as_nobody() is not None:  # another user is refused, and the job goes on
            other = _nobody("import sys; from ptcluster.cli import main; main(sys.argv[1:])",
                            "kill", job_id)
            assert other.returncode == 1, other.stdout + other.stderr
            assert f"job {job_id} is root's: only root may end it" in other.stderr, \
                other.stdout + other.stderr
            time.sleep(1.0)
            assert head.proc.poll() is None and len(job_processes(job_id)) == 6
        killer = _kill(job_id, state, tmp_path / "elsewhere")
        assert killer.returncode == 0, killer.stdout + killer.stderr
        assert f"job {job_id}: ended on every node by its head (pid {head.proc.pid}, on this " \
               "machine)" in killer.stdout, killer.stdout + killer.stderr
        summary = _ended(head, job_id, tmp_path)
    finally:
        head.kill()
    assert summary["nodes"][0]["reason"].startswith("stopped by the head"), summary["nodes"]
    assert not entry_path(state, job_id).exists()  # gone with its socket


@pytest.mark.slow
@pytest.mark.parametrize("case", ["elsewhere", "stale"])
def test_kill_goes_through_the_guards_when_the_head_is_not_reachable_here(tmp_path, case,
                                                                          no_leftovers) -> None:
    """The killer's registry has no live head of the job on this machine (an empty one: the
    head runs on another machine; a stale entry: a dead socket, as a SIGKILLed head leaves):
    kill signals the job's guard, which tears down by itself; the head still says who."""
    head, job_id = _start(tmp_path, tmp_path / "state")
    no_leftovers.append(job_id)
    theirs = tmp_path / "kstate"
    if case == "stale":
        dead_socket(tmp_path / "dead-run")
        plant(theirs, {"job_id": job_id, "run_dir": str(tmp_path / "dead-run"),
                       "host": socket.gethostname(), "pid": os.getpid()})
    try:
        killer = _kill(job_id, theirs, tmp_path / "elsewhere")
        assert killer.returncode == 0, killer.stdout + killer.stderr
        assert f"job {job_id}: SIGTERM to its guard on localhost" in killer.stdout, \
            killer.stdout + killer.stderr
        gone = (f"ptcluster: job {job_id}: not through its head (the job of "
                f"{tmp_path / 'dead-run'} is no longer running (its head is gone)); through "
                "its nodes' guards")  # (control.head-gone, said once as it is)
        assert (gone in killer.stderr.splitlines()) == (case == "stale"), killer.stderr
        summary = _ended(head, job_id, tmp_path)
    finally:
        head.kill()
    assert not summary["nodes"][0]["reason"].startswith("stopped by the head"), summary
    assert not entry_path(theirs, job_id).exists()
