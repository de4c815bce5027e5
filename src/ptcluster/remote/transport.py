"""How the head reaches a node: the local machine, or the system OpenSSH client.

A transport turns a node-side argv into a started process whose stdin/stdout/stderr are the
node's channel. The ssh one never switches host-key checking off, always runs in BatchMode (no
password prompt in the middle of a launch), and quotes the remote command with ``shlex.join`` —
the one place a remote shell is unavoidable.
"""

from __future__ import annotations

import errno
import os
import shlex
import subprocess
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass

from ptcluster.cluster.model import AUTO_PYTHON, SETUP_PYTHON, SshSpec
from ptcluster.errors import Problem
from ptcluster.node.sharing.safefile import private_dir
from ptcluster.remote import diagnoses as D

# Defaults a user's `ssh.options` may override (ssh keeps the first value it sees, so the
# user's options come first on the command line). The keepalive: after ServerAliveInterval s
# without a packet from the node, ssh asks sshd for an answer, and gives up once CountMax such
# asks went unanswered, i.e. (CountMax + 1) x Interval = 12 s after the node's last packet
# (measured on the testbed: 5 x 4 = 20 s gave 19.0-19.6 s from the cut). A run's channel
# carries heartbeats, and the head's own silence rule names a lost node sooner
# (``RunOptions.node_silence``, 8 s); this is the backstop, and what names a dead node for
# the channels without heartbeats (doctor, setup, sync, monitor). Nothing of a healthy
# channel's is asked: any packet from the node starts the count anew, and sshd answers the
# ask itself, however busy the program on the other end.
SSH_DEFAULTS = (
    ("BatchMode", "yes"),
    ("ConnectTimeout", "10"),
    ("ServerAliveInterval", "3"),
    ("ServerAliveCountMax", "3"),
)


