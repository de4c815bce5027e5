"""``run`` with a declared environment: resolved on the head, shipped and built on every node
before any rank starts, and the ranks' interpreter each node's environment's python.

Every node gets ``NodeSpec.environment`` (its digest): torchrun and the ranks run on the
environment's interpreter (``ROOT/envs/DIGEST/bin/python``), the guard on ``python:`` (its
base), and the guard checks the environment complete and unchanged before anything starts, so
a restart's plan (made from the same spec) keeps it; the guard marks the job's use of it
(``node.guard.agent.mark_env_use``). An unchanged environment is not asked about first
(``expect``, from ``venvs.known``): a guard that finds it missing or changed refuses with a
named reply and the runner ships it (``use_environment`` without ``known``) and launches again.
A node whose environment failed the cheap check is rebuilt by ``ship`` (never used); a node
that could not get it ends the run before any rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ptcluster.cluster.model import ClusterSpec, ProjectEnv
from ptcluster.errors import Problem, PtclusterError, some
from ptcluster.launch.plan import LaunchPlan, Target, plan_launch
from ptcluster.launch.runner import Reship, Reshipped
from ptcluster.node.venv_store import env_python
from ptcluster.venvs.known import KnownNodes
from ptcluster.venvs.nodes import check, members
from ptcluster.venvs.problems import NOT_READY
from ptcluster.venvs.resolve import check_torch, resolve
from ptcluster.venvs.resolved import Platform, ResolvedEnv
from ptcluster.venvs.ship import (
    NODE_ROOT,
    UP_TO_DATE,
    Choose,
    Event,
    Locate,
    NodeEnv,
    Progress,
    ShipResult,
    ship,
)
from ptcluster.venvs.store import WheelStore

EXPECTED = "as the head remembers it; its guard checks it before any rank starts"
"""``NodeEnv.why`` of a node launched without asking it first (``expect``)."""
GUARD, SHIP = "guard", "ship"
"""``summary.json``'s ``environment.nodes[HOST].checked_by``."""


class EnvironmentFailed(PtclusterError):
    """Some node could not get the environment: no rank was started (exit 1). ``problems``:
    each node's (its own problem, ``venvs.not-ready``, names them and says the first three)."""

    def __init__(self, problems: list[Problem]) -> None:
        values = {"hosts": some([str(p.who) for p in problems]),
                  "said": "; ".join(str(p) for p in problems[:3])}
        super().__init__(*NOT_READY.texts(**values), NOT_READY.code)
        self.problem = Problem.of(NOT_READY, None, **values)
        self.problems = problems


