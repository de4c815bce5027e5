"""The project's Python environments on every node: digest, size, last use, which job uses each;
--prune removes the unused ones beyond the most recent (and a size cap)."""

from __future__ import annotations

import contextlib
import datetime
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ptcluster.cli.common import cluster_option, load_spec
from ptcluster.cli.console import terminal
from ptcluster.cluster.model import ClusterSpec
from ptcluster.errors import some
from ptcluster.launch.options import RunOptions
from ptcluster.launch.plan import Target
from ptcluster.launch.runner import Reship
from ptcluster.node.venv_store import KEEP_DEFAULT, MAX_BYTES_DEFAULT
from ptcluster.venvs import nodes
from ptcluster.venvs.known import KnownNodes
from ptcluster.venvs.runenv import Environment, chooser, reship, use_environment
from ptcluster.venvs.ship import SENDING, Progress

F = TypeVar("F", bound=Callable[..., Any])


def requirements_options(fn: F) -> F:
    """``--requirements``, ``--find-links``, ``--refresh`` (run, doctor, venvs)."""
    fn = click.option("--refresh", is_flag=True, help="Resolve unpinned requirements anew.")(fn)
    fn = click.option("--find-links", "find_links", multiple=True, metavar="DIR",
                      help="A folder of wheels to resolve from (repeatable; for a head "
                      "without registry access).")(fn)
    return click.option("--requirements", metavar="PATH", help="The project's environment: "
                        "uv.lock, pylock.toml, requirements*.txt or pyproject.toml (relative to "
                        "here; wins over the cluster file's requirements:).")(fn)


def declared(spec: ClusterSpec, requirements: str | None, find_links: tuple[str, ...],
             refresh: bool) -> dict[str, Any]:
    """``RunOptions``' environment fields: the flag, else the cluster file's key (env-A's
    ``ClusterSpec.requirements``/``find_links``, already relative to the file's folder)."""
    path = requirements or getattr(spec, "requirements", None)
    links = tuple(find_links) or tuple(getattr(spec, "find_links", ()) or ())
    return {"requirements": str(path) if path else None,
            "find_links": tuple(str(p) for p in links), "refresh": refresh}


def build_environment(spec: ClusterSpec, opts: RunOptions, err: Console, *,
                      show: bool, remembered: bool = True) -> Environment:
    """Resolve, ship and build before the plan: on a terminal a live line (bytes sent, each
    node's state), then each node's outcome; elsewhere one line per node (stderr). With
    ``remembered`` (and no ``--refresh``), nothing is asked of the nodes where the head
    remembers each having the environment (``venvs.known``; their guards check it,
    :func:`reshipper` follows up); what a ship finds is remembered either way."""
    assert opts.requirements is not None
    choose, locate = chooser(Path(opts.requirements),
                             find_links=tuple(Path(p) for p in opts.find_links),
                             refresh=opts.refresh, trusted=opts.requirements_trusted)
    known, ask = KnownNodes(), not remembered or opts.refresh
    if not show:
        return use_environment(spec, choose, locate, source=str(opts.requirements), known=known,
                               ask=ask)
    shown = ProgressLine(err, [n.host for n in spec.nodes])
    with Live(console=err, auto_refresh=False, transient=True) if err.is_terminal else \
            contextlib.nullcontext() as live:
        shown.live = live
        return use_environment(spec, choose, locate, source=str(opts.requirements),
                               on_event=shown, known=known, ask=ask)


def reshipper(spec: ClusterSpec, opts: RunOptions, err: Console, *, show: bool,
              target: Target, max_restarts: int) -> Reship:
    """``run``'s ``Runner.reship`` after a launch without asking (``build_environment``'s
    ``remembered``): the environment shipped and built as on a first run (``runenv.reship``)."""
    return reship(spec, lambda: build_environment(spec, opts, err, show=show, remembered=False),
                  target, max_restarts=max_restarts)


class ProgressLine:
    """``ship``'s events for a person: the final ones as lines, the rest in one live line."""

    def __init__(self, console: Console, hosts: list[str]) -> None:
        self.console = console
        self.states = dict.fromkeys(hosts, "checking")
        self.live: Live | None = None

    def __call__(self, p: Progress) -> None:
        if p.final:
            self.console.print(f"ptcluster: environment: {p.host}: {p.text}")
        self.states[p.host] = p.state if p.state != SENDING or not p.total else \
            f"{SENDING} {100 * p.sent // p.total}%"
        if self.live is not None:
            sent = sum(1 for s in self.states.values() if s.startswith(SENDING))
            self.live.update(Text("environment: " + some([f"{h} {s}" for h, s in
                                                          self.states.items()], 6, " · ")
                                  + (f" ({sent} receiving)" if sent else "")), refresh=True)


@click.command(help=__doc__)
@cluster_option
@click.option("--prune", is_flag=True, help="Remove the environments no running job uses, "
              "beyond the most recent --keep and over --max-size; say what was kept and why.")
@click.option("--keep", type=click.IntRange(min=0), default=KEEP_DEFAULT, show_default=True,
              help="With --prune: environments kept per node (the most recently used).")
@click.option("--max-size", "max_gb", type=click.FloatRange(min=0), default=MAX_BYTES_DEFAULT
              / 2**30, show_default=True, help="With --prune: GiB kept per node at most.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per node.")
def venvs(cluster: str | None, prune: bool, keep: int, max_gb: float, as_json: bool) -> None:
    spec = load_spec(cluster, None)
    members = nodes.members(spec)
    answers = nodes.prune(members, keep, int(max_gb * 2**30)) if prune else \
        nodes.listing(members)
    if as_json:
        click.echo(json.dumps({h: a.answer if a.problem is None else {"problem": str(a.problem)}
                               for h, a in answers.items()}, indent=2))
    else:
        console = terminal(width=None if sys.stdout.isatty() else 160)
        for host, got in answers.items():
            if got.problem is not None:
                console.print(str(got.problem))
            elif prune:
                _pruned(console, host, got.answer)
            else:
                console.print(_table(host, got.answer.get("envs", [])))
    sys.exit(0 if all(a.problem is None for a in answers.values()) else 1)


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M")


def _table(host: str, envs: list[dict[str, Any]]) -> Table:
    table = Table(title=f"{host}: {len(envs)} environment(s)", title_justify="left")
    for col in ("digest", "size", "last used", "in use by", "source", "packages"):
        table.add_column(col)
    for e in envs:
        table.add_row(e["digest"][:12], f"{e['size'] / 2**20:.1f} MiB", _when(e["last_used"]),
                      ", ".join(e["in_use"]) or "-", e["source"], str(e["packages"]))
    return table


def _pruned(console: Console, host: str, answer: dict[str, Any]) -> None:
    for e in answer.get("removed", []):
        console.print(f"{host}: removed {e['digest'][:12]} ({e['size'] / 2**20:.1f} MiB): "
                      f"{e['why']}")
    for e in answer.get("kept", []):
        console.print(f"{host}: kept {e['digest'][:12]}: {e['why']}")
    console.print(f"{host}: {answer.get('wheels_removed', 0)} unused wheel(s) removed")
