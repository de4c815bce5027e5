"""Gather a job's checkpoint (ptcluster.checkpoint) from the nodes into one folder here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ptcluster.checkpoint.collect import collect as collect_checkpoint
from ptcluster.cli.common import cluster_option, load_spec, quiet
from ptcluster.cli.console import say


@click.command(help=__doc__ + "\n\nDIR is the dir the job passed to save (relative to each "
               "node's workdir). The newest step complete somewhere (or --step) is taken, each "
               "file from a node that holds it (its own copy or a replica), checked against "
               "the step's marker. DEST is then one torch.distributed.checkpoint folder: "
               "dcp.load(state, checkpoint_id=DEST, no_dist=True) reads it in one process.")
@cluster_option
@click.argument("dir")
@click.option("--to", "dest", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="The folder here to write the checkpoint to (made if missing).")
@click.option("--step", type=click.IntRange(min=0), default=None,
              help="This step, not the newest complete one.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON (the step, "
              "the files and bytes, the files from each node, the nodes not asked) instead of "
              "the lines.")
def collect(cluster: str | None, dir: str, dest: Path, step: int | None,
            as_json: bool) -> None:
    spec = load_spec(cluster)
    show = not quiet() and not as_json

    def on_file(host: str, name: str, size: int) -> None:
        if show:
            say(f"ptcluster: {name} ({size / 2**20:.1f} MiB) from {host}", err=True)

    done = collect_checkpoint(spec, dir, dest, step, on_file)
    if as_json:
        click.echo(json.dumps(done.to_json(), indent=2))
        sys.exit(0)
    for problem in done.unreachable:
        say(f"ptcluster: not asked: {problem}", err=True)
    say(f"ptcluster: step {done.step}: {done.files} file(s), {done.bytes / 2**20:.1f} MiB "
        f"into {dest}")
    sys.exit(0)
