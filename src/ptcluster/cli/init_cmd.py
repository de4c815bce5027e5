"""Write a commented cluster.yaml from --hosts or a hostfile."""

from __future__ import annotations

from pathlib import Path

import click

from ptcluster.errors import UsageError
from ptcluster.spec import load_hostfile, parse_hosts, render_cluster_yaml


@click.command(help=__doc__)
@click.option("--hosts", metavar="H1:N,H2:N", help="Nodes and their slots, e.g. h1:2,h2:1.")
@click.option("--hostfile", metavar="FILE", help="A `host slots=N` file (DeepSpeed/OpenMPI).")
@click.option("-o", "--output", default="cluster.yaml", show_default=True,
              help="Where to write ('-' for stdout).")
@click.option("--force", is_flag=True, help="Overwrite an existing file.")
def init(hosts: str | None, hostfile: str | None, output: str, force: bool) -> None:
    if (hosts is None) == (hostfile is None):
        raise UsageError("give exactly one of --hosts or --hostfile",
                         "e.g. ptcluster init --hosts node1:2,node2:2")
    spec = parse_hosts(hosts) if hosts is not None else load_hostfile(hostfile or "")
    text = render_cluster_yaml(spec)
    if output == "-":
        click.echo(text, nl=False)
        return
    path = Path(output)
    if path.exists() and not force:
        raise UsageError(f"{path} already exists", "pass --force to overwrite it, or -o ANOTHER")
    path.write_text(text)
    click.echo(f"wrote {path}: {len(spec.nodes)} node(s), world size {spec.world_size}. "
               f"Next: ptcluster doctor --cluster {path}")
