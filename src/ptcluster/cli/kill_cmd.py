"""End a running job everywhere, from any machine that reaches its nodes: each node's guard of
that job is signalled (the job-scoped teardown of any stop), and the job's head reports who."""

from __future__ import annotations

import getpass
import queue
import socket
import sys
from functools import partial
from typing import Any

import click

from ptcluster.cli.common import SECONDS, cluster_option, load_spec
from ptcluster.node import KILL
from ptcluster.node.wire import control, split
from ptcluster.remote.channel import NodeChannel, close_all, start_all
from ptcluster.remote.connect import transports
from ptcluster.remote.transport import explain_channel_failure


@click.command(help=__doc__)
@cluster_option
@click.argument("job_id")
@click.option("--signal", "signame", type=click.Choice(["TERM", "INT", "KILL"]),
              default="TERM", show_default=True, help="What the guards get (KILL: the guard "
              "dies at once and the kernel ends its process tree: no grace).")
@click.option("--timeout", type=SECONDS, default=20.0, show_default=True,
              help="Seconds to wait for every node.")
def kill(cluster: str | None, job_id: str, signame: str, timeout: float) -> None:
    spec = load_spec(cluster, None)
    answers: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
    by = {"host": socket.gethostname(), "user": getpass.getuser()}

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
    for host, why in {**refused, **failed}.items():
        click.echo(f"ptcluster: {host}: {why}", err=True)
    if not signalled and not refused:
        click.echo(f"ptcluster: no job {job_id} runs on these nodes "
                   "(`ptcluster ps --all-users` lists them)", err=True)
    sys.exit(0 if signalled and not refused else 1)
