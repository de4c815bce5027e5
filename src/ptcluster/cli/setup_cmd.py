"""Prepare every node: key, packages, a venv with torch, firewall, /etc/hosts, env file."""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import sys
from collections.abc import Iterator

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ptcluster.cli.common import SECONDS, cluster_option, load_spec, quiet
from ptcluster.cli.console import terminal
from ptcluster.cli.problems import SETUP_WITHOUT_CLUSTER
from ptcluster.errors import UsageError
from ptcluster.setup import plan as P
from ptcluster.setup import steps as S
from ptcluster.setup.apply import run_setup
from ptcluster.setup.options import SetupOptions
from ptcluster.setup.report import SetupReport, SlurmProof
from ptcluster.setup.secret import Secret, read_password_file
from ptcluster.setup.torch_choice import VARIANT
from ptcluster.setup.wheels import DEFAULT_WHEELHOUSE

STYLE = {S.OK: ("ok", "green"), S.CHANGE: ("change", "yellow"), S.BLOCKED: ("blocked", "bold red")}
"""How each step's status is shown: (word, Rich style)."""


def mark(status: S.Status) -> Text:
    return Text(*STYLE[status])


@click.command(help=__doc__ + "\n\nAfter it, `ptcluster doctor` and `ptcluster run` use the "
               "venv it made (~/.ptcluster/venv) on every node whose cluster file sets no "
               "`python:`.")
@cluster_option
@click.option("--dry-run", is_flag=True, help="Show each node's plan (ok / change / blocked, "
              "with the exact commands); change nothing.")
@click.option("--check", is_flag=True, help="Like --dry-run; exit 1 when a change is pending.")
@click.option("--json", "as_json", is_flag=True, help="The plan and the outcome as JSON.")
@click.option("--password-file", metavar="FILE", help="The nodes' login (and sudo) password, "
              "first line of FILE (mode 600). Default: asked once at the terminal, when needed.")
@click.option("--torch-backend", default="auto", show_default=True,
              help="auto (from the nodes' GPUs and drivers), cpu, or a CUDA build (cu126, ...).")
@click.option("--node", "nodes", multiple=True, metavar="HOST",
              help="Set up only this node (repeatable).")
@click.option("--accept-new-host-keys", is_flag=True,
              help="Trust the host key of a node seen for the first time (never a changed one).")
@click.option("--wheelhouse", default=DEFAULT_WHEELHOUSE, show_default=True, metavar="DIR",
              help="Where the head keeps the wheels it downloads once for every node.")
@click.option("--timeout", type=SECONDS, default=60.0, show_default=True,
              help="Seconds for a node to answer (commands have their own limits).")
@click.option("--slurm", is_flag=True, help="Also make the nodes a Slurm cluster (as `slurm:` "
              "in the cluster file does): munge with one key, slurmctld on the first node, "
              "slurmd everywhere, slurm.conf from each node's facts; proven by a job.")
@click.option("--slurm-proof", type=click.Choice(["trainer", "srun"]), default="trainer",
              show_default=True, help="What proves the Slurm cluster: srun -N<all>, then the "
              "reference trainer through `ptcluster submit` (one epoch; the nodes need network "
              "or MNIST in WORKDIR/data), or srun alone.")
