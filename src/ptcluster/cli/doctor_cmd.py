"""Check every node and the links between them before a job runs; name the node and the fix."""

from __future__ import annotations

import json
import sys

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ptcluster.cli.common import (
    NPROC,
    PORT,
    SECONDS,
    cluster_option,
    environment,
    environment_options,
    load_spec,
    quiet,
    spec_for_our_ranks,
)
from ptcluster.cli.console import terminal
from ptcluster.doctor.checks import FAIL, OK, SKIP, WARN, Finding, Status
from ptcluster.doctor.diagnose import DoctorReport, diagnose
from ptcluster.errors import Problem
from ptcluster.venvs.runenv import chooser

STYLE = {OK: ("ok", "green"), WARN: ("warn", "yellow"), FAIL: ("FAIL", "bold red"),
         SKIP: ("-", "dim")}
"""How each status is shown: (word, Rich style)."""


def mark(status: Status) -> Text:
    return Text(*STYLE[status])


@click.command(help=__doc__)
@cluster_option
@click.option("--nproc", type=NPROC, help="Processes on the local cluster.")
@click.option("--port", type=PORT, help="Rendezvous port to check.")
@click.option("--skip-allreduce", is_flag=True, help="Only the fast checks.")
@click.option("--timeout", type=SECONDS, default=60.0, show_default=True,
              help="Seconds for the probes, and for the all-reduce.")
