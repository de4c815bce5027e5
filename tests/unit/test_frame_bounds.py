"""A node's guard frames, bounded where the head decodes them (issue 43 item 3): a frame of a
kind the head reads whose ranks, pids, exit codes, times or texts are out of bounds is
``Malformed`` with its kind, and the supervisor makes it that node's failure, named, never an
exception; a well-formed frame decodes as before."""

from __future__ import annotations

import json

import pytest

from ptcluster.launch.result import FailureKind
from ptcluster.launch.supervise import events as ev
from ptcluster.launch.supervise.supervisor import Phase
from tests.unit.test_supervisor import make, start

BAD = [
    ("rstart", {"rank": -1, "pid": 7, "t": 1.0}),
    ("rstart", {"rank": 1 << 40, "pid": 7, "t": 1.0}),
    ("rstart", {"rank": 0, "pid": 0, "t": 1.0}),
    ("rstart", {"rank": 0, "pid": True, "t": 1.0}),
    ("rstart", {"rank": "0", "pid": 7, "t": 1.0}),
    ("rexit", {"rank": 0, "code": 1 << 40, "t": 1.0}),
    ("rexit", {"rank": 0, "code": 1.5, "t": 1.0}),
    ("rexit", {"rank": 0, "code": 1, "t": "soon"}),
    ("rexit", {"rank": 0, "code": 1, "t": 1.0, "duration": 1e300}),
    ("rerror", {"rank": 0, "t": 1.0, "text": "x" * 70_000}),
    ("rerror", {"rank": 0, "t": 1.0, "text": ["a", "b"]}),
    ("exit", {"code": "0"}),
    ("exit", {"code": 0, "error": "e" * 100_000}),
    ("error", {"problem": {"a": 1}}),
    ("hb", {"t": 1.0, "idle": {"99999999999": 1.0}}),
    ("hb", {"t": 1.0, "idle": [1, 2]}),
    ("started", {"pid": -5}),
    ("hello", {"v": 1, "pid": 3, "time": "now"}),
]


@pytest.mark.parametrize("kind, body", BAD, ids=[f"{k}-{i}" for i, (k, _) in enumerate(BAD)])
def test_an_out_of_bounds_frame_is_that_nodes_failure(kind: str, body: dict) -> None:
    line = f"{kind} {json.dumps(body)}"
    event = ev.decode("a", line)
    assert isinstance(event, ev.Malformed) and event.kind == kind, event
    sup = make()
    start(sup)
    sup.on_event(event, 2.0)
    failure = sup.failures[0]
    assert failure.host == "a" and failure.kind is FailureKind.GUARD
    assert f"node a sent a malformed {kind} frame" in failure.message
    assert sup.phase is Phase.STOPPING


def test_a_line_of_no_known_kind_stays_a_node_line() -> None:
    event = ev.decode("a", "zz {}")
    assert isinstance(event, ev.Malformed) and event.kind == ""
    sup = make()
    start(sup)
    sup.on_event(event, 2.0)
    assert not sup.failures


def test_well_formed_frames_still_decode() -> None:
    assert ev.decode("a", 'rstart {"rank":3,"pid":9,"t":1}') == ev.RankStart("a", 3, 9, 1.0)
    assert ev.decode("a", 'rexit {"rank":3,"code":-9,"t":2.5}') == \
        ev.RankExit("a", 3, -9, 2.5, None)
    assert ev.decode("a", "o 3 hello") == ev.RankOutput("a", 3, "out", "hello")