def setup(cluster: str | None, dry_run: bool, check: bool, as_json: bool,
          password_file: str | None, torch_backend: str, nodes: tuple[str, ...],
          accept_new_host_keys: bool, wheelhouse: str, timeout: float, slurm: bool,
          slurm_proof: str) -> None:
    spec = load_spec(cluster)
    if spec.local:
        raise UsageError.of(SETUP_WITHOUT_CLUSTER)
    if torch_backend != "auto" and not VARIANT.match(torch_backend):
        raise UsageError(f"--torch-backend {torch_backend!r} is not auto, cpu or cuXYZ",
                         "pass e.g. --torch-backend cu128")
    spec = spec.spares_as_nodes()  # a spare is set up as a node: a restart may run on it
    hosts = [n.host for n in spec.nodes]
    for host in nodes:
        if host not in hosts:
            raise UsageError(f"--node {host}: not in {spec.source}",
                             f"pick one of: {', '.join(hosts)}")
    secret = read_password_file(password_file) if password_file else None
    opts = SetupOptions(dry_run=dry_run or check, accept_new_host_keys=accept_new_host_keys,
                        torch_backend=torch_backend, wheelhouse=wheelhouse, timeout=timeout,
                        slurm=slurm, slurm_proof=slurm_proof)
    err = terminal(stderr=True, soft_wrap=True)
    live = not as_json and not quiet()

    def password() -> Secret | None:
        if secret is not None:
            return secret
        if not sys.stdin.isatty():
            return None
        return Secret(getpass.getpass("password for the nodes (login and sudo): "))

    def on_event(host: str, text: str) -> None:
        if live:
            err.print(f"[dim]{escape(host)}:[/dim] {escape(text)}", markup=True)

    with _terminal_kept():
        report = run_setup(spec, opts, password=password, on_event=on_event,
                           only=list(nodes) or None, known_password=secret)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        out = terminal(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
        render(out, report)
    sys.exit(exit_code(report, check=check, dry_run=dry_run))


def exit_code(report: SetupReport, *, check: bool, dry_run: bool) -> int:
    reached = all(n.problem is None for n in report.nodes.values())
    if check:
        return 0 if report.converged else 1
    if dry_run:
        return 0 if reached else 1
    return 0 if report.converged else 1


def render(console: Console, report: SetupReport) -> None:
    """Dry run: each node's plan with its commands. Apply: what changed, then the node x step
    table of the end state, then the problems with their fixes. What nodes say (step reasons,
    command output) is text, never markup."""
    for step in report.head:
        if step.status != S.OK:
            console.print(Text.assemble("head: ", mark(step.status), f" {step.name}: {step.why}"))
            for cmd in step.commands("head"):
                console.print(f"      $ {cmd}", markup=False)
    if report.torch is not None:
        t = report.torch
        what, fix = (t.local_version, None) if t.problem is None else (t.problem.what,
                                                                        t.problem.fix)
        console.print(f"torch: {what} ({t.why or fix})", markup=False)
    if report.dry_run:
        _render_plans(console, report)
    else:
        _render_applied(console, report)


def _render_plans(console: Console, report: SetupReport) -> None:
    """Dry run: every node's plan, step by step, with the commands of what is pending."""
    for n in report.nodes.values():
        console.print(Text(n.host, style="bold"), f"({n.addr}, {n.connection or 'no login'})")
        if n.problem:
            console.print("  [bold red]FAIL[/bold red] "
                          f"{escape(str(n.problem))}", markup=True)
        for s in n.before:
            console.print(Text.assemble("  ", mark(s.status), f" {s.name}: {s.why}"))
            for cmd in s.commands(n.host) if s.status != S.OK else []:
                console.print(f"      $ {cmd}", markup=False)
            for text in s.files() if s.status != S.OK else []:
                console.print("\n".join("        | " + line for line in text.splitlines()),
                              markup=False)
    pending = len(report.pending)
    unreached = sum(bool(n.problem) for n in report.nodes.values())
    console.print((f"{pending} node(s) with changes pending" if pending else
                   "no changes pending") + (f"; {unreached} node(s) not reached"
                                            if unreached else ""), markup=False)


def _render_applied(console: Console, report: SetupReport) -> None:
    """What changed: the node x step table of the end state, then problems with their fixes."""
    table = Table(title="ptcluster setup", title_justify="left")
    table.add_column("step")
    hosts = list(report.nodes)
    for host in hosts:
        table.add_column(host)
    changed = {(h, s) for h, n in report.nodes.items() for s, r, _ in n.applied if r == "changed"}
    failed = {(h, s) for h, n in report.nodes.items() for s, r, _ in n.applied if r == "failed"}
    names = list(dict.fromkeys(s.name for n in report.nodes.values() for s in n.final))
    for name in names or P.STEPS:
        cells: list[Text | str] = []
        for host in hosts:
            final = {s.name: s for s in report.nodes[host].final}
            if (host, name) in failed:
                cells.append(Text("FAILED", style="bold red"))
            elif name not in final:
                cells.append(Text("-", style="dim"))
            elif (host, name) in changed and final[name].status == S.OK:
                cells.append(Text("changed", style="cyan"))
            else:
                cells.append(mark(final[name].status))
        table.add_row(name, *cells)
    console.print(table)
    for host, n in report.nodes.items():
        if n.problem:
            console.print("  [bold red]FAIL[/bold red] "
                          f"{escape(str(n.problem.by(host)))}", markup=True)
        for name, r, d in n.applied:
            if r == "failed":
                console.print(Text.assemble("  ", ("FAILED", "bold red"),
                                            f" {host}: {name}: {d.strip()[-500:]}"))
        for step in n.final:
            if step.status == S.BLOCKED:
                console.print(Text.assemble("  ", mark(step.status),
                                            f" {host}: {step.name}: {step.why}"))
                for cmd in step.commands(host):
                    console.print(f"      $ {cmd}", markup=False)
    if report.slurm is not None:
        _render_slurm(console, report.slurm)
    n_changed = report.changes
    verdict = (("every node converged", "green") if report.converged else
               ("not every node converged", "red"))
    console.print(Text.assemble(verdict, f"; {n_changed} change(s) made" + (
        "" if n_changed else " (nothing to do)") + f" ({report.duration:.1f} s)"))


def _render_slurm(console: Console, said: SlurmProof) -> None:
    """``--slurm``'s proof: sinfo, and the job that ran on every node (or why not)."""
    if said.get("ok"):
        ran_on = [str(h) for h in said.get("ran_on") or []]
        console.print(Text.assemble(("slurm: ", "bold"), f"{len(said.get('nodes') or [])} "
                                    f"node(s) idle; job {said.get('job_id')} (srun -N"
                                    f"{len(ran_on)}) ran on {', '.join(ran_on)}"))
    else:
        console.print(Text.assemble(("slurm: FAILED ", "bold red"), str(said.get("problem"))))
    trainer = said.get("trainer")
    if trainer is not None and trainer.get("ok"):
        console.print(f"      the reference trainer (ptcluster submit): job "
                      f"{trainer.get('job_id')} {trainer.get('state')}: {trainer.get('final')}",
                      markup=False)
    for name in said.get("removed") or []:
        console.print(f"      {name}: gone from the cluster file: drained, out of slurm.conf",
                      markup=False)
    for item in said.get("draining") or []:
        console.print(f"      {item['node']}: gone from the cluster file: drained, job(s) "
                      f"{', '.join(item['jobs'])} still run there (run setup again later)",
                      markup=False)
    for line in str(said.get("sinfo") or "").splitlines():
        console.print(f"      sinfo: {line}", markup=False)


@contextlib.contextmanager
def _terminal_kept() -> Iterator[None]:
    """The password is asked from a node's thread: a Ctrl-C there ends the process before
    getpass turns echo back on, so the terminal's settings are restored here."""
    try:
        import termios

        fd = sys.stdin.fileno()
        saved = termios.tcgetattr(fd) if os.isatty(fd) else None
    except (ImportError, OSError, ValueError):
        saved = None
    try:
        yield
    finally:
        if saved is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)
