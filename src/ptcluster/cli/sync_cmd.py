"""Copy the project (what git tracks or would track; never .git) to every node's workdir."""

from __future__ import annotations

import json
import sys

import click
from rich.console import Console
from rich.markup import escape

from ptcluster.cli.common import cluster_option, load_spec, quiet
from ptcluster.cli.console import terminal
from ptcluster.cluster import ClusterSpec
from ptcluster.remote.sync import SyncResult, sync_project


@click.command(help=__doc__ + "\n\nrsync over the cluster's ssh options (only what changed); "
               "tar over ssh on a node without rsync.")
@cluster_option
@click.option("--json", "as_json", is_flag=True, help="Per node: method, files sent, problem.")
def sync(cluster: str | None, as_json: bool) -> None:
    spec = load_spec(cluster)
    err = terminal(stderr=True, soft_wrap=True)
    results = run_sync(spec, err, show=not as_json and not quiet())
    if as_json:
        click.echo(json.dumps([r.to_json() for r in results], indent=2))
    sys.exit(0 if all(r.ok for r in results) else 1)


def run_sync(spec: ClusterSpec, console: Console, *, show: bool = True) -> list[SyncResult]:
    """Sync to every node, one line per node as it finishes, every failure with its fix."""
    if spec.local:
        if show:
            console.print("[dim]ptcluster: local cluster: the workdir is this directory, "
                          "nothing to sync[/dim]", markup=True)
        return []

    def done(r: SyncResult) -> None:
        if r.ok:
            if show:  # a status line; a failure is an error and always said (also under -q)
                console.print(f"[dim]ptcluster: synced {escape(r.host)}: {r.sent:d} file(s) "
                              f"sent ({escape(r.method)}, {r.seconds:.1f} s)[/dim]", markup=True)
        else:
            what = str(r.problem or "failed")
            console.print(f"[red]sync failed on {escape(r.host)}[/red]: {escape(what)}",
                          markup=True)

    return sync_project(spec, on_done=done)
