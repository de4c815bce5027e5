"""The ``ptcluster`` command: parse, call the library, render, choose the exit code."""

from __future__ import annotations

import logging
import sys

import click
from rich.console import Console

from ptcluster import __version__
from ptcluster.cli import bench_cmd, doctor_cmd, env_cmd, init_cmd, monitor_cmd, run_cmd
from ptcluster.errors import PtclusterError

log = logging.getLogger("ptcluster")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ptcluster")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
@click.option("-q", "--quiet", is_flag=True, help="Only errors and the job's own output.")
@click.pass_context
def cli(ctx: click.Context, verbose: int, quiet: bool) -> None:
    """Turn a few machines into a working PyTorch DDP cluster: set up, check, run, bench, watch."""
    level = logging.ERROR if quiet else (logging.DEBUG if verbose > 1 else
                                         logging.INFO if verbose else logging.WARNING)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    ctx.obj = {"verbose": verbose, "quiet": quiet}


cli.add_command(run_cmd.run)
cli.add_command(env_cmd.env)
cli.add_command(init_cmd.init)
cli.add_command(doctor_cmd.doctor)
cli.add_command(bench_cmd.bench)
cli.add_command(monitor_cmd.monitor)


def main(argv: list[str] | None = None) -> None:
    """Entry point: expected errors become one red line and their exit code."""
    try:
        code = cli.main(args=argv, prog_name="ptcluster", standalone_mode=False)
    except PtclusterError as exc:
        Console(stderr=True, highlight=False).print(f"[red]error:[/red] {exc}", markup=True,
                                                     soft_wrap=True)
        if "-v" in (argv or sys.argv):
            log.exception("details")
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    sys.exit(code or 0)
