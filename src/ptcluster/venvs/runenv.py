"""``run`` with a declared environment: resolved on the head, shipped and built on every node
before any rank starts, and the ranks' interpreter each node's environment's python.

The nodes' ``python:`` becomes the environment's interpreter (``ROOT/envs/DIGEST/bin/python``,
absolute, as the node reported it): the guard runs on it and starts torchrun and the ranks on
it, so a restart's plan (made from the same spec) keeps it; the guard marks the job's use of it
(``node.guard.agent.mark_env_use``). A node whose environment failed the cheap check was
rebuilt by ``ship`` (never used); a node that could not get it ends the run before any rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ptcluster.cluster.model import ClusterSpec
from ptcluster.errors import Problem, PtclusterError, some
from ptcluster.venvs.nodes import check, members
from ptcluster.venvs.resolve import resolve
from ptcluster.venvs.resolved import Platform, ResolvedEnv
from ptcluster.venvs.ship import NODE_ROOT, Choose, Event, Locate, ShipResult, ship
from ptcluster.venvs.store import WheelStore


class EnvironmentFailed(PtclusterError):
    """Some node could not get the environment: no rank was started (exit 1)."""

    def __init__(self, problems: list[Problem]) -> None:
        hosts = [str(p.who) for p in problems]
        super().__init__(f"no rank started: the project's environment is not ready on "
                         f"{some(hosts)}: " + "; ".join(str(p) for p in problems[:3]),
                         "fix what each node says, then run again (the other nodes keep "
                         "what they built)")
        self.problems = problems


@dataclass(frozen=True)
class Environment:
    """What ``run`` did for its environment."""

    spec: ClusterSpec
    """The cluster with every node's ``python:`` its environment's interpreter."""
    shipped: ShipResult
    source: str

    def to_json(self) -> dict[str, Any]:
        """``summary.json``'s ``environment``: its digest, its declared file, the resolved set
        (per platform: every wheel), each node's outcome (the ranks' own interpreters are added
        by the runner: ``python``)."""
        return {"digest": self.shipped.digest, "source": self.source,
                "resolved": {d: e.to_json() for d, e in self.shipped.envs.items()},
                "nodes": {h: {"digest": n.digest, "state": n.state, "python": n.python,
                              "wheels_sent": n.wheels_sent, "bytes_sent": n.bytes_sent,
                              "build_s": n.seconds}
                          for h, n in self.shipped.nodes.items()}}


def chooser(requirements: Path, *, find_links: Sequence[Path] = (), refresh: bool = False,
            trusted: bool = False, store: WheelStore | None = None) -> tuple[Choose, Locate]:
    """The environment for a platform (env-A's ``resolve``, once per platform) and where the
    head's store keeps each wheel."""
    wheels = store or WheelStore()
    memo: dict[Platform, ResolvedEnv] = {}

    def choose(platform: Platform) -> ResolvedEnv:
        if platform not in memo:
            memo[platform] = resolve(requirements, platform, find_links=find_links,
                                     refresh=refresh, store=wheels, trusted=trusted)
        return memo[platform]
    return choose, wheels.path


def use_environment(spec: ClusterSpec, choose: Choose, locate: Locate, *, source: str,
                    root: str = NODE_ROOT, on_event: Event | None = None) -> Environment:
    """Ship and build on every node; the spec whose ranks run in it. Raises
    :class:`EnvironmentFailed` naming each node that could not get it (the others keep
    theirs), or what resolving raised (a ``UsageError``: nothing sent)."""
    shipped = ship(members(spec, root), choose, locate, on_event=on_event)
    if not shipped.ok:
        raise EnvironmentFailed([n.problem for n in shipped.failed.values()
                                 if n.problem is not None])
    nodes, spares = (tuple(replace(n, python=shipped.nodes[n.host].python or n.python)
                           for n in machines) for machines in (spec.nodes, spec.spares))
    return Environment(replace(spec, nodes=nodes, spares=spares), shipped, source)


def findings(spec: ClusterSpec, choose: Choose, root: str = NODE_ROOT) -> list[Problem]:
    """doctor's ``environment`` check: every difference on every node (named: node, package
    and both versions, or the file), and every node that did not answer; [] when all match."""
    out = []
    for host, got in check(members(spec, root), choose).items():
        if got.problem is not None:
            out.append(got.problem)
            continue
        fix = (f"run `ptcluster run` (it rebuilds {host}'s environment), or remove "
               f"{got.answer.get('python', 'it')} by hand")
        out += [Problem(host, str(f["what"]), fix) for f in got.answer.get("findings", [])]
    return out