class Transport(ABC):
    """Starts commands on one node."""

    host: str

    @abstractmethod
    def argv(self, node_argv: list[str]) -> list[str]:
        """The local argv that runs ``node_argv`` on the node."""

    def spawn(self, node_argv: list[str]) -> subprocess.Popen[bytes]:
        """Start ``node_argv`` on the node with piped stdin/stdout/stderr.

        The process gets its own session, so a Ctrl-C at the terminal reaches only the head,
        which then ends the job in order.
        """
        return subprocess.Popen(
            self.argv(node_argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True,
        )


@dataclass
class LocalTransport(Transport):
    host: str = "localhost"

    def argv(self, node_argv: list[str]) -> list[str]:
        program = node_argv[0]
        if program == AUTO_PYTHON:
            setup_venv = os.path.expanduser(SETUP_PYTHON)
            program = setup_venv if os.access(setup_venv, os.X_OK) else sys.executable
        return [os.path.expanduser(program), *node_argv[1:]]


@dataclass
class SshTransport(Transport):
    host: str
    ssh: SshSpec

    def argv(self, node_argv: list[str]) -> list[str]:
        return ssh_argv(self.host, self.ssh) + [remote_command(node_argv)]


def remote_command(argv: list[str]) -> str:
    """``argv`` as one string for the node's shell: every word quoted, except that a leading
    ``~/`` of the program stays bare so that the node's shell expands it to the node's home, and
    the program ``auto`` (the default ``python:``) is chosen by the node's shell."""
    head, rest = argv[0], argv[1:]
    if head == AUTO_PYTHON:
        # the venv `ptcluster setup` made, where the node has one; else the head's path
        return (f'p={SETUP_PYTHON.replace("~", "$HOME", 1)}; [ -x "$p" ] || p='
                f'{shlex.quote(sys.executable)}; exec "$p" {shlex.join(rest)}')
    if head.startswith("~/"):
        return "~/" + shlex.join([head[2:], *rest])
    return shlex.join(argv)


def ssh_argv(host: str, ssh: SshSpec) -> list[str]:
    """``ssh [options] -- host``; the remote command is appended by the caller."""
    argv = ["ssh", "-T"]
    if ssh.config_file:  # (ssh expands no ``~`` in -F: it would read ./~/.ssh/config)
        argv += ["-F", os.path.expanduser(ssh.config_file)]
    if ssh.identity_file:
        argv += ["-i", ssh.identity_file]
    if ssh.port is not None:
        argv += ["-p", str(ssh.port)]
    if ssh.user:
        argv += ["-l", ssh.user]
    given = {k.lower() for k, _ in ssh.options}
    for key, value in ssh.options:
        argv += ["-o", f"{key}={value}"]
    defaults: tuple[tuple[str, str], ...] = SSH_DEFAULTS
    sockets = control_dir() if ssh.reuse else None
    if sockets:
        defaults += (("ControlMaster", "auto"), ("ControlPath", f"{sockets}/%C"),
                     ("ControlPersist", str(ssh.reuse)))
    for key, value in defaults:
        if key.lower() not in given:
            argv += ["-o", f"{key}={value}"]
    return argv + ["--", host]


def control_dir() -> str | None:
    """Where reused ssh connections keep their sockets: the user's own directory, mode 0700
    (a socket there is a logged-in session to a node; ``%C``, a hash, keeps the path short);
    None (no reuse: every command connects anew) where it cannot be made so."""
    base = os.environ.get("XDG_RUNTIME_DIR") or os.path.expanduser("~/.cache")
    try:
        os.makedirs(base, exist_ok=True)
        return private_dir(os.path.join(base, "ptcluster-ssh"))
    except OSError:
        return None


def explain_start_failure(program: str, exc: OSError) -> Problem:
    """The problem (who: None, the caller's node) when the local process of a channel (ssh, or
    a local python) cannot be started at all (``diagnoses.START``)."""
    if exc.errno in (errno.EMFILE, errno.ENFILE):  # not a missing program: no descriptors left
        return Problem.of(D.TOO_MANY_FILES, None, program=repr(program),
                          limit=_open_files_limit())
    entry = {"ssh": D.NO_SSH, "srun": D.NO_SRUN}.get(os.path.basename(program),
                                                     D.NO_LOCAL_PYTHON)
    return Problem.of(entry, None, program=repr(program), error=exc.strerror or exc)


def _open_files_limit() -> str:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return f"{soft} soft, {'unlimited' if hard == resource.RLIM_INFINITY else hard} hard"


def explain_channel_failure(stderr: list[str], exit_code: int | None,
                            python: str) -> Problem:
    """The problem (what and fix; who is the caller's: the node) of a node command that died
    before saying anything useful.

    ssh exits 255 for its own errors (the last stderr line says which); a remote shell exits
    127 when the interpreter does not exist and 126 when it cannot be executed.
    """
    lines = [line for line in stderr if line.strip()]
    detail = lines[-1] if lines else f"exit status {exit_code}"
    low = detail.lower()
    if detail.startswith(FRAME_PREFIX):  # (hub.TOO_LONG: the head closed it)
        return Problem.of(D.FRAME_TOO_LONG, None, detail=detail.removeprefix(FRAME_PREFIX))
    if exit_code in (126, 127) and python == AUTO_PYTHON:
        return Problem.of(D.NO_PYTHON_AUTO, None, setup_python=SETUP_PYTHON,
                          head_python=sys.executable, detail=detail)
    srun = [line for line in lines  # not "srun: error: sl0: task 0: Exited with exit code 1"
            if line.startswith("srun: error:") and ": task " not in line]
    if srun:  # Slurm refused or lost the step (remote/slurm.py)
        return Problem.of(D.SRUN_REFUSED, None, detail=srun[0])
    if exit_code in (126, 127) or ("no such file" in low and python in detail):
        return Problem.of(D.PYTHON_NOT_FOUND, None, python=python, detail=detail)
    for entry, words in SSH_WORDS:
        if any(w in low for w in words):
            return Problem.of(entry, None, detail=detail)
    return Problem.of(D.COMMAND_FAILED, None, detail=detail)


FRAME_PREFIX = "ptcluster: frame too long: "
"""How the hub's close reason for an overlong line starts (``hub.TOO_LONG``)."""
SSH_WORDS = ((D.KEY_REFUSED, ("permission denied", "publickey")),
             (D.HOST_KEY, ("host key",)),
             (D.UNRESOLVED, ("could not resolve", "name or service not known")),
             (D.UNREACHABLE, ("timed out", "no route", "refused", "unreachable")))
"""ssh's own last words (lower case) -> its diagnosis, the first that fits."""
