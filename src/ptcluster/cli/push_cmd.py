"""Copy a folder of this machine's to every node: only the files a node's copy lacks (by
content), each verified by sha256 on the node and renamed into place whole."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.live import Live
from rich.text import Text

from ptcluster.cli import exits
from ptcluster.cli.common import cluster_option, load_spec, quiet
from ptcluster.cli.console import say, terminal
from ptcluster.cluster.model import ClusterSpec, DataSpec
from ptcluster.push.entries import with_data
from ptcluster.push.scan import scan
from ptcluster.push.send import SENDING, Progress, PushResult, members_for, push
from ptcluster.remote.connect import transports
from ptcluster.remote.group import Member

if TYPE_CHECKING:  # (the node program's own imports are not the head's: ~6 ms of every run)
    from ptcluster.node.data_agent import PushConfig


def nodes_of(spec: ClusterSpec, dest: str) -> list[Member[PushConfig]]:
    reach = transports(spec)
    return members_for([Member(n.host, reach[n.host], n.python, {}) for n in spec.machines], dest)


class Shown:
    """``push``'s events for a person: the final ones as lines; on a terminal the rest in one
    live line (bytes sent, rate, per node)."""

    def __init__(self, console: Console, hosts: list[str]) -> None:
        self.console = console
        self.sent = dict.fromkeys(hosts, 0)
        self.total = dict.fromkeys(hosts, 0)
        self.begun = time.monotonic()
        self.live: Live | None = None

    def __call__(self, p: Progress) -> None:
        if p.final or self.live is None and p.state != SENDING:
            self.console.print(f"ptcluster: push: {p.host}: {p.text}")
        if p.state == SENDING or p.final:
            self.sent[p.host], self.total[p.host] = p.sent, max(p.total, p.sent)
        if self.live is not None:
            sent = sum(self.sent.values())
            rate = sent / max(time.monotonic() - self.begun, 1e-3) / 1e6
            nodes = " · ".join(f"{h} {self._percent(h)}%" for h in self.sent)
            self.live.update(Text(f"push: {sent / 1e6:.1f} MB sent, {rate:.1f} MB/s: {nodes}"),
                             refresh=True)


    def _percent(self, host: str) -> int:
        return 100 * self.sent[host] // self.total[host] if self.total[host] else 100


def run_push(spec: ClusterSpec, src: Path, dest: str, *, delete: bool, show: bool,
             relay: bool | None = None) -> PushResult:
    """Scan, push, say each node's outcome (stderr): what ``push`` and ``run --data`` share."""
    listing = scan(src)
    err = terminal(stderr=True, soft_wrap=True)
    if show:
        err.print(f"ptcluster: push: {listing.src} ({len(listing.files)} file(s), "
                  f"{listing.size / 1e6:.1f} MB) to {dest} on {len(spec.machines)} node(s)")
    members = nodes_of(spec, dest)
    if not show:
        return push(members, listing, delete=delete, relay=relay)
    shown = Shown(err, [m.host for m in members])
    with Live(console=err, auto_refresh=False, transient=True) if err.is_terminal else \
            contextlib.nullcontext() as live:
        shown.live = live
        return push(members, listing, delete=delete, relay=relay, on_event=shown)


def push_data(spec: ClusterSpec, data: tuple[DataSpec, ...], *, show: bool) -> ClusterSpec:
    """``run``'s data pushed before launch, each entry in turn; exit 1 when a node failed
    (the job would read a partial copy). The spec the ranks get their variables from."""
    err = terminal(stderr=True, soft_wrap=True)
    for entry in data:
        done = run_push(spec, Path(entry.src), entry.dest, delete=False, show=show)
        if not done.ok:
            for node in done.failed.values():
                err.print(str(node.problem))
            err.print(f"ptcluster: data {entry.name} is not on every node: not started")
            sys.exit(exits.FAILED)
    return with_data(spec, data)


@click.command("push", help=__doc__ + "\n\nSRC goes to the same absolute path on every node, or to "
               "--to. Files on a node that SRC does not have are kept (as rsync keeps them) "
               "unless --delete.")
@cluster_option
@click.argument("src", type=click.Path(path_type=Path))
@click.option("--to", "dest", default=None, help="The folder on every node (default: SRC's "
              "absolute path).")
@click.option("--delete", is_flag=True, help="Remove the files under the node's folder that "
              "SRC does not have.")
@click.option("--relay/--no-relay", default=None, help="The nodes pass the files on to each "
              "other over the cluster network (a chain), so this machine sends each byte once "
              "(default: from 3 nodes).")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON (every node's, "
              "a failure's problem with its code and fields) instead of the lines.")
def push_cmd(cluster: str | None, src: Path, dest: str | None, delete: bool,
             relay: bool | None, as_json: bool) -> None:
    spec = load_spec(cluster)
    where = dest or str(src.expanduser().absolute())
    done = run_push(spec, src, where, delete=delete, show=not quiet() and not as_json,
                    relay=relay)
    if as_json:
        click.echo(json.dumps(done.to_json(), indent=2))
        sys.exit(exits.OK if done.ok else exits.FAILED)
    for node in done.failed.values():
        assert node.problem is not None
        terminal(stderr=True, soft_wrap=True).print(str(node.problem))
    sent = done.bytes_sent
    say(f"ptcluster: push: {done.files} file(s), {done.size / 1e6:.1f} MB to "
               f"{len(done.nodes) - len(done.failed)} of {len(done.nodes)} node(s); "
               f"{sent} bytes sent in {done.seconds:.1f} s"
               + (f" (relayed: {' -> '.join(done.chain)})" if done.chain else ""))
    sys.exit(exits.OK if done.ok else exits.FAILED)
