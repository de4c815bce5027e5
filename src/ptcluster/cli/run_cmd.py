"""Run a script or module as one DDP job on every node (torchrun on each, one rendezvous)."""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ptcluster.cli import exits
from ptcluster.cli.common import (
    NPROC,
    PORT,
    SECONDS,
    FiniteFloat,
    cluster_option,
    environment,
    environment_options,
    load_spec,
    quiet,
)
from ptcluster.cli.console import ConsoleFeed, clean, terminal
from ptcluster.cli.doctor_cmd import render
from ptcluster.cli.problems import NOTHING_TO_RUN, READMIT_WITHOUT_RESTARTS
from ptcluster.cli.push_cmd import push_data
from ptcluster.cli.sync_cmd import run_sync
from ptcluster.cli.venvs_cmd import build_environment, reshipper
from ptcluster.cluster.model import WARM_IDLE, ClusterSpec
from ptcluster.doctor.diagnose import preflight as run_preflight
from ptcluster.errors import UsageError
from ptcluster.launch.api import prepare
from ptcluster.launch.nccl_report import nccl_lines
from ptcluster.launch.options import RunOptions
from ptcluster.launch.plan import LOCAL_RANK_ARGS, LaunchPlan, Target
from ptcluster.launch.result import RankRecord, RunResult
from ptcluster.launch.runner import Restarts, Runner
from ptcluster.launch.supervise.restart import RestartPolicy
from ptcluster.launch.supervise.straggler import DEFAULT_THRESHOLD
from ptcluster.push.entries import entries as data_entries
from ptcluster.remote.connect import outside_stop, transports
from ptcluster.rundir import RunDir, run_dir_for
from ptcluster.venvs.choice import EnvChoice


