"""Another real user's lease record on this machine (``nobody``, through ``setpriv``), with a
disguised link, a line erase and Rich markup in every field it may fill, reaches the user's
terminal through the real commands: ``ps --all-users`` (the shipped sampler reads it on the
node) and ``run``'s status lines and summary (the guard's refusal quotes it); and a node's
last words (ssh's stderr) reach ``doctor``'s findings. None crashes, none writes an escape of
theirs (SECURITY-REVIEW 12, 13)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ptcluster.launch.plan import new_job_id
from ptcluster.remote.transport import Transport
from tests.support.head import run_head

SRC = Path(__file__).resolve().parents[2] / "src"
LINK = "\x1b]8;;https://evil.example/\x1b\\click\x1b]8;;\x1b\\\x1b[2K"
HOSTILE = f"{LINK} [/red] [link=https://x]y[/link]"
SGR = re.compile(r"\x1b\[[0-9;]*m")
HOLD = """\
import sys
from ptcluster.node.sharing import leases
lease = leases.take(sys.argv[1], {"job_id": sys.argv[2], "command": sys.argv[3],
                                  "head": sys.argv[3]})
print("held" if lease else "not held", flush=True)
sys.stdin.read()
if lease:
    lease.release()
"""


def assert_harmless(text: str, shown: bool = True) -> None:
    """No escape but Rich's own styles, no other control character but newlines; the
    record's words shown (where ``shown``), its link's target not."""
    rest = SGR.sub("", text)
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]", rest), repr(rest)
    assert ("click" in rest or not shown) and "evil.example" not in rest


@pytest.fixture
def nobodys_lease(request: pytest.FixtureRequest) -> Iterator[str]:
    """``nobody`` holds the lease named by the test's parameter (``{job}``: a fresh job id) in
    the real lease directory, its record full of escapes and markup (its job id is one: a
    record whose job id is not is skipped by every reader, L5); released at the end."""
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as nobody")
    job = new_job_id()
    resource = request.param.format(job=job)
    holder = subprocess.Popen(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
         "-c", HOLD, resource, job, f"python train.py {HOSTILE}"],
        cwd="/", env={"PYTHONPATH": str(SRC), "HOME": "/nonexistent"},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        said = holder.stdout.readline().strip() if holder.stdout else ""
        if said != "held":
            pytest.skip(f"nobody could not take a lease here: {said or holder.stderr.read()}")
        yield job
    finally:
        holder.communicate(timeout=30)  # (EOF: it releases its lease and ends)


@pytest.mark.parametrize("nobodys_lease", ["job-{job}"], indirect=True)
@pytest.mark.parametrize("command", [["ps", "--all-users"], ["monitor", "--once"]])
def test_ps_and_monitor_show_another_users_record_as_text(nobodys_lease: str, command: list[str],
                                                          tmp_path: Path) -> None:
    """Before: ``[/red]`` in the record crashed both (MarkupError, "ptcluster hit a bug");
    without it, the record's ESC sequences reached the terminal (ps: every field; monitor: the
    job id in its jobs column)."""
    proc = subprocess.run([sys.executable, "-m", "ptcluster", *command], cwd=tmp_path,
                          env={**os.environ, "FORCE_COLOR": "1"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # (its row: the job id may be cut when other jobs run here and the table is tight)
    assert any(nobodys_lease[:15] in line and "nobody" in line
               for line in proc.stdout.splitlines()), proc.stdout
    # shown, not parsed (ps: in its head and command; monitor: the job id with its user)
    assert "click [/red] [link=https://x]y" in proc.stdout if command[0] == "ps" else \
        "nobody" in proc.stdout
    assert_harmless(proc.stdout, shown=command[0] == "ps")
    assert "\x1b" not in proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


PORT = _free_port()


@pytest.mark.slow
@pytest.mark.parametrize("nobodys_lease", [f"port-{PORT}"], indirect=True)
def test_a_refusal_quoting_another_users_record_reaches_runs_console_cleaned(
        nobodys_lease: str, tmp_path: Path) -> None:
    """The review's path: the guard refuses the port, naming the job that holds it from its
    record (``leases.describe``); the head says so in a status line (``ConsoleFeed.note``) and
    in the summary. Before: the record's link and line erase were written to stderr as they
    were."""
    script = tmp_path / "job.py"
    script.write_text("print('never runs')\n")
    code, head = run_head(["run", "--nproc", "1", "--port", str(PORT), "--run-dir",
                           str(tmp_path / "runs"), str(script)], tmp_path, timeout=120)
    err = "\n".join(head.err)
    assert code == 1, head.output()
    assert f"master port {PORT} is in use on this node by job {nobodys_lease} (nobody, " \
        "python train.py click [/red]" in err, err
    assert "never runs" not in "\n".join(head.lines)
    assert_harmless(err)


@dataclass
class _Hostile(Transport):
    """A "node" whose connection dies saying ``HOSTILE`` on stderr, as ssh's last words."""

    host: str

    def argv(self, node_argv: list[str]) -> list[str]:
        return [sys.executable, "-c",
                f"import sys; sys.stderr.write({HOSTILE!r} + '\\n'); sys.exit(255)"]


def test_doctor_shows_a_nodes_last_words_as_text(cli, monkeypatch, tmp_path: Path) -> None:
    """What a node's connection said before it died (ssh's stderr: the node's sshd, banner
    and shell may say anything) in doctor's findings, through the real channel and group.
    Before: a MarkupError ("ptcluster hit a bug"), and without markup in it, its escapes
    written."""
    import ptcluster.doctor.diagnose as diagnose

    monkeypatch.setattr(diagnose, "transports",
                        lambda spec: {n.host: _Hostile(n.host) for n in spec.nodes})
    monkeypatch.setenv("FORCE_COLOR", "1")
    (tmp_path / "cluster.yaml").write_text("nodes:\n  - {host: n1}\n  - {host: n2}\n")
    code, out, err = cli("doctor", "--skip-allreduce", "--cluster",
                         str(tmp_path / "cluster.yaml"))
    assert code == 1, out + err
    assert out.count("[/red] [link=https://x]y[/link]") >= 2, out  # each node's, as text
    assert_harmless(out)
    assert "\x1b" not in err
