"""End a running job everywhere: through its head when the head runs on this machine (it stops
the job in order on every node), else by signalling each node's guard of that job (the
job-scoped teardown of any stop); the job's head reports who ended it and exits 143."""

from __future__ import annotations

import getpass
import queue
import socket
import sys
from functools import partial
from typing import Any

import click

from ptcluster.cli.common import SECONDS, cluster_option, load_spec
from ptcluster.cluster import ClusterSpec
from ptcluster.control.kill import HeadStop, stop_through_head
from ptcluster.node import KILL
from ptcluster.node.wire import control, split
from ptcluster.remote.channel import NodeChannel, close_all, start_all
from ptcluster.remote.connect import transports
from ptcluster.remote.transport import explain_channel_failure


@click.command(help=__doc__)
@cluster_option
@click.argument("job_id")
@click.option("--signal", "signame", type=click.Choice(["TERM", "INT", "KILL"]),
              default="TERM", show_default=True, help="Through the head: TERM and INT stop "
              "the job in order, KILL without waiting for the nodes. Through the guards: what "
              "they get (KILL: the guard dies at once and the kernel ends its process tree: no "
              "grace).")
@click.option("--timeout", type=SECONDS, default=20.0, show_default=True,
              help="Seconds to wait for every node (or for the head to end the job).")
def kill(cluster: str | None, job_id: str, signame: str, timeout: float) -> None:
    by = {"host": socket.gethostname(), "user": getpass.getuser()}
    head = stop_through_head(job_id, signame, by, wait=timeout)
    if head.taken:
        _say_head(job_id, head, timeout)
        sys.exit(0)
    if head.why_not:
        click.echo(f"ptcluster: job {job_id}: not through its head ({head.why_not}); through "
                   "its nodes' guards", err=True)
    sys.exit(_through_guards(load_spec(cluster, None), job_id, signame, by, timeout))


def _say_head(job_id: str, head: HeadStop, timeout: float) -> None:
    assert head.entry is not None
    who = f"its head (pid {head.entry.pid}, on this machine)"
    if head.ended:
        click.echo(f"ptcluster: job {job_id}: ended on every node by {who}")
    else:
        click.echo(f"ptcluster: job {job_id}: {who} is stopping it on every node (not done "
                   f"after {timeout:.0f} s; it goes on)")


def _through_guards(spec: ClusterSpec, job_id: str, signame: str, by: dict[str, str],
                    timeout: float) -> int:
    """Signal each node's guard of the job; the exit code (0: signalled, none refused)."""
    answers: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()

    def frames(host: str, lines: list[str]) -> None:
        for line in lines:
            kind, payload = split(line)
            if kind == "result":
                answers.put((host, control(payload)))

    def closed(host: str, python: str, code: int | None, stderr: list[str]) -> None:
        answers.put((host, {"error": explain_channel_failure(stderr, code, python)[0]}))

    def could_not_start(channel: NodeChannel, problem: str, fix: str) -> None:
        answers.put((channel.host, {"error": problem}))

    channels = start_all([NodeChannel(transports(spec)[n.host], n.python, KILL,
                                      {"job_id": job_id, "signal": signame, "by": by},
                                      on_frames=partial(frames, n.host),
                                      on_closed=partial(closed, n.host, n.python))
                          for n in spec.nodes], could_not_start)
    got: dict[str, dict[str, Any]] = {}
    try:
        while len(got) < len(spec.nodes):
            try:
                host, answer = answers.get(timeout=timeout)
            except queue.Empty:
                break
            got.setdefault(host, answer)  # the first word of a node (a close comes after)
    finally:
        close_all(channels, timeout=5.0)
    signalled = [h for h, a in got.items() if a.get("signalled")]
    refused = {h: a["error"] for h, a in got.items() if a.get("found") and a.get("error")}
    failed = {h: a["error"] for h, a in got.items() if not a.get("found") and a.get("error")}
    for n in spec.nodes:
        if n.host not in got:
            failed[n.host] = f"no answer within {timeout:.0f} s"
    if signalled:
        click.echo(f"ptcluster: job {job_id}: SIG{signame} to its guard on "
                   f"{', '.join(signalled)}")
    alike: dict[str, list[str]] = {}  # every node of the job says the same: one line
    for n in spec.nodes:  # (in the cluster file's order, not the order they answered)
        if n.host in refused:
            alike.setdefault(refused[n.host], []).append(n.host)
    for why, hosts in alike.items():
        click.echo(f"ptcluster: {why} (on {', '.join(hosts)})", err=True)
    for host, why in failed.items():
        click.echo(f"ptcluster: {host}: {why}", err=True)
    if not signalled and not refused:
        click.echo(f"ptcluster: no job {job_id} runs on these nodes "
                   "(`ptcluster ps --all-users` lists them)", err=True)
    return 0 if signalled and not refused else 1