@dataclass(frozen=True)
class Environment:
    """What ``run`` did for its environment."""

    spec: ClusterSpec
    """The cluster with every node's ranks in its environment (``NodeSpec.environment``)."""
    shipped: ShipResult
    source: str

    @property
    def expected(self) -> bool:
        """Launched without asking the nodes (``expect``): their guards check it."""
        return all(n.why == EXPECTED for n in self.shipped.nodes.values())

    def to_json(self) -> dict[str, Any]:
        """``summary.json``'s ``environment``: its digest, its declared file, the resolved set
        (per platform: every wheel), each node's outcome and who checked it there (``ship``:
        asked before the launch; ``guard``: launched at once, its guard checked it), the ranks'
        own interpreters (added by the runner: ``python``)."""
        return {"digest": self.shipped.digest, "source": self.source,
                "resolved": {d: e.to_json() for d, e in self.shipped.envs.items()},
                "nodes": {h: {"digest": n.digest, "state": n.state, "python": n.python,
                              "checked_by": GUARD if n.why == EXPECTED else SHIP,
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
                    root: str = NODE_ROOT, on_event: Event | None = None,
                    known: KnownNodes | None = None, ask: bool = False) -> Environment:
    """The spec whose ranks run in the project's environment on every node. With ``known``
    (``run``) and not ``ask``: where the head remembers every node having the digest wanted
    now, nothing is asked (``expected``: each node's guard checks it before any rank starts;
    the runner's ``reship`` is this again with ``ask``). Else shipped and built on every node
    (and remembered in ``known``). Raises :class:`EnvironmentFailed` naming each node that could
    not get it (the others keep theirs), or what resolving raised (a ``UsageError``: nothing
    sent)."""
    if known is not None and not ask:
        expected = expect(spec, choose, known, root)
        if expected is not None:
            for host in expected.nodes:
                (on_event or (lambda progress: None))(Progress(
                    host, UP_TO_DATE, f"environment up to date ({EXPECTED})", final=True))
            return Environment(with_environment(spec, expected, root), expected, source)
    shipped = ship(members(spec, root), choose, locate, on_event=on_event)
    if not shipped.ok:
        raise EnvironmentFailed([n.problem for n in shipped.failed.values()
                                 if n.problem is not None])
    if known is not None:
        for node in spec.machines:
            if node.host in shipped.facts:
                known.put(node, root, shipped.facts[node.host], shipped.nodes[node.host].digest)
    return Environment(with_environment(spec, shipped, root), shipped, source)


def expect(spec: ClusterSpec, choose: Choose, known: KnownNodes,
           root: str = NODE_ROOT) -> ShipResult | None:
    """Every node's environment from what the head remembers of it (its platform resolved by
    ``choose``, the lock's torch checked against the node's), each ``up to date`` as far as
    the head knows; None when some node is unknown or not known to have that digest."""
    nodes, envs = {}, {}
    for node in spec.machines:
        seen = known.get(node, root)
        if seen is None:
            return None
        env = choose(seen.platform)
        if seen.torch:  # (as ship checks it)
            check_torch(env.held, seen.torch, seen.ptcluster or None)
        if env.digest not in seen.digests:
            return None
        envs[env.digest] = env
        nodes[node.host] = NodeEnv(node.host, UP_TO_DATE, env.digest,
                                   python=env_python(root, env.digest), why=EXPECTED,
                                   torch=seen.torch)
    return ShipResult(nodes, envs)


def with_environment(spec: ClusterSpec, shipped: ShipResult, root: str = NODE_ROOT) \
        -> ClusterSpec:
    """``spec`` with every node's ranks in its environment (``NodeSpec.environment``: the
    guard keeps running on ``python:``, the environment's base)."""
    nodes, spares = (tuple(replace(n, environment=ProjectEnv(
        shipped.nodes[n.host].digest, root, shipped.nodes[n.host].torch))
                           if n.host in shipped.nodes else n for n in machines)
                     for machines in (spec.nodes, spec.spares))
    return replace(spec, nodes=nodes, spares=spares)


def reship(spec: ClusterSpec, build: Callable[[], Environment], target: Target, *,
           max_restarts: int = 0, root: str = NODE_ROOT) -> Reship:
    """The runner's ``reship`` for a launch without asking (``expect``): ``build`` ships and
    builds the environment on ``spec``'s nodes (``use_environment`` without ``known``: the one
    path), and the same job's plan (its id, its port) is made on ``spec`` with what it built."""
    def again(plan: LaunchPlan) -> Reshipped:
        built = build()
        shipped = with_environment(spec, built.shipped, root)
        return Reshipped(plan_launch(shipped, target, port=plan.master_port, job_id=plan.job_id,
                                     max_restarts=max_restarts), shipped, built.to_json())
    return again


def findings(spec: ClusterSpec, choose: Choose, root: str = NODE_ROOT) -> list[Problem]:
    """doctor's ``environment`` check: every difference on every node (named: node, package
    and both versions, or the file), and every node that did not answer; [] when all match."""
    out = []
    for host, got in check(members(spec, root), choose).items():
        if got.problem is not None:
            out.append(got.problem)
        elif got.answer.get("ok") is False:  # the node's check itself failed (its words)
            out.append(Problem.received(host, got.answer))
        else:
            out += [Problem.received(host, f) for f in got.answer.get("findings", [])]
    return out
