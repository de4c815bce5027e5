"""What a node sends is bounded: the ranks it may speak for, who it may say killed the job, the
size of its stacks frame, the hostname setup writes for it. (The frame size on the head's I/O
thread: tests/local/test_channel.py.)"""

from __future__ import annotations

import copy
import json

import pytest

from ptcluster.cluster.validate import is_dns_name
from ptcluster.launch.supervise import events as ev
from ptcluster.launch.supervise.actions import StacksAnswered
from ptcluster.node import wire
from ptcluster.node.guard.progress import fit_stacks
from ptcluster.setup import plan as P
from ptcluster.setup import steps as S
from tests.local.test_setup_plan import CF, FRESH
from tests.unit.test_supervisor import WALL, make, start


# -- the ranks a node speaks for ----------------------------------------------------------------
def test_a_stacks_reply_keeps_the_ranks_of_the_node_that_sent_it() -> None:
    # b runs rank 2 only; its reply also brings "stacks" of a's ranks 0 and 1 (a false
    # desync/straggler verdict of a hang) and of a rank that does not exist
    sup = make()
    start(sup)
    forged = {0: {"pid": 1, "text": "forged"}, 1: {"pid": 1, "text": "forged"},
              2: {"pid": 7, "text": "b's own"}, 9: {"pid": 1, "text": "nobody's"}}
    got = sup.on_event(ev.StacksReply("b", 3, forged), 2.0)
    assert got == [StacksAnswered(ev.StacksReply("b", 3, {2: {"pid": 7, "text": "b's own"}}))]


# -- who a node may say ended the job -----------------------------------------------------------
def stopping(payload: dict) -> ev.Event:
    return ev.decode("b", wire.encode(wire.Kind.STOPPING, payload).decode().rstrip("\n"))


def test_killed_by_is_taken_in_the_form_a_guard_makes_of_a_kill_note_only() -> None:
    said = wire.KILLED_BY.format(host="head-1.example", user="alice")
    base = {"reason": said, "t": 9.0, "signal": "SIGTERM"}
    assert stopping({**base, "killed_by": said}) == ev.GuardStopping("b", said, 9.0, "SIGTERM",
                                                                     said)
    for forged in ("anything at all", said + "\n\x1b[2Jroot was here",
                   wire.KILLED_BY.format(host="h;rm -rf ~", user="alice"),
                   wire.KILLED_BY.format(host="h", user="a b"), said[:-1]):
        assert stopping({**base, "killed_by": forged}).killed_by == ""  # type: ignore[union-attr]
    # a guard names who killed the job only when a signal stopped it (the kill path)
    assert stopping({"reason": "x", "t": 9.0, "killed_by": said}).killed_by == ""  # type: ignore


def test_a_forged_killed_by_does_not_stop_the_restarts() -> None:
    sup = make()
    start(sup)
    sup.on_event(stopping({"reason": "x", "t": WALL + 3.0, "signal": "SIGTERM",
                           "killed_by": "ended by me, no restart please"}), 3.0)
    assert sup.killed_by == ""
    sup = make()
    start(sup)
    said = wire.KILLED_BY.format(host="head", user="alice")
    sup.on_event(stopping({"reason": said, "t": WALL + 3.0, "signal": "SIGTERM",
                           "killed_by": said}), 3.0)
    assert sup.killed_by == said


# -- the size of a stacks frame -----------------------------------------------------------------
def test_a_guards_stacks_reply_fits_the_frame_the_head_accepts() -> None:
    # 16 ranks with a thread dump of 1 MiB each, py-spy's 64 KiB and flight records: 17 MiB of
    # JSON, which the head would close the channel for (MAX_FRAME); each rank keeps a share
    ranks = {str(r): {"pid": 100 + r, "how": "probe thread", "text": f"rank {r} main\n" +
                      "  File \"x.py\", line 1\n" * 40000, "pyspy": "é" * 65536,
                      "fr": {"entries": ["allreduce"] * 1000}, "ms": 1.0} for r in range(16)}
    limit = wire.MAX_FRAME - 4096
    fitted = fit_stacks(copy.deepcopy(ranks), limit)
    assert len(json.dumps(fitted, separators=(",", ":"))) <= limit
    for r, rank in fitted.items():
        assert rank["text"].startswith(f"rank {r} main\n  File") and "[cut at " in rank["text"]
        assert rank["pid"] == 100 + int(r)
    small = {"0": {"pid": 1, "text": "short", "fr": {}}}
    assert fit_stacks(copy.deepcopy(small), limit) == small  # (what fits is left alone)


# -- the hostname setup writes for a node -------------------------------------------------------
@pytest.mark.parametrize("name, ok", [
    ("node1", True), ("gpu-01.cluster.example", True), ("n1.", True),
    ("n1\n10.6.6.6 n0 mirror.example", False), ("n1\n", False), ("10.6.6.6", False),
    ("1.2.3", False), ("fe80::1", False), ("fe80::1%eth0", False), ("", False),
    ("-n1", False), ("n 1", False), ("n1;reboot", False), ("a" * 64, False), (None, False),
])
def test_a_hostname_is_a_dns_name_or_nothing(name: object, ok: bool) -> None:
    assert is_dns_name(name) is ok


def test_a_node_that_reports_a_hostname_with_a_newline_writes_nothing_anywhere() -> None:
    # (review finding 2) n2's facts say its name is "n2\n10.6.6.6 n0 mirror.example": before,
    # every node's /etc/hosts block got the line "10.6.6.6 n0 mirror.example n2"
    evil = "node2\n10.6.6.6 n0 mirror.example"
    facts = {"n0": {**FRESH, "hostname": "node0"}, "n1": FRESH,
             "n2": {**FRESH, "hostname": evil}}
    problem = P.hostname_problem(facts["n2"])
    assert problem is not None and problem.fix and "'node2\\n10.6.6.6" in problem.what
    assert P.hostname_problem(FRESH) is None
    assert P.cluster_hostnames(facts) == {"n0": "node0", "n1": "node1"}
    # and the /etc/hosts step never writes a name that is not a DNS name, wherever it came from
    cf = S.ClusterFacts(**{**CF.__dict__, "hostnames": {"n0": "node0", "n1": "node1",
                                                         "n2": evil}})
    hosts = {s.name: s for s in P.plan_node("n1", FRESH, cf)}["/etc/hosts"]
    text = hosts.actions[0].input or ""
    assert "10.6.6.6" not in text and "mirror" not in text
    entries = [line.split() for line in text.splitlines()]  # (address, its names), as hosts(5)
    assert ["10.0.0.3", "n2"] in entries and ["10.0.0.1", "node0", "n0"] in entries


def test_a_channel_closed_for_a_frame_too_long_says_so() -> None:
    # the reason is the last line the channel's on_closed gets (the hub's TOO_LONG): run,
    # doctor and setup say it as it is, with what to look at
    from ptcluster.remote.hub import TOO_LONG
    from ptcluster.remote.transport import explain_channel_failure

    said = explain_channel_failure(["Warning: Permanently added 'n1'", TOO_LONG], -9, "python3")
    assert said.code == "node.frame-too-long" and said.fix
    assert said.fields["detail"].startswith("the node sent a line of more than 4 MiB")
