"""Every ptcluster job on the cluster's nodes: who, where, which GPUs, since when, what."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click
from rich.table import Table
from rich.text import Text

from ptcluster.cli.common import SECONDS, cluster_option, load_spec
from ptcluster.cli.console import terminal
from ptcluster.cluster.model import ClusterSpec
from ptcluster.monitor.jobs import JobRow, Seen, job_rows
from ptcluster.monitor.watch import sample_once
from ptcluster.node.guard.gpus import spans
from ptcluster.node.wire import PoolInfo, Sample
from ptcluster.remote.connect import transports


@click.command(help=__doc__)
@cluster_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object: jobs and unreachable "
              "nodes.")
@click.option("--all-users", is_flag=True, help="Everyone's jobs (default: your own).")
@click.option("--timeout", type=SECONDS, default=20.0, show_default=True,
              help="Seconds to wait for every node.")
def ps(cluster: str | None, as_json: bool, all_users: bool, timeout: float) -> None:
    spec = load_spec(cluster, None)
    samples, missing = sample_once(spec, transports(spec), timeout)
    seen = {host: (str(s.get("hostname") or ""), str(s.get("user") or ""),
                   list(s.get("leases") or []))
            for host, s in samples.items()}
    rows = [r for r in job_rows(seen) if all_users or r.mine]
    unknown = unknown_holders(seen)
    spares = spare_rows(spec, job_rows(seen), missing)
    pools = pool_rows(samples)
    if as_json:
        click.echo(json.dumps({"jobs": [r.to_json() for r in rows], "spares": spares,
                               "pools": pools, "unreachable": missing,
                               "unknown_holders": unknown}, indent=2))
    else:
        console = terminal(width=None if sys.stdout.isatty() else 160)
        if rows:
            console.print(table(rows))
        else:
            console.print("no ptcluster job" + ("" if all_users else " of yours (--all-users: "
                                                 "everyone's)") + " on these nodes")
        for spare in spares:
            console.print(f"spare {spare['host']}: " + (
                "unreachable" if not spare["reachable"] else
                f"in job {', '.join(spare['jobs'])}" if spare["jobs"] else "idle"),
                markup=False)
        for pool in pools:
            console.print(pool_line(pool), markup=False)
        for held in unknown:
            console.print(Text(f"{held['node']}: {held['resource']} held by an unknown holder "
                               "(no record of who; another user may have put something at "
                               "its lock path)", style="yellow"))
        for host, why in missing.items():
            console.print(Text(f"{host}: not listed: {why}", style="yellow"))
    if missing:
        sys.exit(1)


def spare_rows(spec: ClusterSpec, rows: list[JobRow],
               missing: dict[str, str]) -> list[dict[str, Any]]:
    """The cluster file's spares (``spares:``): each with whether it answered and the jobs
    (anyone's) that run on it now: none while it is idle, the job whose lost node's place it
    took after a restart."""
    return [{"host": s.host, "slots": s.slots, "reachable": s.host not in missing,
             "jobs": [r.job_id for r in rows if s.host in r.nodes]} for s in spec.spares]


class PoolRow(PoolInfo):
    """A pool as ``ps`` shows it (``--json``'s ``pools``): the sampler's, with its node."""

    node: str
    owner: str


def pool_rows(samples: dict[str, Sample]) -> list[PoolRow]:
    """Your warm pools (``run --warm``), every node's: owner, node, pid, memory, idle since
    (None: ranks of it run now, or a guard holds it for a run's ranks), its idle timeout, its
    torch and interpreter."""
    return [{"node": host, "owner": s["user"], **pool}
            for host, s in samples.items() for pool in s["pools"]]


def pool_line(pool: PoolRow) -> str:
    idle = pool["idle_since"]
    if idle is not None:
        state = "idle since " + time.strftime("%H:%M:%S", time.localtime(idle)) + \
            (f", ends after {pool['idle']:.0f} s idle" if pool["idle"] else "")
    else:  # (a guard holds it for a run's ranks, not forked yet: no idle end meanwhile)
        state = f"{pool['ranks']} rank(s) running" if pool["ranks"] else "held for a run's ranks"
    job = pool["job"]
    kept = "" if job is None else \
        f", kept for the restarts of {'job ' + str(job).split('@')[0] if job else 'a job'}"
    return (f"warm pool on {pool['node']}: {pool['owner']}, pid {pool['pid']}, "
            f"{pool['rss'] / 2**20:.0f} MiB, torch {pool['torch']}, {state}{kept}")


def unknown_holders(seen: Seen) -> list[dict[str, str]]:
    """The leases the nodes hold with no record of who holds them (``leases.held_all``'s
    ``unknown``), each once, by node and resource."""
    found = {(str(r.get("node")), str(r.get("resource"))) for _, _, records in seen.values()
             for r in records if r.get("unknown") is True}
    return [{"node": node, "resource": resource} for node, resource in sorted(found)]


def table(rows: list[JobRow]) -> Table:
    """Every job a row; the records are other users' words (shown on a :func:`terminal`, no
    markup)."""
    t = Table(box=None, pad_edge=False)
    for name in ("JOB", "USER", "HEAD", "NODES", "RANKS", "GPUS", "PORT", "STARTED", "STATE",
                 "COMMAND"):
        t.add_column(name, no_wrap=name != "COMMAND")
    for r in rows:
        gpus = " ".join(f"{h}:{spans(ix)}" for h, ix in r.gpus.items()) or "-"
        t.add_row(r.job_id, r.user, r.head, ",".join(r.nodes), str(r.ranks), gpus,
                  str(r.port or "-"), time.strftime("%m-%d %H:%M", time.localtime(r.started)),
                  r.state, r.command)
    return t
