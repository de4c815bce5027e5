"""How the head reaches a node: the local machine, or the system OpenSSH client.

A transport turns a node-side argv into a started process whose stdin/stdout/stderr are the
node's channel. The ssh one never switches host-key checking off, always runs in BatchMode (no
password prompt in the middle of a launch), and quotes the remote command with ``shlex.join`` —
the one place a remote shell is unavoidable.
"""

from __future__ import annotations

import shlex
import subprocess
from abc import ABC, abstractmethod
from dataclasses import dataclass

from ptcluster.spec.model import NodeSpec, SshSpec

# Defaults a user's `ssh.options` may override (ssh keeps the first value it sees, so the
# user's options come first on the command line).
SSH_DEFAULTS = (
    ("BatchMode", "yes"),
    ("ConnectTimeout", "10"),
    ("ServerAliveInterval", "5"),
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

    def run(self, node_argv: list[str], timeout: float,
            input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
        """Run ``node_argv`` to completion (raises ``subprocess.TimeoutExpired``)."""
        return subprocess.run(self.argv(node_argv), input=input, capture_output=True,
                              timeout=timeout, start_new_session=True)


@dataclass
class LocalTransport(Transport):
    host: str = "localhost"

    def argv(self, node_argv: list[str]) -> list[str]:
        return list(node_argv)


@dataclass
class SshTransport(Transport):
    host: str
    ssh: SshSpec

    def argv(self, node_argv: list[str]) -> list[str]:
        return ssh_argv(self.host, self.ssh) + [shlex.join(node_argv)]


def ssh_argv(host: str, ssh: SshSpec) -> list[str]:
    """``ssh [options] -- host``; the remote command is appended by the caller."""
    argv = ["ssh", "-T"]
    if ssh.config_file:
        argv += ["-F", ssh.config_file]
    if ssh.identity_file:
        argv += ["-i", ssh.identity_file]
    if ssh.port is not None:
        argv += ["-p", str(ssh.port)]
    if ssh.user:
        argv += ["-l", ssh.user]
    given = {k.lower() for k, _ in ssh.options}
    for key, value in ssh.options:
        argv += ["-o", f"{key}={value}"]
    for key, value in SSH_DEFAULTS:
        if key.lower() not in given:
            argv += ["-o", f"{key}={value}"]
    return argv + ["--", host]


def transport_for(node: NodeSpec, local: bool) -> Transport:
    if local:
        return LocalTransport(host=node.host)
    return SshTransport(host=node.host, ssh=node.ssh)
