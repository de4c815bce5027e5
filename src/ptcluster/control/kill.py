"""``ptcluster kill``: through the job's head when the head runs on this machine, else through
each node's guard of the job.

The head is found in this user's registry (``control.registry``) and asked on its control socket;
it stops the job in order on every node, as on Ctrl-C, names the asker as the cause and exits
143. Whatever keeps a head from taking the request (no entry: the head runs elsewhere or is
another user's; a head on another machine that shares this home; a dead socket; an older head
that does not know the request; no answer) is said in ``why_not``, and the caller goes through
each node's guard instead (:func:`stop_through_guards`: every node asked at once, each one's
outcome kept).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from ptcluster.cluster import ClusterSpec
from ptcluster.control import registry as heads
from ptcluster.control.protocol import ControlError, alive, ask, kill_request
from ptcluster.errors import Problem
from ptcluster.node import KILL
from ptcluster.node.kill import KillConfig
from ptcluster.node.problems import Declared
from ptcluster.node.wire import Kind
from ptcluster.remote.connect import transports
from ptcluster.remote.group import Member, ask_all
from ptcluster.remote.node_replies import kill_answer
from ptcluster.remote.replies import BadReply

NO_ANSWER = Declared(
    "kill.no-answer", "a node gave no answer to kill", "no answer",
    "check that the node is up and reachable (`ptcluster doctor`), then kill again")
MALFORMED = Declared(
    "kill.malformed-answer", "a node's answer to kill is not one",
    "it sent a malformed answer: {why}",
    "check that node (a node that sends this may be compromised)")
TABLE = (NO_ANSWER, MALFORMED)
"""What the head says of a node that did not say what became of the job's guard there (the
node's own answers: ``node.kill.TABLE``)."""

ANSWER_TIMEOUT = 5.0
"""Seconds a head has to take the request (it answers at once; the stop goes on after)."""


@dataclass(frozen=True)
class HeadStop:
    """What came of asking a job's head to end it."""

    entry: heads.HeadEntry | None
    """The head as registered, None when this user has no head of the job registered."""
    taken: bool = False
    """The head took the request: it is stopping the job everywhere."""
    ended: bool = False
    """... and its control socket closed within the wait: every node's part has ended."""
    why_not: str = ""
    """When a registered head did not take it: why (the guards are the way then)."""


def stop_through_head(job_id: str, signame: str, by: dict[str, str],
                      wait: float) -> HeadStop:
    """Ask ``job_id``'s head on this machine to end it, then wait up to ``wait`` seconds for
    the head to finish (its control socket closes when every attempt's nodes are done)."""
    entry = heads.find(job_id)
    if entry is None:
        return HeadStop(None)
    if not entry.here:
        return HeadStop(entry, why_not=f"its head runs on {entry.host}")
    request = kill_request(job_id, signame, by)
    try:
        answer = ask(entry.run_dir, request, timeout=ANSWER_TIMEOUT, owner=os.getuid())
    except ControlError as exc:
        if not alive(entry.run_dir):
            heads.forget(entry)  # its head is gone (killed by SIGKILL): the entry is stale
        return HeadStop(entry, why_not=exc.message)
    except (OSError, ValueError) as exc:
        return HeadStop(entry, why_not=f"its control socket in {entry.run_dir}: {exc}")
    if not answer.get("ok"):
        return HeadStop(entry, why_not=f"its head says: {str(answer.get('error'))[:200]}")
    deadline = time.monotonic() + wait
    while alive(entry.run_dir):
        if time.monotonic() >= deadline:
            return HeadStop(entry, taken=True)
        time.sleep(0.2)
    return HeadStop(entry, taken=True, ended=True)


@dataclass(frozen=True)
class GuardsStop:
    """What came of signalling each node's guard of a job, per node in the cluster file's
    order."""

    signalled: list[str] = field(default_factory=list)
    """The nodes whose guard of the job got the signal (it tears its job down by itself)."""
    refused: dict[str, Problem] = field(default_factory=dict)
    """Per node where the job runs but its guard was not signalled: why (another user's)."""
    failed: dict[str, Problem] = field(default_factory=dict)
    """Per node that could not be asked, or could not say: why (``kill.*`` codes, or the
    connection's ``node.*``)."""

    @property
    def ok(self) -> bool:
        """Signalled somewhere, refused nowhere."""
        return bool(self.signalled) and not self.refused


def stop_through_guards(spec: ClusterSpec, job_id: str, signame: str, by: dict[str, str],
                        timeout: float) -> GuardsStop:
    """Send SIG``signame`` to the guard of ``job_id`` on every node of ``spec`` (the node's
    ``kill`` program finds it by its lease), waiting up to ``timeout`` s for every node."""
    reach = transports(spec)
    config: KillConfig = {"job_id": job_id, "signal": signame, "by": by}
    result = ask_all([Member(n.host, reach[n.host], n.python, config) for n in spec.machines],
                     KILL, Kind.RESULT, timeout)
    signalled: list[str] = []
    refused: dict[str, Problem] = {}
    failed: dict[str, Problem] = {}
    for host, node in result.nodes.items():
        said = node.answers.get(Kind.RESULT)
        if said is None:
            failed[host] = Problem.of(NO_ANSWER, host) if node.problem is None else node.problem
            continue
        try:
            answer = kill_answer(said)
        except BadReply as exc:
            failed[host] = Problem.of(MALFORMED, host, why=exc.what)
            continue
        if answer.get("signalled"):
            signalled.append(host)
        if answer.get("error"):
            sent = answer.get("problem")
            why = Problem(host, answer.get("error") or "") if sent is None else \
                Problem.received(host, sent)
            (refused if answer.get("found") else failed)[host] = why
    return GuardsStop(signalled, refused, failed)
