"""Print the environment each node's ranks get: exports, and comments for what launch chooses."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

import click

from ptcluster.cli.common import (
    NPROC,
    PORT,
    cluster_option,
    environment,
    environment_options,
    load_spec,
    quiet,
)
from ptcluster.errors import UsageError
from ptcluster.launch.api import prepare
from ptcluster.launch.plan import JOB_VAR, Target, rank_env, rank_env_at_launch
from ptcluster.venvs.choice import EnvChoice
from ptcluster.venvs.platforms import head_platform
from ptcluster.venvs.resolve import resolve
from ptcluster.venvs.resolved import ResolvedEnv
from ptcluster.venvs.store import WheelStore


@click.command(help=__doc__)
@cluster_option
@click.option("--node", "node_host", metavar="HOST", help="Only this node.")
@click.option("--port", type=PORT, help="Override master.port.")
@click.option("--nproc", type=NPROC, help="Processes on the local cluster.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per node.")
@environment_options
def env(cluster: str | None, node_host: str | None, port: int | None, nproc: int | None,
        as_json: bool, requirements: str | None, find_links: tuple[str, ...],
        refresh: bool) -> None:
    spec = load_spec(cluster, nproc)
    declared = environment(spec, requirements, find_links, refresh)
    python = _interpreter(declared)
    plan = prepare(spec, Target(code=""), port=port)  # the env does not depend on the target
    nodes = [n for n in plan.nodes if node_host in (None, n.host)]
    if not nodes:
        raise UsageError(f"no node {node_host!r} in {spec.source}",
                         "use one of: " + ", ".join(n.host for n in plan.nodes))
    out = []
    for node in nodes:
        # The job id is new for every run: not something to export by hand.
        env_items = [(k, v) for k, v in rank_env(plan, node) if k != JOB_VAR]
        # A value chosen only at launch (a free port, leased GPUs) is a comment, never an
        # export: sourcing the output must not set a description as a value.
        at_launch = rank_env_at_launch(plan, node)
        if as_json:
            out.append({"host": node.host, "node_rank": node.node_rank,
                        "ranks": [node.ranks.start, node.ranks.stop - 1],
                        "interface": node.interface, "env": dict(env_items),
                        "at_launch": dict(at_launch),
                        **({"environment": python.to_json()} if python else {})})
            continue
        if not quiet():  # -q: the exports alone
            click.echo(_comment(f"node {node.node_rank}: {shlex.quote(node.host)}  ranks "
                                f"{node.ranks.start}..{node.ranks.stop - 1} (RANK = "
                                f"{node.rank_base} + LOCAL_RANK, LOCAL_RANK 0..{node.nproc - 1})"))
            for line in python.lines() if python else ():
                click.echo(_comment(line))
        if node.interface is None and not quiet():
            click.echo(_comment("NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME: detected on the node at "
                                "launch (the interface of its route to "
                                f"{shlex.quote(plan.master_addr)})"))
        if not quiet():
            for key, how in at_launch:
                click.echo(_comment(f"{key}: {how}"))
        for key, value in env_items:
            click.echo(f"export {_quote(key)}={_quote(value)}")
        click.echo("")
    if as_json:
        click.echo(json.dumps(out if node_host is None else out[0], indent=2))


@dataclass(frozen=True)
class _Interpreter:
    """The environment's interpreter, as ``env`` says it."""

    resolved: ResolvedEnv

    def lines(self) -> list[str]:
        r = self.resolved
        return [f"python: {r.python_path} (the project's environment {r.digest[:12]}, "
                f"from {r.source})",
                f"  digest {r.digest}: {len(r.wheels)} wheel(s), resolved for this machine's "
                f"platform ({r.platform}); a node of another is given its own"]

    def to_json(self) -> dict[str, object]:
        r = self.resolved
        return {"python": r.python_path, "digest": r.digest, "source": r.source,
                "platform": r.platform.to_json(), "wheels": len(r.wheels)}


def _interpreter(declared: EnvChoice | None) -> _Interpreter | None:
    """The declared environment resolved on this machine, for its platform (no node asked)."""
    if declared is None:
        return None
    return _Interpreter(resolve(declared.requirements, head_platform(),
                                find_links=declared.find_links, refresh=declared.refresh,
                                store=WheelStore(), trusted=declared.trusted))


def _quote(text: str) -> str:
    """``text`` as one shell word that ``eval`` gives back as it is and a terminal shows as text:
    ``shlex.quote``, or, where ``text`` holds a character that is not printable (an escape
    sequence in an ``env:`` value of a cloned cluster file), bash's ``$'...'`` with every such
    character written as ``\\xHH`` (or ``\\uHHHH``)."""
    if text.isprintable():
        return shlex.quote(text)
    out = []
    for c in text:
        if c in "\\'":
            out.append("\\" + c)
        elif c.isprintable():
            out.append(c)
        else:
            out.append(f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
    return "$'" + "".join(out) + "'"


def _comment(text: str) -> str:
    """``# text`` as one line a shell ignores, whatever ``text`` holds: the output is meant
    for ``eval``, and a line break would end the comment (quoting does not help there)."""
    return "# " + "".join(c if c.isprintable() else "?" for c in text)
