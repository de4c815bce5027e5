"""Run the doctor's facts program on every node at once, then test connectivity across nodes.

One ssh session per node: facts (and listeners) first, then every node connects to the master
port and to every peer's ephemeral listener, then the sessions close. Never stops at the first
node that fails: every node gets a :class:`NodeReport`.
"""

from __future__ import annotations

import random

from ptcluster.cluster.model import ClusterSpec, NodeSpec
from ptcluster.doctor.node_report import NodeReport, address_of, interface_of
from ptcluster.errors import Problem
from ptcluster.node import FACTS
from ptcluster.node.doctor_facts import ConnectAsk, DoctorConfig, DoctorFacts
from ptcluster.node.wire import Kind
from ptcluster.remote.group import LATE_FIX, Group, Member, NodeResult
from ptcluster.remote.node_replies import connect_results, doctor_reply
from ptcluster.remote.replies import BadReply
from ptcluster.remote.transport import Transport

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
    probed = {n.host: [spec.nodes[j] for j in probe_peers(i, len(spec.nodes))]
              for i, n in enumerate(spec.nodes)}
    def config(i: int, node: NodeSpec) -> DoctorConfig:
        return {"workdir": node.workdir, "peers": [p.host for p in probed[node.host]],
                "master_addr": spec.master.addr, "slots": node.slots, "backend": spec.backend,
                "gpus_chosen": isinstance(node.gpus, tuple),
                "master_port": (master_port or "auto") if i == 0 else None}

    members = [Member(node.host, transports[node.host], node.python, config(i, node))
               for i, node in enumerate(spec.nodes)]
    group = Group(members, FACTS, answer=Kind.READY, kinds=[Kind.CONNECT])
    try:
        group.wait(Kind.READY, timeout, late=Problem(
            None, f"no answer within the timeout ({Kind.READY})", LATE_FIX))
        # Connectivity, as the job would use it: every node to the master port (by the master's
        # name, as MASTER_ADDR is used), and to every peer's ephemeral port on its NCCL/Gloo
        # address.
        checked = {h: _checked(r) for h, r in group.result.succeeded.items()}
        facts = {h: f for h, f in checked.items() if f is not None and not isinstance(f, Problem)}
        waiting = []
        for node in spec.nodes:
            if node.host in facts and group.alive(node.host):
                ask: ConnectAsk = {"targets": _targets(spec, probed[node.host], facts),
                                   "timeout": connect_timeout}
                group.send(node.host, Kind.CONNECT, ask)
                waiting.append(node.host)
        group.wait(Kind.CONNECT, connect_timeout + 10, hosts=waiting)
    finally:
        result = group.close(bye=Kind.BYE)  # one deadline for all (not 5 s each)
    return {host: _report(r, group.begun) for host, r in result.nodes.items()}


def _targets(spec: ClusterSpec, peers: list[NodeSpec],
             facts: dict[str, DoctorFacts]) -> list[tuple[str, str, int]]:
    """What one node connects to: the master port, and each of its ``peers``' ephemeral
    listener on the address NCCL/Gloo would use there (``facts``: the nodes that answered)."""
    targets: list[tuple[str, str, int]] = []
    master_facts = facts.get(spec.nodes[0].host)
    if master_facts and (master := master_facts["listening"].get("master")):
        targets.append(("master", spec.master.addr, master))
    for peer in peers:
        peer_facts = facts.get(peer.host)
        if not peer_facts:
            continue
        addr = address_of(interface_of(peer, peer_facts, spec.master.addr), peer_facts)
        port = peer_facts["listening"].get("ephemeral")
        if addr and port:
            targets.append((f"peer:{peer.host}", addr, port))
    return targets


def _report(r: NodeResult, begun: float) -> NodeReport:
    """The doctor's report of one node from its outcome (``begun``: when the channels started)."""
    report = NodeReport(host=r.host, problem=r.problem, exit_code=r.exit_code, stderr=r.stderr)
    facts = _checked(r)
    try:
        connects = connect_results(r.answers[Kind.CONNECT]) if Kind.CONNECT in r.answers else []
    except BadReply as exc:
        facts = exc.problem
    if isinstance(facts, Problem):  # that node's failure (exit code None: "no answer" we believe)
        report.problem = facts
        report.exit_code = None
        return report
    if facts is not None:
        report.facts = facts
        came, at = r.came[Kind.READY]
        report.ssh_s = round(came - begun, 3)
        report.clock_offset = round(facts["time"] - at, 3)
    report.connects = connects
    return report


def _checked(r: NodeResult) -> DoctorFacts | Problem | None:
    """The node's facts as the head checked them (``remote.node_replies.doctor_reply``), why it
    does not believe them, or None (no facts came)."""
    if Kind.READY not in r.answers:
        return None
    try:
        return doctor_reply(r.answers[Kind.READY])
    except BadReply as exc:
        return exc.problem
