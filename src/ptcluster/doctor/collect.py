"""Run the probe on every node at once and gather facts, then test connectivity across nodes.

One ssh session per node: facts (and listeners) first, then every node connects to the master
port and to every peer's ephemeral listener, then the sessions close. Never stops at the first
node that fails: every node gets a :class:`NodeProbe`.
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import IO, Any

from ptcluster.doctor.probe import CONTROL
from ptcluster.remote.bootstrap import node_argv, probe_preamble
from ptcluster.remote.transport import Transport, explain_channel_failure
from ptcluster.spec.model import ClusterSpec, NodeSpec


class ProblemKind(str, Enum):
    """Why a node has no facts, as far as the checks need to tell."""

    PYTHON = "python"
    """ssh worked, the node's shell could not run the interpreter (exit status 126 or 127)."""
    SSH = "ssh"
    """ssh itself failed: key refused, host key, unreachable... (exit status 255)."""
    COMMAND = "command"
    """The probe started and failed (any other exit status)."""
    NO_ANSWER = "no answer"
    """No exit status: the channel could not be started, or was killed after the timeout."""


@dataclass(kw_only=True)
class NodeProbe:
    host: str
    facts: dict[str, Any] | None = None
    problem: str | None = None
    """Why there are no facts (ssh refused, python missing, timed out...)."""
    fix: str | None = None
    exit_code: int | None = None
    ssh_s: float | None = None
    """Seconds from starting ssh to the node's facts (connect + probe)."""
    clock_offset: float | None = None
    """Node clock minus head clock, seconds (one-way latency uncertainty)."""
    connects: list[dict[str, Any]] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.facts is not None

    @property
    def kind(self) -> ProblemKind | None:
        """What went wrong, from the exit status (the shell's 126/127, ssh's 255), not from the
        wording of ``problem``; None when the node answered."""
        if self.ok:
            return None
        if self.exit_code in (126, 127):
            return ProblemKind.PYTHON
        if self.exit_code == 255:
            return ProblemKind.SSH
        if self.exit_code is None or self.exit_code < 0:
            return ProblemKind.NO_ANSWER
        return ProblemKind.COMMAND


def interface_of(node: NodeSpec, facts: dict[str, Any], master_addr: str) -> str | None:
    """The interface NCCL/Gloo will use on this node: configured, else the route to the master
    (the interface holding the master's address when the node is the master)."""
    if node.interface:
        return node.interface
    route = (facts.get("master") or {}).get("route_dev")
    if route == "lo" and not master_addr.startswith("127."):
        own = set((facts.get("master") or {}).get("addrs", []))
        for iface in facts.get("interfaces", []):
            if any(a.split("/")[0] in own for a in iface["ipv4"]):
                return str(iface["name"])
    return route


def address_of(iface: str | None, facts: dict[str, Any]) -> str | None:
    for entry in facts.get("interfaces", []):
        if entry["name"] == iface and entry["ipv4"]:
            return str(entry["ipv4"][0].split("/")[0])
    return None


class _Session:
    def __init__(self, host: str, proc: subprocess.Popen[bytes], events: queue.Queue) -> None:
        self.host = host
        self.proc = proc
        self.stderr: list[str] = []
        self.started = time.monotonic()
        threading.Thread(target=self._out, args=(proc.stdout, events), daemon=True).start()
        threading.Thread(target=self._err, args=(proc.stderr,), daemon=True).start()

    def _out(self, stream: IO[bytes], events: queue.Queue) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            if line.startswith(CONTROL):
                kind, _, body = line[len(CONTROL):].partition(" ")
                events.put((self.host, kind, json.loads(body), time.time()))
        events.put((self.host, "closed", None, time.time()))

    def _err(self, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            self.stderr.append(raw.decode(errors="replace").rstrip("\n"))

    def send(self, data: bytes) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (OSError, ValueError):
            pass

    def close(self, timeout: float = 5.0) -> int | None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def probe_cluster(spec: ClusterSpec, transports: dict[str, Transport], *, master_port: int,
                  timeout: float = 60.0, connect_timeout: float = 2.0) -> dict[str, NodeProbe]:
    events: queue.Queue[tuple[str, str, Any, float]] = queue.Queue()
    probes = {n.host: NodeProbe(host=n.host) for n in spec.nodes}
    sessions: dict[str, _Session] = {}
    hosts = [n.host for n in spec.nodes]
    for i, node in enumerate(spec.nodes):
        config = {"workdir": node.workdir, "peers": [h for h in hosts if h != node.host],
                  "master_addr": spec.master.addr, "master_port": master_port if i == 0 else None}
        try:
            proc = transports[node.host].spawn(node_argv(node.python))
        except OSError as exc:
            probes[node.host].problem, probes[node.host].fix = str(exc), "install OpenSSH client"
            continue
        sessions[node.host] = _Session(node.host, proc, events)
        sessions[node.host].send(probe_preamble(config))

    open_hosts = set(sessions)
    deadline = time.monotonic() + timeout
    _wait(events, probes, sessions, open_hosts, "ready", deadline)

    # Connectivity, as the job would use it: every node to the master port (by the master's
    # name, as MASTER_ADDR is used), and to every peer's ephemeral port on its NCCL/Gloo address.
    waiting = set()
    for node in spec.nodes:
        probe = probes[node.host]
        if not probe.ok or node.host not in open_hosts:
            continue
        targets: list[list[Any]] = []
        master_facts = probes[spec.nodes[0].host].facts
        if master_facts and master_facts["listening"].get("master"):
            targets.append(["master", spec.master.addr, master_port])
        for peer in spec.nodes:
            peer_facts = probes[peer.host].facts
            if peer.host == node.host or not peer_facts:
                continue
            addr = address_of(interface_of(peer, peer_facts, spec.master.addr), peer_facts)
            port = peer_facts["listening"].get("ephemeral")
            if addr and port:
                targets.append([f"peer:{peer.host}", addr, port])
        sessions[node.host].send(json.dumps({"connect": targets,
                                             "timeout": connect_timeout}).encode() + b"\n")
        waiting.add(node.host)
    _wait(events, probes, sessions, waiting, "connect",
          time.monotonic() + connect_timeout + 10)

    for session in sessions.values():
        session.send(b"bye\n")
    for host, session in sessions.items():
        code = session.close()
        probe = probes[host]
        probe.stderr = session.stderr
        if probe.exit_code is None:
            probe.exit_code = code
        if not probe.ok and probe.problem is None:
            probe.problem, probe.fix = explain_channel_failure(session.stderr, code,
                                                               spec.nodes[hosts.index(host)].python)
    return probes


def _wait(events: queue.Queue, probes: dict[str, NodeProbe], sessions: dict[str, _Session],
          pending: set[str], kind: str, deadline: float) -> None:
    pending = set(pending)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            for host in pending:
                if not probes[host].ok:
                    probes[host].problem = f"no answer within the timeout ({kind})"
                    probes[host].fix = "check the node is up and not overloaded"
                sessions[host].proc.kill()
            return
        try:
            host, got, payload, at = events.get(timeout=min(left, 0.5))
        except queue.Empty:
            continue
        probe = probes[host]
        if got == "ready":
            probe.facts = payload
            probe.ssh_s = round(time.monotonic() - sessions[host].started, 3)
            probe.clock_offset = round(payload["time"] - at, 3)
        elif got == "connect":
            probe.connects = payload
        elif got == "closed":
            probe.exit_code = sessions[host].proc.wait()
        if got in (kind, "closed"):
            pending.discard(host)
