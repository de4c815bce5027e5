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
READY = {"hostname": "a", "pid": 7, "python": "/usr/bin/python3", "time": 1.0, "workdir": "/w",
         "subreaper": True, "interface": "eth0", "interface_source": "route to the master",
         "address": "10.0.0.2", "master_port": 29500, "torch": "2.13.0+cpu",
         "rdma": {"NCCL_IB_HCA": "mlx5_0:1", "NCCL_IB_GID_INDEX": "3"},
         "gpus": {"indices": [0, 1], "visible": "0,1", "why": "auto: the first 2 free"}}
OOM = {"node_kills": 1, "group_kills": 1, "log": "/dev/kmsg", "group": "/sys/fs/cgroup/x",
       "victims": [{"pid": 9, "comm": "pt_main_thread", "rss": 1 << 30, "main": True,
                    "constraint": "CONSTRAINT_MEMCG", "memcg": "/x"}]}
XID = {"pci": "0000:3b:00", "gpu": 0, "xid": 79, "pid": 0, "name": "", "rank": None,
       "text": "GPU has fallen off the bus.", "meaning": "the GPU fell off the bus",
       "action": "reboot", "fix": "reboot the node", "fatal": True, "at": 5.0,
       "clock": "12:00:05", "jobs_gpu": True}
DISK = {"path": "/ck/c.pt", "mount": "/ck", "fstype": "ext4", "source": "/dev/sda1", "free": 0,
        "total": 9}


def _with(base: dict, **changed: object) -> dict:
    return {**base, **changed}


HOSTILE = [  # a guard's tables: what the head would act on, show or record (issue 43 item 1)
    ("ready", _with(READY, address="10.0.0.2\nPrologSlurmctld=/tmp/x")),
    ("ready", _with(READY, address="10.0.0.2 -c evil")),
    ("ready", _with(READY, address=["10.0.0.2"])),
    ("ready", _with(READY, hostname="a\nb")),
    ("ready", _with(READY, interface="../../etc")),
    ("ready", _with(READY, interface="e" * 16)),
    ("ready", _with(READY, master_port=70000)),
    ("ready", _with(READY, pid=0)),
    ("ready", _with(READY, time=float("inf"))),
    ("ready", _with(READY, gpus={"indices": [-1], "visible": "0", "why": ""})),
    ("ready", _with(READY, gpus={"indices": [0], "visible": "0\nX=1", "why": ""})),
    ("ready", _with(READY, rdma={"NCCL_IB_GID_INDEX": "3; rm"})),
    ("ready", _with(READY, rdma={"LD_PRELOAD": "/tmp/x.so"})),
    ("ready", _with(READY, torchrun_pid=1)),  # (the head's own, from `started`)
    ("ready", _with(READY, torch="2" * 1000)),
    ("ready", _with(READY, python=None)),
    ("ready", ["not", "a", "table"]),
    ("rexit", {"rank": 0, "code": -9, "t": 1.0, "oom": _with(OOM, victims="all")}),
    ("rexit", {"rank": 0, "code": -9, "t": 1.0, "oom": _with(OOM, node_kills=1e300)}),
    ("rexit", {"rank": 0, "code": -9, "t": 1.0, "oom": _with(OOM, extra=1)}),
    ("rexit", {"rank": 0, "code": -9, "t": 1.0,
               "oom": _with(OOM, victims=[{"pid": -1, "comm": "x"}])}),
    ("rexit", {"rank": 0, "code": 1, "t": 1.0, "xids": [_with(XID, action="rm -rf /")]}),
    ("rexit", {"rank": 0, "code": 1, "t": 1.0, "xids": [XID] * 5000}),
    ("xid", _with(XID, at=float("nan"))),
    ("xid", _with(XID, fatal="yes")),
    ("xid", _with(XID, text="x" * 100_000)),
    ("xid", {"pci": "0000:3b:00"}),
    ("rerror", {"rank": 0, "t": 1.0, "text": "OSError", "disk": _with(DISK, free=-1)}),
    ("rerror", {"rank": 0, "t": 1.0, "text": "OSError", "disk": {"full": "everything"}}),
    ("timing", {"t": 1.0, "ranks": {"0": {"span": "x", "run": 1, "delay": 0}}, "node": {}}),
    ("timing", {"t": 1.0, "ranks": {}, "node": {"cpu_throttled": float("nan")}}),
    ("timing", {"t": 1.0, "ranks": {str(r): {"span": 1, "run": 1, "delay": 0}
                                    for r in range(70_000)}, "node": {}}),
]
BAD += HOSTILE


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
    assert failure.code == "run.malformed-frame"
    assert (failure.problem.fields["host"], failure.problem.fields["kind"]) == ("a", kind)
    assert sup.phase is Phase.STOPPING


def test_a_line_of_no_known_kind_stays_a_node_line() -> None:
    event = ev.decode("a", "zz {}")
    assert isinstance(event, ev.Malformed) and event.kind == ""
    sup = make()
    start(sup)
    sup.on_event(event, 2.0)
    assert not sup.failures


def frame(kind: str, body: object) -> str:
    return f"{kind} {json.dumps(body)}"


def test_a_guards_well_formed_tables_pass_whole() -> None:
    """What the guard sends passes as it was sent (the schema names every key of it)."""
    assert ev.decode("a", frame("ready", READY)) == ev.Ready("a", READY)
    gone = ev.decode("a", frame("rexit", {"rank": 0, "code": -9, "t": 1.0, "oom": OOM,
                                          "xids": [XID]}))
    assert gone == ev.RankExit("a", 0, -9, 1.0, None, OOM, (XID,))
    assert ev.decode("a", frame("xid", XID)) == ev.GpuError("a", XID)
    full = ev.decode("a", frame("rerror", {"rank": 0, "t": 1.0, "text": "x",
                                           "disk": {"full": [DISK]}}))
    assert isinstance(full, ev.RankError) and full.disk == {"full": [DISK]}


def test_a_hostile_ready_address_never_becomes_the_next_master() -> None:
    """The one ready fact the head acts on across attempts (the next rendezvous address after
    a restart): a ready frame that carries a forged one is refused whole."""
    event = ev.decode("a", frame("ready", _with(READY, address="10.0.0.2\nX")))
    assert isinstance(event, ev.Malformed) and "ready.address" in event.error


def test_well_formed_frames_still_decode() -> None:
    assert ev.decode("a", 'rstart {"rank":3,"pid":9,"t":1}') == ev.RankStart("a", 3, 9, 1.0)
    assert ev.decode("a", 'rexit {"rank":3,"code":-9,"t":2.5}') == \
        ev.RankExit("a", 3, -9, 2.5, None)
    assert ev.decode("a", "o 3 hello") == ev.RankOutput("a", 3, "out", "hello")
