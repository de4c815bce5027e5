"""Submit a job to Slurm: an sbatch script in a run dir whose body is `ptcluster run`."""

from __future__ import annotations

import os
from pathlib import Path

import click

from ptcluster.cli.common import NPROC, quiet
from ptcluster.cli.console import say
from ptcluster.rundir import DEFAULT_RUNS_DIR, write_private
from ptcluster.submit.sbatch import (
    JOB_ID_FILE,
    SubmitConfig,
    new_run_dir,
    render_script,
    submit,
    write_script,
)


@click.command(help=__doc__ + "\n\nEverything after -- is what `ptcluster run` runs: "
               "-m MODULE or SCRIPT, then its arguments.",
               context_settings={"allow_interspersed_args": False,
                                 "ignore_unknown_options": True})
@click.option("--nodes", "nodes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Nodes to allocate.")
@click.option("--gpus-per-node", type=click.IntRange(min=0), help="GPUs per node (one rank "
              "each).")
@click.option("--nproc", type=NPROC, help="Ranks per node when not one per GPU.")
@click.option("--time", "time_limit", metavar="T", help="Time limit (Slurm's form: MM, "
              "HH:MM:SS, D-HH:MM).")
@click.option("--partition", metavar="P", help="Slurm partition.")
@click.option("--job-name", default="ptcluster", show_default=True, help="Slurm job name.")
@click.option("--run-dir", "runs_dir", metavar="DIR", help="Parent of the run directory "
              f"(default: ./{DEFAULT_RUNS_DIR}).")
@click.option("--dry-run", is_flag=True, help="Print the script; write and submit nothing.")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def submit_job(nodes: int, gpus_per_node: int | None, nproc: int | None,
               time_limit: str | None, partition: str | None, job_name: str,
               runs_dir: str | None, dry_run: bool, args: tuple[str, ...]) -> None:
    run_dir = new_run_dir(Path(runs_dir or DEFAULT_RUNS_DIR))
    cfg = SubmitConfig(run_args=args, run_dir=run_dir, workdir=Path(os.getcwd()), nodes=nodes,
                       gpus_per_node=gpus_per_node, nproc=nproc, time_limit=time_limit,
                       partition=partition, job_name=job_name)
    if dry_run:
        click.echo(render_script(cfg), nl=False)
        return
    script = write_script(cfg)
    job = submit(script)
    write_private(run_dir / JOB_ID_FILE, job + "\n")
    if not quiet():
        say(f"ptcluster: submitted Slurm job {job}; script and logs in {run_dir}/", err=True)
    say(job)  # (sbatch's words)


submit_job.name = "submit"
