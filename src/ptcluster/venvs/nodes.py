"""Asking every node about its environments: the full check (``doctor``'s ``environment``), the
listing and the pruning (``ptcluster venvs``). One ``remote.group.Group`` of the ``venvs``
program each, as ``ship`` uses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ptcluster.cluster.model import ClusterSpec
from ptcluster.errors import Problem
from ptcluster.node import VENVS
from ptcluster.node.wire import Kind
from ptcluster.remote.connect import transports
from ptcluster.remote.group import Group, Member
from ptcluster.venvs.resolved import Platform
from ptcluster.venvs.ship import NODE_ROOT, Choose

if TYPE_CHECKING:  # (the node program's own imports are not the head's: ~6 ms of every run)
    from ptcluster.node.venv_agent import VenvsConfig

TIMEOUT = 300.0
"""Seconds for a node's answer (the full check hashes every file of an environment)."""


def members(spec: ClusterSpec, root: str = NODE_ROOT) -> list[Member[VenvsConfig]]:
    """Every node of ``spec``, its ``venvs`` program to run on its ``python:``."""
    reach = transports(spec)
    return [Member(n.host, reach[n.host], n.python, {"root": root}) for n in spec.machines]


@dataclass
class NodeAnswer:
    """One node's answer (``answer``), or why it has none (``problem``)."""

    host: str
    answer: dict[str, Any] = field(default_factory=dict)
    problem: Problem | None = None


def ask(nodes: list[Member[VenvsConfig]], kind: str,
        payload: Callable[[str, Platform], dict[str, Any]] | None = None,
        timeout: float = TIMEOUT) -> dict[str, NodeAnswer]:
    """``kind`` to every node (its payload from its platform), every node's answer."""
    group = Group(nodes, VENVS, answer=kind, kinds=(Kind.FACTS,))
    finished = False
    try:
        group.wait(Kind.FACTS, timeout)
        for host, r in group.result.nodes.items():
            facts = r.answers.get(Kind.FACTS)
            if facts is not None:
                platform = Platform(str(facts["python"]), str(facts["machine"]),
                                    str(facts["glibc"]))
                group.send(host, kind, payload(host, platform) if payload else {})
        group.wait(kind, timeout)
        finished = True
    finally:
        result = group.close(bye=Kind.BYE if finished else None)
    out = {}
    for m in nodes:
        r = result.nodes[m.host]
        got = r.answers.get(kind)
        out[m.host] = NodeAnswer(m.host, got) if got is not None else NodeAnswer(
            m.host, problem=(r.problem or Problem(None, "no answer")).by(m.host))
    return out


def check(nodes: list[Member[VenvsConfig]], choose: Choose) -> dict[str, NodeAnswer]:
    """The full check on every node against the environment resolved for its platform:
    ``answer["findings"]``, each a declared problem as the node sent it (``node.venv_problems``:
    ``{code, what, fix, fields}``, naming the package and both versions, or the file);
    ``answer["digest"]``."""
    def payload(host: str, platform: Platform) -> dict[str, Any]:
        env = choose(platform)
        return {"digest": env.digest, "wheels": [{"name": w.name, "version": w.version}
                                                 for w in env.wheels]}
    return ask(nodes, Kind.CHECK, payload)


def listing(nodes: list[Member[VenvsConfig]]) -> dict[str, NodeAnswer]:
    """Every node's environments: ``answer["envs"]``, each ``{digest, size, created,
    last_used, in_use, source, packages}``, the most recently used first."""
    return ask(nodes, Kind.VENVS)


def prune(nodes: list[Member[VenvsConfig]], keep: int, max_bytes: int,
          grace: float | None = None) -> dict[str, NodeAnswer]:
    """Prune every node: ``answer`` ``{kept, removed}`` (each with its ``why``),
    ``wheels_removed``, ``builds_removed``. ``grace``: seconds after a job was given an
    environment during which it is kept (default ``venv_store.GRACE``; 0: none)."""
    extra = {} if grace is None else {"grace": grace}
    return ask(nodes, Kind.PRUNE, lambda host, platform: {"keep": keep, "max_bytes": max_bytes,
                                                          **extra})
