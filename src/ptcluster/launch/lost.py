"""A lost node, explained: once an attempt is over, the head asks each node it lost once more,
briefly, what became of it (``node.probe``), and words the loss from the answer.

- no answer within ``PROBE_TIMEOUT``: "does not answer (powered off, or its network is down)";
- another boot id than its guard reported at ready: "rebooted at 10:42 (up 3 h before)", with
  the previous boot's last kernel lines where its journal keeps them;
- the same boot: "is up; its guard ended (...)" with what the head knows of that end, or, when
  the guard still runs there, that only its connection to the head was cut.

A node is asked when its failure is a loss (its channel closed or went silent) and its guard
sent no exit of its own. Every such node is asked at once, from the runner's thread (the
channels' I/O thread only carries the frames): the job's exit waits at most ``PROBE_BOUND`` s
for it, and not at all when no node was lost.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ptcluster.errors import Problem
from ptcluster.launch.plan import LaunchPlan
from ptcluster.launch.result import Failure, FailureKind, NodeOutcome
from ptcluster.node import PROBE
from ptcluster.node.facts.health_facts import HealthContext
from ptcluster.node.probe import BootAnswer, ProbeConfig
from ptcluster.node.problems import Declared
from ptcluster.node.wire import Kind
from ptcluster.remote.group import Group, Member
from ptcluster.remote.node_replies import boot_answer
from ptcluster.remote.replies import BadReply
from ptcluster.remote.transport import Transport

PROBE_TIMEOUT = 4.0
"""Seconds a lost node has to answer (an ssh connection, a Python start, a few files read)."""
CLOSE_TIMEOUT = 1.0
"""Seconds the probes' channels have to end after the answer (or after being killed)."""
PROBE_BOUND = PROBE_TIMEOUT + 2 * CLOSE_TIMEOUT
"""The most the probes add to the job's exit: the answer, the channels' end, their last word."""
NO_ANSWER = "does not answer (powered off, or its network is down)"

KERNEL_CAUSES = ": a kernel panic, a watchdog, the power or an administrator"
LOST_NO_ANSWER = Declared(
    "run.lost-no-answer", "a lost node does not answer the head's probe", NO_ANSWER,
    "check its power and its network (a console, the BMC); `ptcluster doctor` once it is "
    "back; with --max-restarts and --min-nodes a restart goes on without it")
LOST_MALFORMED = Declared(
    "run.lost-malformed", "a lost node answered the probe with a malformed answer",
    "answered the head's probe with a malformed answer ({why})",
    "check that node (a node that sends this may be compromised)")
LOST_REBOOTED = Declared(
    "run.lost-rebooted", "a lost node rebooted (its kernel's last lines read)",
    "rebooted at {at}{was_up}", "its previous boot's last kernel lines are below" + KERNEL_CAUSES)
LOST_REBOOTED_UNSEEN = Declared(
    "run.lost-rebooted-unseen", "a lost node rebooted (its kernel's last lines not read)",
    "rebooted at {at}{was_up}",
    "see its previous boot's kernel log (`journalctl -k -b -1` on it)" + KERNEL_CAUSES)
LOST_CUT_OFF = Declared(
    "run.lost-cut-off", "a lost node is up, only cut off from the head",
    "is up and its guard (pid {pid}) still runs: only its connection to the head was cut",
    "check the network between the head and it; its guard ends the job there when it no "
    "longer hears the head")
LOST_GUARD_ENDED = Declared(
    "run.lost-guard-ended", "a lost node is up, its guard ended",
    "is up; its guard ended ({detail})",
    "see the node log in the run directory; something on it killed the guard (the "
    "out-of-memory killer, an administrator, a script that kills by name)")
TABLE = (LOST_NO_ANSWER, LOST_MALFORMED, LOST_REBOOTED, LOST_REBOOTED_UNSEEN, LOST_CUT_OFF,
         LOST_GUARD_ENDED)
"""What became of a lost node, as the head's probe after the job found it: the node's failure
is said again as one of these (its code replaces the loss's; the loss's words stay in its
message, ``before: ...``)."""


@dataclass(frozen=True)
class Unbelieved:
    """A probe's answer that failed its check (``remote.node_replies.BOOT``): only why is
    kept, never the node's words."""

    why: str


Probed = BootAnswer | Unbelieved | None
"""A lost node's answer to the probe: checked, refused, or none in time."""


def after_loss(answer: Probed) -> dict[str, Any]:
    """``summary.json``'s ``after_loss`` of a node (its keys as they always were: ``answered``,
    then the answer's own, or ``malformed``)."""
    if isinstance(answer, Unbelieved):
        return {"answered": True, "malformed": answer.why}
    return {"answered": answer is not None, **(answer or {})}


def back(answer: Probed) -> BootAnswer | None:
    """A believed answer of a node whose guard of then no longer runs (its ranks are gone with
    it): one a restart may take back, given its health."""
    if answer is None or isinstance(answer, Unbelieved) or answer.get("guard_alive"):
        return None
    return answer


def lost_nodes(failures: Sequence[Failure], nodes: Sequence[NodeOutcome]) -> list[NodeOutcome]:
    """The nodes worth asking: lost (kind ``lost``, not a rank's failure) after they were ready,
    without an exit of their guard's own (a guard that said why it ended needs no probe)."""
    by_host = {n.host: n for n in nodes}
    hosts = dict.fromkeys(f.host for f in failures
                          if f.kind is FailureKind.LOST and f.rank is None)
    return [by_host[h] for h in hosts
            if h in by_host and by_host[h].ready and by_host[h].guard_exit is None]


