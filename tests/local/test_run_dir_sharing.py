"""Run directories where others can write (SECURITY-REVIEW finding 10), with a real other user
(nobody, through ``setpriv``; the tests run as root, the victim): files and links planted in a
shared runs directory, a run directory swapped after it was made, a control socket served by
someone else. The victim's run writes nothing through them and asks no one else's head."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

from ptcluster.cluster import local_cluster
from ptcluster.control.protocol import ControlError, alive, ask, running_jobs
from ptcluster.errors import PtclusterError
from ptcluster.launch.api import prepare
from ptcluster.launch.options import RunOptions
from ptcluster.launch.plan import Target, plan_json
from ptcluster.launch.runlogs import RunLogs
from ptcluster.monitor.watch import job_straggler
from ptcluster.rundir import RunDir, RunDirError, write_private

NOBODY = 65534
SECRET_ENV = ("API_TOKEN", "s3cret-6b1f")


def _as_nobody(code: str, *args: str) -> None:
    """Standard-library ``code`` run by python3 as nobody (the attacker)."""
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as another user")
    done = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                           "/usr/bin/python3", "-c", code, *args], cwd="/",
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


@pytest.fixture
def shared():
    """A directory like /tmp (root's, 1777) and a file of the victim's that must not change."""
    base = Path(tempfile.mkdtemp(prefix="ptc-shared-", dir="/tmp"))
    os.chmod(base, 0o1777)
    secret = Path(tempfile.mkdtemp(prefix="ptc-victim-")) / "secret"
    secret.write_text("the victim's own file\n")
    try:
        yield base, secret
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(secret.parent, ignore_errors=True)


def _plan():
    return prepare(replace(local_cluster(1), env=(SECRET_ENV,)), Target(code="pass"))


def _write_run(run_dir: Path) -> list[str]:
    """What a run writes (plan, logs, summary, a stacks report), each refusal said (a write
    that raised: its error; the run's logs: their words)."""
    said: list[object] = []
    plan = _plan()
    layout = RunDir(run_dir)
    for step in (lambda: layout.create(0, plan_json(plan, RunOptions())),
                 lambda: write_private(layout.summary, json.dumps({"env": dict([SECRET_ENV])})),
                 lambda: write_private(layout.stacks_report("hang-stacks")[0], "stack\n")):
        try:
            step()
        except (PtclusterError, OSError) as exc:
            said.append(exc)
    logs = RunLogs(run_dir, on_error=said.append)
    logs.rank_line(0, "rank output " + SECRET_ENV[1])
    logs.node_line(0, "localhost", "node output " + SECRET_ENV[1])
    logs.close()
    return said


PLANT = """
import os, sys
run, secret = sys.argv[1], sys.argv[2]
os.makedirs(run, exist_ok=True)
os.chmod(os.path.dirname(run), 0o777)
os.chmod(run, 0o777)
for name in ("plan.json", "rank0.log", "hang-stacks.txt"):
    fd = os.open(os.path.join(run, name), os.O_WRONLY | os.O_CREAT, 0o666)
    os.fchmod(fd, 0o666)
    os.close(fd)
for name in ("summary.json", "node0-localhost.log"):
    os.symlink(secret, os.path.join(run, name))
"""


def _leaked(run: Path, secret: Path) -> list[str]:
    """Files of the attacker's (or the victim's file behind their links) that got a byte."""
    found = [p.name for p in run.iterdir() if p.is_file() and not p.is_symlink()
             and p.stat().st_uid == NOBODY and p.stat().st_size]
    if secret.read_text() != "the victim's own file\n":
        found.append(f"{secret} (through a link)")
    return found


def test_a_run_dir_another_user_planted_is_refused_and_nothing_leaks(shared) -> None:
    """nobody made the runs directory and the run directory, with 0666 files and links to the
    victim's file in it: the victim's run refuses it and writes nothing into or through them."""
    base, secret = shared
    run = base / "ptcluster-runs" / "20261202-000000-abcdef"
    _as_nobody(PLANT, str(run), str(secret))
    said = _write_run(run)
    assert _leaked(run, secret) == []
    refused = said[0] if said else None
    assert isinstance(refused, RunDirError) and refused.code == "run.run-dir-unwritable", said
    assert refused.problem.fields["path"] == str(run), refused


def test_a_run_dir_swapped_by_the_owner_of_the_runs_dir_is_not_written_through(shared) -> None:
    """The runs directory is nobody's (a shared project tree): the victim's run is refused
    there at once; had it made its directory, nobody could swap it for one of theirs."""
    base, secret = shared
    runs = base / "runs"
    _as_nobody("import os, sys; os.mkdir(sys.argv[1], 0o777); os.chmod(sys.argv[1], 0o777)",
               str(runs))
    run = runs / "20261202-000000-fedcba"
    plan = _plan()
    with pytest.raises(PtclusterError, match="belongs to uid 65534"):
        RunDir(run).create(0, plan_json(plan, RunOptions()))
    assert not run.exists()
    # the swap itself, where the old code had made the directory: everything after is refused
    os.mkdir(run)
    _as_nobody("import os, sys; os.rename(sys.argv[1], sys.argv[1] + '.gone'); "
               "os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o777); "
               "os.symlink(sys.argv[2], sys.argv[1] + '/summary.json'); "
               "os.symlink(sys.argv[2], sys.argv[1] + '/rank0.log')", str(run), str(secret))
    said = _write_run(run)
    assert _leaked(run, secret) == [] and len(said) >= 3, said


def test_files_in_our_own_run_dir_are_never_opened_through_a_link_or_reused(tmp_path) -> None:
    """In a run directory of ours alone, what is already there under a name the run writes
    (a link, a FIFO, a file it did not make) is replaced (plan, summary, reports: renamed into
    place) or refused (logs: O_EXCL), never written through, never waited on."""
    secret = tmp_path / "secret"
    secret.write_text("the victim's own file\n")
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    os.symlink(secret, run / "summary.json")
    os.symlink(secret, run / "rank0.log")
    os.mkfifo(run / "node0-localhost.log")
    # (a reader, so that the old code's open does not wait for one for ever: it wrote instead)
    reader = os.open(run / "node0-localhost.log", os.O_RDONLY | os.O_NONBLOCK)
    write_private(run / "summary.json", "{}")
    assert (run / "summary.json").read_text() == "{}" and not (run / "summary.json").is_symlink()
    assert stat.S_IMODE((run / "summary.json").stat().st_mode) == 0o600
    said: list[str] = []
    logs = RunLogs(run, on_error=said.append)
    logs.rank_line(0, "x")
    logs.node_line(0, "localhost", "y")
    started = time.monotonic()
    logs.close()
    assert time.monotonic() - started < 5  # (the FIFO is not waited on)
    try:
        assert os.read(reader, 100) == b""
    except BlockingIOError:  # (nothing written, the writer side never opened)
        pass
    finally:
        os.close(reader)
    assert secret.read_text() == "the victim's own file\n"
    assert len(said) == 2 and all("exists" in s for s in said), said
    os.chmod(run, 0o775)  # others may change it: refused
    with pytest.raises(PermissionError, match="open to others"):
        write_private(run / "plan.json", "{}")


SERVE = """
import json, os, socket, sys
path = sys.argv[1] + "/control.sock"
s = socket.socket(socket.AF_UNIX)
s.bind(path)
os.chmod(path, 0o666)
s.listen(4)
os.write(1, b"ready\\n")
while True:
    c, _ = s.accept()
    c.makefile("rb").readline()
    c.sendall(json.dumps({"ok": True, "lines": ["FORGED \\x1b[2J"], "report": {},
                          "saved": "x", "straggler": {"ranks": []}}).encode() + b"\\n")
    c.close()
"""


def test_a_control_socket_of_another_user_is_never_asked(shared, cli) -> None:
    """nobody serves a 'running job' in a shared runs directory (a plan, a socket that
    answers forged stacks): ``stacks``, the monitor and ``running_jobs`` do not ask it."""
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as another user")
    base, _ = shared
    runs = base / "runs"
    run = runs / "20261202-000000-000001"
    _as_nobody("import os, sys; os.makedirs(sys.argv[1]); os.chmod(sys.argv[1], 0o777); "
               "open(sys.argv[1] + '/plan.json', 'w').close()", str(run))
    server = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                               "--clear-groups", "/usr/bin/python3", "-c", SERVE, str(run)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline() == "ready\n"
        with pytest.raises(ControlError, match="65534"):
            ask(run, {"cmd": "stacks"})
        assert not alive(run) and running_jobs(runs) == [] and job_straggler(runs) is None
        code, out, err = cli("stacks", str(run))
        assert code != 0 and "FORGED" not in out + err, out + err
        code, out, err = cli("stacks", "--run-dir", str(runs))
        assert code != 0 and "FORGED" not in out + err, out + err
    finally:
        server.kill()
        server.wait()


def test_run_refuses_a_runs_dir_others_can_write(shared, cli, monkeypatch) -> None:
    """``run --run-dir /tmp``-like: a parent anyone can write (root's, 1777) is refused in one
    line before anything starts; the job's directory is never made there."""
    base, _ = shared
    (base / "t.py").write_text("print('never')\n")
    monkeypatch.chdir(base)
    code, out, err = cli("run", "--nproc", "1", "--run-dir", str(base), "t.py")
    assert code == 1 and "never" not in out, out + err
    assert cli.problem.code == "run.run-dir-unwritable", err
    assert "1777" in cli.problem.fields["error"] and "Fix:" in err  # (the parent's mode)
    assert [p.name for p in base.iterdir()] == ["t.py"]
