"""Ending this user's warm pools (``ptcluster warm stop``): the ``warm`` node program on every
node asked (``node.warm.pools``), each pool's outcome by node."""

from __future__ import annotations

from dataclasses import dataclass, field

from ptcluster.cluster import ClusterSpec
from ptcluster.node import WARM
from ptcluster.node.warm.pools import PoolsConfig
from ptcluster.node.wire import Kind, PoolStopped
from ptcluster.remote.connect import transports
from ptcluster.remote.group import Member, ask_all
from ptcluster.remote.node_replies import warm_answer
from ptcluster.remote.replies import BadReply


@dataclass
class PoolsStop:
    """What ``warm stop`` did: per node, each pool (``pid``, ``gone``, ``ranks``), and the
    nodes that did not answer (why)."""

    stopped: dict[str, list[PoolStopped]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


def stop_pools(spec: ClusterSpec, hosts: tuple[str, ...], timeout: float) -> PoolsStop:
    """SIGTERM this user's pools on ``hosts`` (every machine of ``spec`` when empty)."""
    reach = transports(spec)
    machines = [n for n in spec.machines if not hosts or n.host in hosts]
    stop: PoolsConfig = {"stop": True}
    result = ask_all([Member(n.host, reach[n.host], n.python, stop) for n in machines],
                     WARM, Kind.RESULT, timeout)
    out = PoolsStop()
    for host, node in result.nodes.items():
        answer = node.answers.get(Kind.RESULT)
        if answer is None:
            out.failed[host] = "no answer" if node.problem is None else node.problem.what
            continue
        try:
            out.stopped[host] = list(warm_answer(answer)["stopped"])
        except BadReply as exc:
            out.failed[host] = f"it sent a malformed answer: {exc.what}"
    return out