def probe(nodes: Sequence[NodeOutcome], plan: LaunchPlan | Mapping[str, str], job_id: str,
          transports: Mapping[str, Transport],
          health: Mapping[str, HealthContext] | None = None) -> dict[str, Probed]:
    """Each node's ``boot`` answer, None for a node that gave none in time (``plan``: the
    plan the nodes ran in, or each node's interpreter; ``health``: per node, the context of
    its health gate, whose verdict the answer then carries as ``unfit``)."""
    python = {n.host: n.python for n in plan.nodes} if isinstance(plan, LaunchPlan) else plan
    def config(n: NodeOutcome) -> ProbeConfig:
        cfg: ProbeConfig = {"job_id": job_id, "guard_pid": n.facts.get("pid"),
                            "boot_id": n.facts.get("boot_id")}
        if health and n.host in health:
            cfg["health"] = health[n.host]
        return cfg

    members = [Member(n.host, transports[n.host], python[n.host], config(n))
               for n in nodes if n.host in transports and n.host in python]
    if not members:
        return {}
    group = Group(members, PROBE, answer=Kind.BOOT)
    try:
        group.wait(Kind.BOOT, PROBE_TIMEOUT)
    finally:
        result = group.close(timeout=CLOSE_TIMEOUT)
    return {h: _checked(r.answers.get(Kind.BOOT)) for h, r in result.nodes.items()}


def _checked(answer: dict[str, Any] | None) -> Probed:
    """A probe's answer checked (``remote.node_replies``); a malformed one is kept only as
    why (the node's words are not believed)."""
    if answer is None:
        return None
    try:
        return boot_answer(answer)
    except BadReply as exc:
        return Unbelieved(exc.what)


def explain_losses(failures: Sequence[Failure], nodes: Sequence[NodeOutcome], plan: LaunchPlan,
                   transports: Mapping[str, Transport]) -> None:
    """Ask every lost node once more; each one's failure says what became of it, and its
    record keeps the answer (``after_loss`` in ``summary.json``)."""
    lost = lost_nodes(failures, nodes)
    if not lost:
        return
    answers = probe(lost, plan, plan.job_id, transports)
    for node in lost:
        answer = answers.get(node.host)
        node.after_loss = after_loss(answer)
        for failure in failures:
            if failure.host == node.host and failure.kind is FailureKind.LOST and \
                    failure.rank is None:
                reword(failure, node, answer)


def answering_again(nodes: Sequence[NodeOutcome], python: Mapping[str, str], job_id: str,
                    transports: Mapping[str, Transport]) -> list[str]:
    """The nodes lost earlier in the run (each with its outcome from the attempt that lost it)
    that answer the probe now, well-formed, and whose guard of that attempt no longer runs
    there (its ranks are gone with it): what a restart may take back (``restart.decide``'s
    ``returned``). The probe costs at most ``PROBE_BOUND`` s, only when there are such nodes."""
    if not nodes:
        return []
    answers = probe(nodes, python, job_id, transports)
    return [n.host for n in nodes if back(answers.get(n.host)) is not None]


def reword(failure: Failure, node: NodeOutcome, answer: Probed) -> None:
    """``failure`` (a loss of ``node``) said again with what the probe found: pure."""
    found, lines = explained(node, answer, failure.at, failure.message)
    # (the same boot's words carry the loss already: said once)
    what = found.what if failure.message in found.what else \
        f"{found.what} (before: {failure.message})"
    failure.problem = replace(found, what=what).by(failure.who)
    if lines:
        failure.last_lines = [*failure.last_lines, *lines]


def explain(node: NodeOutcome, answer: Probed, lost_at: float,
            detail: str) -> tuple[str, str, list[str]]:
    """(what became of ``node``, the fix, kernel lines to show): :func:`explained` in words."""
    found, lines = explained(node, answer, lost_at, detail)
    return found.what, found.fix or "", lines


def explained(node: NodeOutcome, answer: Probed, lost_at: float,
              detail: str) -> tuple[Problem, list[str]]:
    """(what became of ``node``, as its declared problem (``TABLE``); kernel lines to show)
    from the probe's ``answer`` and its ready facts; ``lost_at``: when it was lost (head
    clock); ``detail``: what the head knew then (the loss as it was worded)."""
    facts = node.facts
    if answer is None:
        return Problem.of(LOST_NO_ANSWER, None), []
    if isinstance(answer, Unbelieved):
        return Problem.of(LOST_MALFORMED, None, why=answer.why), []
    before, now = facts.get("boot_id"), answer.get("boot_id")
    if before and now and before != now:
        booted = float(answer.get("time") or 0.0) - float(answer.get("uptime") or 0.0)
        up = facts.get("uptime")
        was_up = "" if up is None else \
            f" (up {span(float(up) + max(0.0, lost_at - float(facts.get('time') or lost_at)))}" \
            " before)"
        lines = [str(x) for x in answer.get("kernel") or []]
        return Problem.of(LOST_REBOOTED if lines else LOST_REBOOTED_UNSEEN, None,
                          at=clock(booted), was_up=was_up), lines
    if answer.get("guard_alive"):
        return Problem.of(LOST_CUT_OFF, None, pid=facts.get("pid")), []
    return Problem.of(LOST_GUARD_ENDED, None, detail=detail), []


def clock(at: float) -> str:
    """``HH:MM`` of wall time ``at`` on this machine's clock (and time zone)."""
    return time.strftime("%H:%M", time.localtime(at))


def span(seconds: float) -> str:
    """A duration as a person says it: ``3 h``, ``2 d``, ``25 min``, ``40 s``."""
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.0f} d"
    if seconds >= 3600:
        return f"{seconds / 3600:.0f} h"
    if seconds >= 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"
