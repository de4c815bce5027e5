"""Your warm pools (``run --warm``): interpreters with torch imported, kept on each node."""

from __future__ import annotations

import sys

import click

from ptcluster.cli.common import SECONDS, cluster_option, load_spec
from ptcluster.cli.console import say
from ptcluster.control.warm import stop_pools
from ptcluster.errors import UsageError


@click.group(help=__doc__)
def warm() -> None:
    pass


@warm.command(help="End your warm pools on every node (or on --node): an idle pool at once, "
              "one whose ranks run takes no new rank and ends with them (a job's own pool, kept "
              "for its restarts, ends with its job). `ptcluster ps` lists them.")
@cluster_option
@click.option("--node", "nodes", multiple=True, metavar="HOST",
              help="Only on this node (repeatable).")
@click.option("--timeout", type=SECONDS, default=20.0, show_default=True,
              help="Seconds to wait for every node.")
def stop(cluster: str | None, nodes: tuple[str, ...], timeout: float) -> None:
    spec = load_spec(cluster, None)
    known = {n.host for n in spec.machines}
    unknown = [h for h in nodes if h not in known]
    if unknown:
        raise UsageError(f"{', '.join(unknown)}: not a node of {spec.source}",
                         f"give one of: {', '.join(sorted(known))}")
    done = stop_pools(spec, nodes, timeout)
    for host, pools in done.stopped.items():
        for pool in pools:
            say(f"ptcluster: {host}: warm pool {pool['pid']} " + (
                "ended" if pool["gone"] else
                f"ends when its {pool['ranks']} running rank(s) end"))
        if not pools:
            say(f"ptcluster: {host}: no warm pool of yours")
    for host, why in done.failed.items():
        say(f"ptcluster: {host}: {why}", err=True)
    sys.exit(1 if done.failed else 0)
