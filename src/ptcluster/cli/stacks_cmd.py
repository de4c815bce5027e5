"""Show every rank's stack of a running job, grouped by place, the straggler first."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ptcluster.cli.console import terminal
from ptcluster.cli.problems import NO_RUN_DIR, NO_RUNNING_JOB, NO_STACKS
from ptcluster.control.protocol import ask_stacks, running_jobs
from ptcluster.errors import UsageError
from ptcluster.rundir import DEFAULT_RUNS_DIR, RunDir


@click.command(help=__doc__)
@click.argument("run", required=False, metavar="[RUN]")
@click.option("--run-dir", "runs_dir", metavar="DIR", help="Parent of the run directories "
              "(default: ./ptcluster-runs).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--brief", is_flag=True, help="Only the straggler and the groups, no stacks.")
def stacks(run: str | None, runs_dir: str | None, as_json: bool, brief: bool) -> None:
    run_dir = find_run(run, Path(runs_dir or DEFAULT_RUNS_DIR))
    answer = ask_stacks(run_dir)
    if not answer.get("ok"):
        raise UsageError.of(NO_STACKS, run_dir=run_dir,
                            error=answer.get("error", "unknown error"))
    if as_json:  # with the straggler report's current figures (every rank's wait share)
        click.echo(json.dumps({**answer["report"], "straggler_report": answer.get("straggler")},
                              indent=2))
        return
    out = terminal(soft_wrap=True)
    lines = answer.get("lines") or []
    if brief:
        lines = lines[:next((i for i, line in enumerate(lines) if line.startswith("rank ")),
                            len(lines))]
    for line in lines:
        out.print(line)
    terminal(stderr=True).print(f"saved in {answer.get('saved')}")


def find_run(run: str | None, runs: Path) -> Path:
    """RUN as a run directory, or a job id under ``runs``; default: the newest running job."""
    if run:
        for candidate in (Path(run), runs / run):
            if RunDir(candidate).plan_file().exists():
                return candidate
        raise UsageError.of(NO_RUN_DIR, run=run, under=runs / run)
    for run_dir in running_jobs(runs):
        return run_dir
    raise UsageError.of(NO_RUNNING_JOB, runs=runs)
