"""Run the doctor's facts program on every node at once, then test connectivity across nodes.

One ssh session per node: facts (and listeners) first, then every node connects to the master
port and to every peer's ephemeral listener, then the sessions close. Never stops at the first
node that fails: every node gets a :class:`NodeReport`.
"""

from __future__ import annotations

import queue
import random
import signal
import time
from functools import partial
from typing import Any

from ptcluster.cluster.model import ClusterSpec
from ptcluster.doctor.node_report import NodeReport, address_of, interface_of
from ptcluster.node import FACTS
from ptcluster.node.wire import control, split
from ptcluster.remote.channel import NodeChannel, close_all, start_all
from ptcluster.remote.transport import Transport, explain_channel_failure

RING_EXTRA = 2
"""Random peers each node probes beyond its two ring neighbours (issue 18: O(N) in all)."""


def probe_peers(i: int, n: int, extra: int = RING_EXTRA) -> list[int]:
    """The nodes node ``i`` of ``n`` checks (routes, names, TCP to their ephemeral port): every
    other node while that is at most ``2 + extra``; else its two neighbours on the ring and
    ``extra`` others, chosen at random but the same in every run (seeded by ``i`` and ``n``).
    Every node is then probed by at least two others, and the cluster makes O(N) probes
    instead of N(N-1): a node's blocked port or wrong route is still seen from both sides."""
    others = [j for j in range(n) if j != i]
    if len(others) <= 2 + extra:
        return others
    ring = {(i + 1) % n, (i - 1) % n}
    rest = [j for j in others if j not in ring]
    return sorted(ring | set(random.Random(i * 1_000_003 + n).sample(rest, extra)))


def collect_facts(spec: ClusterSpec, transports: dict[str, Transport], *, master_port: int,
                  timeout: float = 60.0, connect_timeout: float = 2.0) -> dict[str, NodeReport]:
    events: queue.Queue[tuple[str, str, Any, float]] = queue.Queue()
    probes = {n.host: NodeReport(host=n.host) for n in spec.nodes}
    hosts = [n.host for n in spec.nodes]
    probed = {n.host: [spec.nodes[j] for j in probe_peers(i, len(spec.nodes))]
              for i, n in enumerate(spec.nodes)}
    channels: list[NodeChannel] = []
    for i, node in enumerate(spec.nodes):
        config = {"workdir": node.workdir, "peers": [p.host for p in probed[node.host]],
                  "master_addr": spec.master.addr,
                  "master_port": (master_port or "auto") if i == 0 else None}
        channels.append(NodeChannel(
            transports[node.host], node.python, FACTS, config,
            on_frames=partial(_frames, node.host, events),
            on_closed=partial(_closed, node.host, events)))

    def could_not_start(channel: NodeChannel, problem: str, fix: str) -> None:
        probes[channel.host].problem, probes[channel.host].fix = problem, fix

    started = {c.host: c for c in start_all(channels, could_not_start)}
    begun = time.monotonic()
    _wait(events, probes, started, set(started), "ready", begun + timeout, begun)

    # Connectivity, as the job would use it: every node to the master port (by the master's
    # name, as MASTER_ADDR is used), and to every peer's ephemeral port on its NCCL/Gloo address.
    waiting = set()
    for node in spec.nodes:
        probe = probes[node.host]
        if not probe.ok or node.host not in started or started[node.host].closed:
            continue
        targets: list[list[Any]] = []
        master_facts = probes[spec.nodes[0].host].facts
        if master_facts and master_facts["listening"].get("master"):
            targets.append(["master", spec.master.addr, master_facts["listening"]["master"]])
        for peer in probed[node.host]:
            peer_facts = probes[peer.host].facts
            if not peer_facts:
                continue
            addr = address_of(interface_of(peer, peer_facts, spec.master.addr), peer_facts)
            port = peer_facts["listening"].get("ephemeral")
            if addr and port:
                targets.append([f"peer:{peer.host}", addr, port])
        started[node.host].send("connect", {"targets": targets, "timeout": connect_timeout})
        waiting.add(node.host)
    _wait(events, probes, started, waiting, "connect",
          time.monotonic() + connect_timeout + 10, begun)

    for channel in started.values():
        channel.send("bye")
    close_all(list(started.values()), timeout=5.0)  # one deadline for all (not 5 s each)
    while not events.empty():
        host, kind, payload, _ = events.get_nowait()
        if kind == "closed":
            probes[host].exit_code, probes[host].stderr = payload
    for host, probe in probes.items():
        if not probe.ok and probe.problem is None:
            probe.problem, probe.fix = explain_channel_failure(
                probe.stderr, probe.exit_code, spec.nodes[hosts.index(host)].python)
    return probes


def _frames(host: str, events: queue.Queue, lines: list[str]) -> None:
    """On the channel's reader thread: frames -> events. A bad frame is noted, never raised."""
    for line in lines:
        kind, payload = split(line)
        if kind not in ("ready", "connect"):
            continue
        try:
            events.put((host, kind, control(payload), time.time()))
        except ValueError as exc:
            events.put((host, "bad", f"{kind}: {exc}", time.time()))


def _closed(host: str, events: queue.Queue, code: int | None, stderr: list[str]) -> None:
    events.put((host, "closed", (code, stderr), time.time()))


def _wait(events: queue.Queue, probes: dict[str, NodeReport], channels: dict[str, NodeChannel],
          pending: set[str], kind: str, deadline: float, begun: float) -> None:
    pending = set(pending)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            for host in pending:
                if not probes[host].ok:
                    probes[host].problem = f"no answer within the timeout ({kind})"
                    probes[host].fix = "check the node is up and not overloaded"
                channels[host].signal(signal.SIGKILL)
            return
        try:
            host, got, payload, at = events.get(timeout=min(left, 0.5))
        except queue.Empty:
            continue
        probe = probes[host]
        if got == "ready":
            probe.facts = payload
            probe.ssh_s = round(time.monotonic() - begun, 3)
            probe.clock_offset = round(payload["time"] - at, 3)
        elif got == "connect":
            probe.connects = payload.get("results", [])
        elif got == "bad":
            probe.problem = f"the probe sent a bad frame ({payload})"
            probe.fix = "report this bug: ptcluster versions may differ between head and node"
        elif got == "closed":
            probe.exit_code, probe.stderr = payload
        if got in (kind, "closed", "bad"):
            pending.discard(host)