@click.option("--json", "as_json", is_flag=True, help="The whole report as JSON.")
@environment_options
def doctor(cluster: str | None, nproc: int | None, port: int | None, skip_allreduce: bool,
           timeout: float, as_json: bool, requirements: str | None, find_links: tuple[str, ...],
           refresh: bool) -> None:
    spec = load_spec(cluster, nproc)
    declared = environment(spec, requirements, find_links, refresh)  # bad input: exit 2
    choose = None if declared is None else chooser(
        declared.requirements, find_links=declared.find_links, refresh=declared.refresh,
        trusted=declared.trusted)[0]
    if not skip_allreduce:
        spec = spec_for_our_ranks(spec, "doctor")
    spares = [s.host for s in spec.spares]  # checked as nodes: a restart may run on one
    spec = spec.spares_as_nodes()
    report = diagnose(spec, port=port, skip_allreduce=skip_allreduce,
                      allreduce_timeout=timeout, probe_timeout=timeout, environment=choose)
    if as_json:
        click.echo(json.dumps({**report.to_json(), "spares": spares}, indent=2))
    else:
        console = terminal(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
        render(console, report, [n.host for n in spec.nodes], details=not quiet())
        if spares:
            console.print(f"spares (checked as nodes, in the all-reduce too): "
                          f"{', '.join(spares)}", markup=False)
    sys.exit(0 if report.ok else 1)


NODE_COLUMNS = 8
"""Nodes the table shows as columns; past it, one row per check with how many nodes had each
status and the first ones that did not pass."""
LINES_PER_CHECK = {OK: 3, WARN: 10, FAIL: 10}
"""On a cluster past ``NODE_COLUMNS``: the lines shown per check and status (the same words on
many nodes are one line with how many); ``doctor --json`` has every one."""
WORST = (FAIL, WARN, OK, SKIP)
"""A table cell's status, of several findings of one check on one node: the first here."""
DETAILS = ("interface", "versions", "all-reduce", "master port", "compute", "environment")
"""The checks whose passing lines are worth reading."""


def render(console: Console, report: DoctorReport, hosts: list[str], *,
           details: bool = True) -> None:
    """The check x node table (a check x status count past ``NODE_COLUMNS`` nodes), then (with
    ``details``) what passed, then every failure and warning with its fix, then the verdict. A
    finding's text is the nodes' (GPU names, OS names, paths): never markup."""
    checks: list[str] = []
    for f in report.findings:
        if f.check not in checks and f.check != "all-reduce":
            checks.append(f.check)
    cells: dict[tuple[str, str], Status] = {}
    for f in report.findings:  # a check with several findings on a node: its worst
        if WORST.index(f.status) < WORST.index(cells.get((f.host, f.check), SKIP)):
            cells[(f.host, f.check)] = f.status
    console.print(_table(checks, cells, hosts) if len(hosts) <= NODE_COLUMNS else
                  _counts(checks, cells, hosts))
    wide = len(hosts) > NODE_COLUMNS
    for status in (OK, FAIL, WARN) if details else (FAIL, WARN):
        found = [f for f in report.findings if f.status == status
                 and (status != OK or f.check in DETAILS)]
        for check in dict.fromkeys(f.check for f in found):
            said = [f for f in found if f.check == check]
            lines = _grouped(said) if wide else [(f.line(), 1) for f in said]
            keep = LINES_PER_CHECK[status] if wide else len(lines)
            for text, _ in lines[:keep]:
                console.print(Text.assemble("  ", mark(status), "   " if status == OK else " ",
                                            f"{check}: {text}"))
            if len(lines) > keep:
                rest = sum(n for _, n in lines[keep:])
                console.print(f"  ... {check}: {rest} more node(s) (`ptcluster doctor --json` "
                              "has every one)", markup=False)
    verdict = ("all checks passed", "green") if report.ok and not any(
        f.status == WARN for f in report.findings) else (
        ("passed with warnings", "yellow") if report.ok else
        (_failed(report), "red"))
    console.print(Text.assemble(verdict, f" ({report.duration:.1f} s)"))


def _table(checks: list[str], cells: dict[tuple[str, str], Status], hosts: list[str]) -> Table:
    table = Table(title="ptcluster doctor", title_justify="left")
    table.add_column("check")
    for host in hosts:
        table.add_column(host)
    for check in checks:
        table.add_row(check, *[mark(cells.get((host, check), SKIP)) for host in hosts])
    return table


def _counts(checks: list[str], cells: dict[tuple[str, str], Status],
            hosts: list[str]) -> Table:
    """One row per check: how many nodes passed, warned, failed, were skipped, and the first
    nodes that did not pass."""
    table = Table(title=f"ptcluster doctor: {len(hosts)} nodes", title_justify="left")
    for col in ("check", "ok", "warn", "FAIL", "-", "not passed on"):
        table.add_column(col)
    for check in checks:
        status = [cells.get((host, check), SKIP) for host in hosts]
        bad = [h for h, s in zip(hosts, status, strict=True) if s in (FAIL, WARN)]
        table.add_row(check, *[Text(str(status.count(s)) if status.count(s) else "",
                                    style=STYLE[s][1]) for s in (OK, WARN, FAIL, SKIP)],
                      ", ".join(bad[:3]) + (f" +{len(bad) - 3}" if len(bad) > 3 else ""))
    return table


def _grouped(found: list[Finding]) -> list[tuple[str, int]]:
    """The findings' lines, the same words (and fix) on many nodes as one line that says how
    many: ``n1, n2 +30: what. Fix: how``; the most common first."""
    groups: dict[tuple[str, str | None], list[str]] = {}
    for f in found:
        groups.setdefault((f.detail, f.fix), []).append(f.host)
    out = []
    for (detail, fix), where in sorted(groups.items(), key=lambda g: -len(g[1])):
        who = ", ".join(where[:2]) + (f" +{len(where) - 2}" if len(where) > 2 else "")
        out.append((str(Problem(who, detail, fix)), len(where)))
    return out


def _failed(report: DoctorReport) -> str:
    """``N check(s) failed``, and on how many nodes where that is more than one."""
    checks = dict.fromkeys(f.check for f in report.failed)
    nodes = {f.host for f in report.failed}
    return f"{len(checks)} check(s) failed" + (f" on {len(nodes)} nodes" if len(nodes) > 1
                                                else "")
