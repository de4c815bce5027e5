"""End a running job everywhere: through its head when the head runs on this machine (it stops
the job in order on every node), else by signalling each node's guard of that job (the
job-scoped teardown of any stop); the job's head reports who ended it and exits 143."""

from __future__ import annotations

import getpass
import socket
import sys

import click

from ptcluster.cli.common import SECONDS, cluster_option, load_spec
from ptcluster.cli.console import say
from ptcluster.cli.problems import NOT_A_JOB_ID
from ptcluster.control.kill import GuardsStop, HeadStop, stop_through_guards, stop_through_head
from ptcluster.errors import UsageError
from ptcluster.node.sharing.records import valid_job_id


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
    if not valid_job_id(job_id):  # (it becomes a file's name on every node)
        raise UsageError.of(NOT_A_JOB_ID, job_id=repr(job_id[:80]))
    by = {"host": socket.gethostname(), "user": getpass.getuser()}
    head = stop_through_head(job_id, signame, by, wait=timeout)
    if head.taken:
        _say_head(job_id, head, timeout)
        sys.exit(0)
    if head.why_not:
        say(f"ptcluster: job {job_id}: not through its head ({head.why_not}); through "
                   "its nodes' guards", err=True)
    stop = stop_through_guards(load_spec(cluster, None), job_id, signame, by, timeout)
    sys.exit(_say_guards(job_id, signame, stop))


def _say_head(job_id: str, head: HeadStop, timeout: float) -> None:
    assert head.entry is not None
    who = f"its head (pid {head.entry.pid}, on this machine)"
    if head.ended:
        say(f"ptcluster: job {job_id}: ended on every node by {who}")
    else:
        say(f"ptcluster: job {job_id}: {who} is stopping it on every node (not done "
                   f"after {timeout:.0f} s; it goes on)")


def _say_guards(job_id: str, signame: str, stop: GuardsStop) -> int:
    """Say what the guards did; the exit code (0: signalled, none refused)."""
    if stop.signalled:
        say(f"ptcluster: job {job_id}: SIG{signame} to its guard on "
                   f"{', '.join(stop.signalled)}")
    alike: dict[str, list[str]] = {}  # every node of the job says the same: one line
    for host, why in stop.refused.items():
        alike.setdefault(why.what, []).append(host)
    for what, hosts in alike.items():
        say(f"ptcluster: {what} (on {', '.join(hosts)})", err=True)
    for host, why in stop.failed.items():
        say(f"ptcluster: {host}: {why.what}", err=True)
    if not stop.signalled and not stop.refused:
        say(f"ptcluster: no job {job_id} runs on these nodes "
                   "(`ptcluster ps --all-users` lists them)", err=True)
    return 0 if stop.ok else 1
