"""Asking every node once (remote/group.py) with real processes: every node gets its outcome,
whatever the others do, and each failure says why."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass

from ptcluster.node import GUARD
from ptcluster.node.wire import Kind
from ptcluster.remote.group import Member, Why, ask_all
from ptcluster.remote.transport import Transport
from tests.local.test_channel import Shell


@dataclass
class Missing(Transport):
    """A "node" whose local program does not exist (as ssh missing on the head)."""

    host: str

    def argv(self, node_argv: list[str]) -> list[str]:
        return ["/no/such/program"]

    def spawn(self, node_argv: list[str]) -> subprocess.Popen[bytes]:
        return super().spawn(node_argv)


def test_every_node_gets_its_outcome_and_a_failure_never_stops_the_others() -> None:
    scripts = {
        "answers": "echo 'result {\"n\": 1}'; cat >/dev/null",
        "bad": "echo 'result [1]'; cat >/dev/null",
        "dies": "echo 'the last words' >&2; exit 3",
        "silent": "sleep 30",
        "other": "echo 'hb {}'; echo 'result {\"n\": 2}'; echo 'result {\"n\": 3}'; cat >/dev/null",
    }
    members = [Member(h, Shell(h, s), "python3", {}) for h, s in scripts.items()]
    members.insert(2, Member("missing", Missing("missing"), "python3", {}))
    t0 = time.monotonic()
    result = ask_all(members, GUARD, Kind.RESULT, timeout=3.0)
    assert time.monotonic() - t0 < 15
    assert list(result.nodes) == ["answers", "bad", "missing", "dies", "silent", "other"]
    assert {h: r.answers[Kind.RESULT] for h, r in result.succeeded.items()} == {
        "answers": {"n": 1}, "other": {"n": 2}}  # (the first of a kind)
    failed = result.failed
    assert {h: r.why for h, r in failed.items()} == {
        "bad": Why.BAD_FRAME, "missing": Why.NOT_STARTED, "dies": Why.CLOSED,
        "silent": Why.NO_ANSWER}
    assert failed["bad"].problem is not None and "bad frame" in failed["bad"].problem.what
    assert failed["missing"].problem is not None and failed["missing"].problem.fix
    assert failed["dies"].exit_code == 3 and failed["dies"].stderr == ["the last words"]
    dies = failed["dies"].problem
    assert dies is not None and (dies.code, dies.fields) == (
        "node.command-failed", {"detail": failed["dies"].stderr[-1]}), dies
    assert failed["silent"].problem is not None
    assert failed["silent"].problem.what == "no answer within 3 s"
    assert failed["silent"].exit_code == -9  # (killed at the deadline)
