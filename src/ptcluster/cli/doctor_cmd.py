"""Check every node and the links between them before a job runs; name the node and the fix."""

from __future__ import annotations

import json
import sys

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ptcluster.cli.common import NPROC, PORT, SECONDS, cluster_option, load_spec, quiet
from ptcluster.cli.console import terminal
from ptcluster.doctor.checks import FAIL, OK, SKIP, WARN
from ptcluster.doctor.diagnose import DoctorReport, diagnose

STYLE = {OK: ("ok", "green"), WARN: ("warn", "yellow"), FAIL: ("FAIL", "bold red"),
         SKIP: ("-", "dim")}
"""How each status is shown: (word, Rich style)."""


def mark(status: str) -> Text:
    return Text(*STYLE[status])


@click.command(help=__doc__)
@cluster_option
@click.option("--nproc", type=NPROC, help="Processes on the local cluster.")
@click.option("--port", type=PORT, help="Rendezvous port to check.")
@click.option("--skip-allreduce", is_flag=True, help="Only the fast checks.")
@click.option("--timeout", type=SECONDS, default=60.0, show_default=True,
              help="Seconds for the probes, and for the all-reduce.")
@click.option("--json", "as_json", is_flag=True, help="The whole report as JSON.")
def doctor(cluster: str | None, nproc: int | None, port: int | None, skip_allreduce: bool,
           timeout: float, as_json: bool) -> None:
    spec = load_spec(cluster, nproc)
    report = diagnose(spec, port=port, skip_allreduce=skip_allreduce,
                      allreduce_timeout=timeout, probe_timeout=timeout)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        console = terminal(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
        render(console, report, [n.host for n in spec.nodes], details=not quiet())
    sys.exit(0 if report.ok else 1)


def render(console: Console, report: DoctorReport, hosts: list[str], *,
           details: bool = True) -> None:
    """The check x node table, then (with ``details``) what passed, then every failure and
    warning with its fix, then the verdict. A finding's text is the nodes' (GPU names, OS
    names, paths): never markup."""
    checks: list[str] = []
    for f in report.findings:
        if f.check not in checks and f.check != "all-reduce":
            checks.append(f.check)
    table = Table(title="ptcluster doctor", title_justify="left")
    table.add_column("check")
    for host in hosts:
        table.add_column(host)
    cells = {(f.host, f.check): f.status for f in report.findings}
    for check in checks:
        table.add_row(check, *[mark(cells.get((host, check), SKIP)) for host in hosts])
    console.print(table)
    for f in report.findings if details else ():
        if f.status == OK and f.check in ("interface", "versions", "all-reduce", "master port",
                                            "compute"):
            console.print(Text.assemble("  ", mark(OK), f"   {f.check}: {f.line()}"))
    for status in (FAIL, WARN):
        for f in report.findings:
            if f.status == status:
                console.print(Text.assemble("  ", mark(status), f" {f.check}: {f.line()}"))
    verdict = ("all checks passed", "green") if report.ok and not any(
        f.status == WARN for f in report.findings) else (
        ("passed with warnings", "yellow") if report.ok else
        (f"{len(report.failed)} check(s) failed", "red"))
    console.print(Text.assemble(verdict, f" ({report.duration:.1f} s)"))