class ModuleEndsOptions(click.Command):
    """``-m MODULE`` ends run's own options, as a script does, and as ``python -m`` and
    torchrun's ``-m`` do: ``ptcluster run -m train --port 5`` gives ``--port 5`` to the
    module. Without it, click took a module argument that is one of run's options as run's."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        valued = {name for p in self.params if isinstance(p, click.Option) and not p.is_flag
                  for name in p.opts}
        return super().parse_args(ctx, module_ends_options(args, valued))


def module_ends_options(args: list[str], valued: set[str]) -> list[str]:
    """``args`` with a ``--`` after ``-m MODULE`` (or ``-mMODULE``) where the module's
    arguments follow and no ``--`` is there yet; unchanged when a script (the first word that
    is no option's value) or ``--`` comes first. ``valued``: the options that take a value."""
    i = 0
    while i < len(args) and args[i] != "--" and args[i].startswith("-"):
        arg = args[i]
        if arg == "-m" or (arg.startswith("-m") and not arg.startswith("--")):
            end = i + 2 if arg == "-m" else i + 1
            if end < len(args) and args[end] != "--":
                return [*args[:end], "--", *args[end:]]
            break
        i += 2 if arg in valued else 1
    return list(args)


@click.command(cls=ModuleEndsOptions, help=__doc__,
               context_settings={"allow_interspersed_args": False,
                                 "ignore_unknown_options": True})
@cluster_option
@click.option("--nproc", type=NPROC, help="Processes on the local cluster (default: GPUs, or 2).")
@click.option("--port", type=PORT, help="Rendezvous port (overrides master.port).")
@click.option("-m", "module", metavar="MODULE", help="Run a module, like python -m.")
@click.option("--run-dir", "runs_dir", metavar="DIR", help="Parent of the run directory "
              "(default: ./ptcluster-runs).")
@click.option("--preflight", is_flag=True, help="Run the doctor's fast checks first; refuse to "
              "launch when one fails.")
@click.option("--sync", "sync_first", is_flag=True, help="First copy the project to every "
              "node's workdir (as `ptcluster sync`).")
@click.option("--max-restarts", type=click.IntRange(min=0), default=0, show_default=True,
              help="Restart the whole job after a failure, at most this many times (on the "
              "nodes that remain; the job resumes from its last checkpoint).")
@click.option("--min-nodes", type=click.IntRange(min=1), default=None,
              help="With --max-restarts: fewest nodes a restart may run on (default: all of "
              "them, i.e. a lost node ends the job unless a spare of the cluster file's "
              "spares: takes its place).")
@click.option("--readmit", is_flag=True, help="With --max-restarts: a node lost earlier that "
              "answers again and passes its health gate is taken back by a planned restart at "
              "the next checkpoint every rank saved (ptcluster.checkpoint_saved), not counted "
              "as a restart (without it: at the next failure's restart).")
@click.option("--hang-timeout", type=SECONDS, metavar="S", help="When no rank makes progress "
              "for S seconds, print every rank's stack (the straggler first) and end the job "
              "(exit 4).")
@click.option("--wait", "wait", is_flag=True, help="When the GPUs (or the port) this job asks "
              "for are held by other jobs, wait until they are free, then start (no queue: "
              "no order among waiters).")
@click.option("--wait-timeout", type=SECONDS, metavar="S", help="With --wait: give up after S "
              "seconds (default: no limit).")
@click.option("--straggler-threshold", type=FiniteFloat(min=1.0, min_open=True), metavar="X",
              default=DEFAULT_THRESHOLD, show_default=True,
              help="Name the straggler when one rank's (or node's) busy share is X times the "
              "other ranks' median while they wait for it.")
@click.option("--local-rank-arg", type=click.Choice(sorted(LOCAL_RANK_ARGS)),
              help="Pass --local-rank=N (dash, as `python -m torch.distributed.launch` does "
              "since torch 2.0) or --local_rank=N (underscore, before) to the script: scripts "
              "written for that launcher run unchanged.")
@click.option("--no-leases", "no_leases", is_flag=True, help="Unsafe: take no leases on the "
              "nodes (for nodes whose /run/lock is not root's, mode 1777): other jobs may "
              "take this job's GPUs and port, and `ps` and `kill` do not see it.")
@click.option("--data", "data", multiple=True, metavar="SRC[=DEST]", help="Push the folder "
              "SRC to every node first (to DEST, default the same absolute path; only what a "
              "node lacks); ranks get PTCLUSTER_DATA_<NAME> (NAME: SRC's folder name) and the "
              "first also PTCLUSTER_DATA. Repeatable; after the cluster file's data: entries.")
@click.option("--warm/--cold", "warm", default=None, help="Start the ranks from warm "
              "interpreters: a pool of yours on each node that has imported torch (and the "
              "cluster file's warm_imports) forks them, with the output and exit code of a cold "
              "start; it stays for the next run until idle for the cluster file's `warm:` "
              "seconds (600). Default: the cluster file's `warm:`. --cold: never from a pool.")
@click.option("--warm-restarts", "warm_restarts", is_flag=True, hidden=True,
              help="The default with --max-restarts (kept for scripts that pass it).")
@click.option("--warm-idle", "warm_idle", type=click.FloatRange(min=1, max=604800),
              default=None, metavar="SECONDS", help="With warm interpreters (implies --warm): "
              "the pools end after this many idle seconds (default: the cluster file's `warm:`, "
              "else 600).")
@environment_options
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run(cluster: str | None, nproc: int | None, port: int | None, module: str | None,
        runs_dir: str | None, preflight: bool, sync_first: bool, max_restarts: int,
        min_nodes: int | None, readmit: bool, hang_timeout: float | None, wait: bool,
        wait_timeout: float | None, straggler_threshold: float, no_leases: bool,
        local_rank_arg: str | None, requirements: str | None, find_links: tuple[str, ...],
        refresh: bool, data: tuple[str, ...], warm: bool | None, warm_idle: float | None,
        warm_restarts: bool, args: tuple[str, ...]) -> None:
    if module is None and not args:
        raise UsageError.of(NOTHING_TO_RUN)
    target = Target(module=module, args=args, local_rank_arg=local_rank_arg) if module else \
        Target(script=args[0], args=args[1:], local_rank_arg=local_rank_arg)
    spec = load_spec(cluster, nproc)
    declared = environment(spec, requirements, find_links, refresh)
    pushed = data_entries(spec, data)
    if min_nodes is not None and min_nodes > len(spec.nodes):
        raise UsageError(f"--min-nodes {min_nodes} exceeds the {len(spec.nodes)} node(s) of the "
                         "cluster", f"pass --min-nodes {len(spec.nodes)} or less")
    if readmit and not max_restarts:
        raise UsageError.of(READMIT_WITHOUT_RESTARTS)
    policy = RestartPolicy(max_restarts=max_restarts,
                           min_nodes=len(spec.nodes) if min_nodes is None else min_nodes)
    err = terminal(stderr=True, soft_wrap=True)
    if sync_first and not all(r.ok for r in run_sync(spec, err, show=not quiet())):
        sys.exit(1)
    options = RunOptions(hang_timeout=hang_timeout, wait=(
        wait_timeout or math.inf) if wait or wait_timeout else None,
        straggler_threshold=straggler_threshold, leases=not no_leases, readmit=readmit,
        **_environment_options(declared), **warm_options(spec, warm, warm_idle))
    built = None
    if options.requirements is not None:  # before the plan: the ranks' interpreter is its
        built = build_environment(spec, options, err, show=not quiet())  # (or expected)
        spec = built.spec
    spec = push_data(spec, pushed, show=not quiet())
    plan = prepare(spec, target, port=port, max_restarts=max_restarts)
    if preflight:
        _preflight(spec, plan.master_port, err)
    run_dir = run_dir_for(plan.job_id, runs_dir)
    hush = quiet()
    if not hush:
        _print_plan(err, plan, run_dir)
        _print_spares(err, spec, max_restarts)
    feed = ConsoleFeed(_stdout_writer(run_dir), _fd_writer(2, dim=err.is_terminal))
    runner = Runner(plan, transports(spec), run_dir, on_line=line_sink(feed, run_dir),
                    on_status=None if hush else lambda text: feed.note(f"ptcluster: {text}"),
                    options=options,
                    restarts=Restarts(policy, spec, target) if max_restarts else None,
                    ended_by=outside_stop(spec), console_dropped=lambda: feed.dropped_total,
                    environment=None if built is None else built.to_json(),
                    reship=reshipper(spec, options, err, show=not hush, target=target,
                                     max_restarts=max_restarts)
                    if built is not None and built.expected else None)
    result = _run_with_signals(runner)
    feed.close(timeout=5.0)
    if result.ended_by:  # Slurm's own doing comes first
        err.print(f"ptcluster: {result.ended_by}")
    if not hush or not result.ok:
        _print_summary(err, result)
    sys.exit(exit_code(result))


def _environment_options(declared: EnvChoice | None) -> dict[str, Any]:
    """RunOptions' fields of the declared environment (none: their defaults)."""
    if declared is None:
        return {}
    return {"requirements": str(declared.requirements),
            "find_links": tuple(map(str, declared.find_links)),
            "refresh": declared.refresh, "requirements_trusted": declared.trusted}


def line_sink(feed: ConsoleFeed, run_dir: Path) -> Callable[[str, int | None, str], None]:
    """run's ``on_line``: each line labelled with its node (and rank), to ``feed``. A rank's
    line goes as the rank wrote it (the user's own: colors, progress bars); a node's own line
    (``rank`` None: its program's stderr, ssh's, torchrun's) is the node's words: cleaned."""
    labels: dict[tuple[str, int | None], tuple[str, str]] = {}

    def on_line(host: str, rank: int | None, text: str) -> None:
        if rank is None:
            text = clean(text)
        label = labels.get((host, rank))
        if label is None:  # once per rank: this runs for every line of the job
            label = labels[(host, rank)] = (
                (f"[{host}] ", f"the node log of {host} in {run_dir}/") if rank is None
                else (f"[{host}:{rank}] ", str(RunDir(run_dir).rank_log(rank))))
        feed.line(label[0] + text, label[1])
    return on_line


def exit_code(result: RunResult) -> int:
    """The run's exit code: its outcome's, by ``exits.for_outcome``."""
    return exits.for_outcome(result.outcome, result.signum)


def _preflight(spec: ClusterSpec, port: int, err: Console) -> None:
    """The doctor's fast checks; exit 1 (nothing launched) when one fails."""
    report = run_preflight(spec, port)
    if not report.ok:
        render(err, report, [n.host for n in spec.nodes])
        err.print("[red]preflight failed: not launching[/red]", markup=True)
        sys.exit(1)
    err.print(f"[dim]ptcluster: preflight passed ({report.duration:.1f} s)[/dim]", markup=True)


def _fd_writer(fd: int, dim: bool = False) -> Callable[[str], None]:
    """Write to a file descriptor directly: no Python buffer lock for a blocked writer thread
    to hold when the process exits."""
    def write(text: str) -> None:
        data = (f"\x1b[2m{text.rstrip(chr(10))}\x1b[0m\n" if dim else text).encode(
            errors="replace")
        while data:
            data = data[os.write(fd, data):]
    return write


def _stdout_writer(run_dir: Path) -> Callable[[str], None]:
    write = _fd_writer(1)

    def write_out(text: str) -> None:
        try:
            write(text)
        except BrokenPipeError:
            # The reader went away (`| head`): the job goes on, into its logs only.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.close(devnull)
            _fd_writer(2)(f"ptcluster: stdout was closed; the job goes on, its output is in "
                          f"{run_dir}/\n")
            raise
    return write_out


def _run_with_signals(runner: Runner) -> RunResult:
    """Ctrl-C / SIGTERM end the job everywhere, in order, instead of killing the head (the
    first signal is the result's ``signum``)."""
    if threading.current_thread() is not threading.main_thread():
        return runner.run()

    def handler(signum: int, frame: FrameType | None) -> None:
        runner.request_stop(f"{signal.Signals(signum).name} received", signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return runner.run()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


PLAN_NODES = 10
"""Nodes the header lists one by one; past it, the first 8 and the last 2 (the run directory's
``plan.json`` has every one)."""
RANKS_ONE_BY_ONE = 32
"""Ranks the closing table lists one by one; past it, a status that many ranks share is one row
(how many, on how many nodes, their durations) and a status of a few ranks lists them."""


def _print_plan(console: Console, plan: LaunchPlan, run_dir: object) -> None:
    console.print(Text("ptcluster", style="bold"),
                  f"job {plan.job_id}: world size {plan.world_size} on {len(plan.nodes)} "
                  f"node(s), rendezvous {plan.master_addr}:{plan.master_port or 'auto'}, "
                  f"backend {plan.backend}")
    nodes = plan.nodes
    hidden = nodes[8:-2] if len(nodes) > PLAN_NODES else []
    for node in nodes[:8] + nodes[-2:] if hidden else nodes:
        if hidden and node is nodes[-2]:
            console.print(f"  ... {len(hidden)} more node(s), ranks {hidden[0].ranks.start}.."
                          f"{hidden[-1].ranks.stop - 1} (every node: {run_dir}/plan.json)",
                          markup=False)
        console.print(f"  node {node.node_rank} {node.host:<16} ranks {node.ranks.start}.."
                      f"{node.ranks.stop - 1}  interface {node.interface or 'auto'}  "
                      f"workdir {node.workdir}")
    console.print(f"  logs: {run_dir}/")


def warm_options(spec: ClusterSpec, flag: bool | None, idle: float | None) -> dict[str, Any]:
    """``RunOptions``' warm fields: ``--warm``/``--cold``, ``--warm-idle``, the cluster
    file's; a restart's pool unless ``--cold``."""
    return {"warm": warm_seconds(spec.warm, flag, idle), "warm_imports": spec.warm_imports,
            "restart_pool": flag is not False}


def warm_seconds(key: float | None, flag: bool | None, idle: float | None) -> float | None:
    """The warm pools' idle timeout for this run (None: cold): ``--warm-idle``, else the
    cluster file's ``warm:`` (or 600) where ``--warm`` or ``warm:`` asks; ``--cold`` wins."""
    if flag is False:
        return None
    if idle is not None:
        return idle
    return key if flag is None else key or WARM_IDLE


def _print_spares(console: Console, spec: ClusterSpec, max_restarts: int) -> None:
    """The cluster file's spares, idle until a restart needs one (only with --max-restarts)."""
    if not spec.spares:
        return
    said = ", ".join(f"{s.host} ({s.slots} slot(s))" for s in spec.spares)
    console.print(f"  spares: {said}" + ("" if max_restarts else
                                         ": unused without --max-restarts"), markup=False)


def _print_attempts(console: Console, result: RunResult) -> None:
    """One line per attempt of a restarted job: cause, downtime, where it resumed."""
    if len(result.attempts) < 2:
        return
    for a in result.attempts:
        cause = "ok" if a.ok else f"planned restart at step {a.planned}" \
            if a.planned is not None and a.cause is None else \
            ("stopped" if a.cause is None else a.cause.headline())
        extra = []
        if a.resumed_from is not None:
            extra.append(f"resumed from step {a.resumed_from}")
        if a.checkpoint is not None:
            extra.append(f"checkpoint {a.checkpoint}")
        if a.downtime is not None:
            extra.append(f"downtime {a.downtime:.1f} s")
        if a.dropped:
            extra.append(f"dropped {', '.join(a.dropped)}")
        extra += [f"spare {spare} in {node}'s place" for node, spare in a.replaced.items()]
        extra += [f"{h} taken back" for h in a.readmitted]
        console.print(f"  attempt {a.number}: world size {a.world_size} on {len(a.hosts)} "
                      f"node(s): {cause}" + (f" ({'; '.join(extra)})" if extra else ""),
                      markup=False)


def _print_summary(console: Console, result: RunResult) -> None:
    _print_attempts(console, result)
    if result.gave_up and not result.ok:
        console.print(f"[bold red]{escape(result.gave_up)}[/bold red]", markup=True)
    rc = result.root_cause
    if rc is not None:
        title = "What the nodes saw first:" if result.ended_by else \
            "Root cause (first observed failure):"
        console.print(Text(title, style="bold red"), rc.headline())
        if rc.problem.code:  # a declared problem's code (a known failure's line names its own)
            console.print(f"  code {rc.problem.code}", markup=False)
        if rc.known:
            console.print(f"  known failure {rc.known}: {rc.meaning}", markup=False)
        # (stopped from outside: what a node said on its way down is in its log, not news)
        for line in [] if result.ended_by else rc.last_lines[-10:]:
            console.print(f"    {line}", markup=False)
    if result.hang_report is not None:
        _print_hang(console, result)
    table = Table(title=f"job {result.job_id} ({result.duration:.1f} s)", title_justify="left")
    for col in ("rank", "host", "local", "status", "duration"):
        table.add_column(col)
    for rank, host, local, status, ok, took in rank_rows(result):
        table.add_row(rank, host, local, Text(status, style="green" if ok else "red"), took)
    console.print(table)
    _print_nccl(console, result)
    verdict = ("ok", "green") if result.ok else (
        ("interrupted", "yellow") if result.interrupted else ("failed", "red"))
    if result.console_dropped:
        console.print(f"{result.console_dropped} line(s) were not shown because the console "
                      "fell behind; every line is in the logs")
    console.print(Text.assemble(verdict, f"; logs in {result.run_dir}/"))


def _print_nccl(console: Console, result: RunResult) -> None:
    """What NCCL chose on each node, once; a node with HCAs that used sockets, in yellow."""
    lines, warnings = nccl_lines(result.nodes)
    for line in lines:
        console.print(line, markup=False)
    for problem in warnings:
        console.print(Text(str(problem), style="yellow"))


def _print_hang(console: Console, result: RunResult) -> None:
    """The straggler and the ranks by place (every stack is in the run dir)."""
    report = result.hang_report
    assert report is not None
    late, why = report.straggler()
    for r in late:
        console.print(f"[bold]straggler:[/bold] rank {r.rank:d} on {escape(str(r.host))}: "
                      f"{escape(r.where())} -- {escape(why)}", markup=True)
    if not late:
        console.print(f"no straggler named: {why}", markup=False)
    for group in report.groups():
        console.print(f"  {group.label()}", markup=False)
    text, _ = RunDir(result.run_dir).stacks_report(RunDir.HANG_STACKS)
    console.print(f"  every rank's stack: {text}", markup=False)


def rank_rows(result: RunResult) -> list[tuple[str, str, str, str, bool, str]]:
    """The closing table's rows (rank, host, local, status, ok, duration): one per rank up to
    ``RANKS_ONE_BY_ONE``; past it, one row for each status many ranks share, and the ranks of
    a status only a few have (the one that failed first among them) one by one."""
    def took(seconds: float | None) -> str:
        return f"{seconds:.1f} s" if seconds is not None else "-"

    ranks = result.ranks
    if len(ranks) <= RANKS_ONE_BY_ONE:
        return [(str(r.rank), r.host, str(r.local_rank), r.status, r.exit_code == 0,
                 took(r.duration)) for r in ranks]
    by_status: dict[str, list[RankRecord]] = {}
    for r in ranks:
        by_status.setdefault(r.status, []).append(r)
    rows = []
    for status, group in sorted(by_status.items(), key=lambda g: len(g[1])):
        ok = group[0].exit_code == 0
        if len(group) <= 4:
            rows += [(str(r.rank), r.host, str(r.local_rank), status, ok, took(r.duration))
                     for r in group]
            continue
        spans = sorted(r.duration for r in group if r.duration is not None)
        rows.append((f"{len(group)} ranks", f"{len({r.host for r in group})} node(s)", "",
                     status, ok, f"{took(spans[0])} .. {took(spans[-1])}" if spans else "-"))
    return rows
