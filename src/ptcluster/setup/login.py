"""How setup reaches a node: its session on the node channel (requests and answers), the
password login through ssh's ``SSH_ASKPASS`` for a node that does not know the head's key yet,
and why a key login failed (a changed or unknown host key, no sshd, or the password's turn)."""

from __future__ import annotations

import queue
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ptcluster.cluster.model import NodeSpec, SshSpec
from ptcluster.errors import Problem
from ptcluster.node.facts.setup_facts import SetupFacts
from ptcluster.node.problems import Declared
from ptcluster.node.setup_agent import FactsAsk, StepDone, StepRun
from ptcluster.node.wire import Kind, control, split
from ptcluster.remote.channel import NodeChannel
from ptcluster.remote.replies import BadReply, facts_reply, step_done
from ptcluster.remote.transport import SshTransport, ssh_argv
from ptcluster.setup import problems as R
from ptcluster.setup.secret import Askpass


class NodeSession:
    """Request/reply over the setup program's channel."""

    def __init__(self, channel: NodeChannel) -> None:
        self.channel = channel
        self.replies: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.closed: tuple[int | None, list[str]] | None = None

    def on_frames(self, lines: list[str]) -> None:
        for line in lines:
            kind, payload = split(line)
            if kind in (Kind.FACTS, Kind.DONE):
                try:
                    self.replies.put((kind, control(payload)))
                except ValueError as exc:
                    self.replies.put(("bad", str(exc)))

    def on_closed(self, code: int | None, stderr: list[str]) -> None:
        self.closed = (code, stderr)
        self.replies.put(("closed", (code, stderr)))

    def facts(self, only: list[str], timeout: float) -> SetupFacts:
        """The facts sections ``only`` names, checked as they arrive (before any part of setup
        reads them: ``remote.replies.facts_reply``)."""
        ask: FactsAsk = {"only": only}
        try:
            return facts_reply(self._reply(Kind.FACTS, ask, timeout), only)
        except BadReply as exc:
            raise NodeFailure.said(exc.problem) from None

    def run(self, step: StepRun, timeout: float) -> StepDone:
        """A step's command run on the node: its outcome, checked
        (``remote.replies.step_done``)."""
        try:
            return step_done(self._reply(Kind.RUN, step, timeout))
        except BadReply as exc:
            raise NodeFailure.said(exc.problem) from None

    def _reply(self, kind: str, payload: Mapping[str, object], timeout: float) -> Any:
        self.channel.send(kind, payload)
        try:
            got, value = self.replies.get(timeout=timeout)
        except queue.Empty:
            raise NodeFailure.of(R.NO_ANSWER, seconds=f"{timeout:.0f}", kind=kind) from None
        if got == "closed":
            code, stderr = value
            tail = [s for s in stderr if s.strip()][-1:] or [f"exit status {code}"]
            raise NodeFailure.of(R.CHANNEL_CLOSED, last=tail[0])
        if got == "bad":
            raise NodeFailure.of(R.BAD_FRAME, error=value)
        return value


class NodeFailure(Exception):
    """Setup cannot go on on this node: its :class:`Problem` (who: None, the node's outcome
    says which node)."""

    def __init__(self, what: str, fix: str, problem: Problem | None = None) -> None:
        super().__init__(what)
        self.problem = Problem(None, what, fix) if problem is None else problem

    @classmethod
    def of(cls, entry: Declared, /, **values: object) -> NodeFailure:
        """The failure ``entry`` declares (``setup.problems``), its fields filled in by name."""
        return cls.said(Problem.of(entry, None, **values))

    @classmethod
    def said(cls, problem: Problem) -> NodeFailure:
        """The failure ``problem`` is (its code and fields kept)."""
        return cls(problem.what, problem.fix or "", problem)


def key_refusal(host: str, addr: str, port: int, code: int | None,
                 stderr: list[str]) -> NodeFailure | None:
    """Why the key login failed, as the failure to report; None when the node simply does not
    know the key yet (ssh's "Permission denied": the password's turn)."""
    err = "\n".join(stderr).strip()
    if "IDENTIFICATION HAS CHANGED" in err.upper():
        return NodeFailure.of(R.HOST_KEY_CHANGED, host=host)
    if "host key" in err.lower():
        return NodeFailure.of(R.HOST_KEY_UNKNOWN, fingerprint=host_fingerprint(addr, port))
    if code != 255 or "permission denied" not in err.lower():
        return NodeFailure.of(R.NO_SSH, last=err.splitlines()[-1] if err else
                              f"exit status {code}")
    return None


class PasswordSsh(SshTransport):
    """ssh that may use the password (askpass) when the key is refused."""

    askpass: Askpass | None = None

    def spawn(self, node_argv: list[str]) -> subprocess.Popen[bytes]:
        assert self.askpass is not None
        return subprocess.Popen(self.argv(node_argv), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, env=self.askpass.env())


def with_options(ssh: SshSpec, *pairs: tuple[str, str]) -> SshSpec:
    given = {k.lower() for k, _ in ssh.options}
    extra = tuple(p for p in pairs if p[0].lower() not in given)
    return replace(ssh, options=extra + ssh.options)


def password_ssh(ssh: SshSpec) -> SshSpec:
    # ours first: ssh keeps the first value it sees, and the password path must not batch
    keep = tuple((k, v) for k, v in ssh.options if k.lower() not in (
        "batchmode", "preferredauthentications", "numberofpasswordprompts"))
    return replace(ssh, options=(("BatchMode", "no"),
                                 ("PreferredAuthentications", "password,keyboard-interactive"),
                                 ("NumberOfPasswordPrompts", "1")) + keep)


def ssh_target(node: NodeSpec) -> tuple[str, int]:
    """(address, port) ssh would connect to for ``node`` (``ssh -G``: ~/.ssh/config applies)."""
    argv = ssh_argv(node.host, node.ssh)
    argv.insert(1, "-G")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    host, port = node.host, 22
    for line in proc.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key == "hostname":
            host = value.strip()
        elif key == "port":
            port = int(value)
    try:
        host = str(socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0])
    except OSError:
        pass
    return str(host), port


def host_fingerprint(addr: str, port: int) -> str:
    try:
        scan = subprocess.run(["ssh-keyscan", "-T", "5", "-p", str(port), addr],
                              capture_output=True, text=True, timeout=15)
        fp = subprocess.run(["ssh-keygen", "-lf", "-"], input=scan.stdout, capture_output=True,
                            text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"(could not read it: {exc})"
    return "; ".join(" ".join(line.split()[1:2] + line.split()[-1:])
                     for line in fp.stdout.splitlines()) or "(no key offered)"

