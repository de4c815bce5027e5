"""Write a commented cluster.yaml from --hosts, a hostfile, or by asking questions."""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from pathlib import Path

import click

from ptcluster.cli.common import quiet
from ptcluster.cluster import ClusterSpec, SshSpec, load_hostfile, parse_hosts, render_cluster_yaml
from ptcluster.cluster.validate import Reader
from ptcluster.errors import SpecError, UsageError


@click.command(help=__doc__)
@click.option("--hosts", metavar="H1:N,H2:N", help="Nodes and their slots, e.g. h1:2,h2:1.")
@click.option("--hostfile", metavar="FILE", help="A `host slots=N` file (DeepSpeed/OpenMPI).")
@click.option("-o", "--output", default="cluster.yaml", show_default=True,
              help="Where to write ('-' for stdout).")
@click.option("--force", is_flag=True, help="Overwrite an existing file.")
def init(hosts: str | None, hostfile: str | None, output: str, force: bool) -> None:
    if hosts is not None and hostfile is not None:
        raise UsageError("give one of --hosts or --hostfile, not both",
                         "e.g. ptcluster init --hosts node1:2,node2:2")
    if hosts is None and hostfile is None:
        if not sys.stdin.isatty():
            raise UsageError("no --hosts or --hostfile, and no terminal to ask on",
                             "e.g. ptcluster init --hosts node1:2,node2:2")
        spec = ask()
    else:
        spec = parse_hosts(hosts) if hosts is not None else load_hostfile(hostfile or "")
    # A new file's rendezvous port is auto: a second job on the same nodes is never refused.
    spec = dataclasses.replace(spec, master=dataclasses.replace(spec.master, port=None),
                               requirements=declared_here(output))
    text = render_cluster_yaml(spec)
    if output == "-":
        click.echo(text, nl=False)
        return
    path = Path(output)
    if path.exists() and not force:
        raise UsageError(f"{path} already exists", "pass --force to overwrite it, or -o ANOTHER")
    path.write_text(text)
    if not quiet():
        # Real machines need setup (a key, the packages, one torch build) before doctor can
        # pass; on machines that are ready, setup only confirms it.
        where = shlex.quote(str(path))
        click.echo(f"wrote {path}: {len(spec.nodes)} node(s), world size {spec.world_size}. "
                   f"Next: ptcluster setup --cluster {where}, then ptcluster doctor --cluster "
                   f"{where}")


DECLARED = ("uv.lock", "pylock.toml", "requirements.txt")
"""The project files ``init`` writes ``requirements:`` for, the first found (a lock first: it is
exact). A ``pyproject.toml`` alone is not taken: most projects have one for their own build."""


def declared_here(output: str) -> str | None:
    """The project's declared environment in the current directory, as the cluster file at
    ``output`` names it (relative to its folder), or None."""
    for name in DECLARED:
        if Path(name).is_file():
            folder = Path.cwd() if output == "-" else Path(output).resolve().parent
            return os.path.relpath(Path(name).resolve(), folder)
    return None


def ask() -> ClusterSpec:
    """The same questions the blog recipe leaves you to work out, answered once."""
    while True:
        text = click.prompt("Nodes and processes per node (first node hosts the rendezvous)",
                            default="localhost:2")
        try:
            spec = parse_hosts(text)
            break
        except SpecError as exc:
            click.echo(f"  {exc}")
    r = Reader("init")
    interface = click.prompt("Network interface for NCCL/Gloo (blank: detect per node)",
                             default="", show_default=False).strip()
    user = click.prompt("SSH user (blank: your ssh default)", default="",
                        show_default=False).strip()
    try:
        nodes = tuple(dataclasses.replace(
            n, interface=r.interface(interface, "interface") if interface else None,
            ssh=SshSpec(user=r.user(user, "ssh.user")) if user else n.ssh) for n in spec.nodes)
    except SpecError as exc:
        raise UsageError(str(exc)) from None
    return dataclasses.replace(spec, nodes=nodes)
