"""A stand-in for a node's guard that speaks the head<->guard protocol and nothing else, for
what only shows with hundreds of nodes (the head's threads, descriptors, CPU per event).

It is built on the shipped wire module (``ptcluster.node.wire``, loaded from its file, so the
two cannot drift) and runs one process per "node" through :class:`FakeTransport` with the real
runner and supervisor: hello, ready, ``go`` -> ``started``, a start record per rank, ``RATE``
output lines per second per rank (each rank at its own phase, through the guard's shipped
``node.guard.outbox`` with the config's ``output_hold``, as a guard writes them), heartbeats and
``timing`` frames as often as the config says (every rank equally busy, one collective each),
each node at its own phase, then every rank's exit and the guard's ``exit``;
``stop`` (or EOF) ends it early, as a guard's teardown would.

    python tests/support/fakenode.py HOST

(stdin: the channel's preamble: program line, config line)

Knobs, from the environment (the head's, inherited): ``FAKE_RATE`` lines/s per rank (0),
``FAKE_SECONDS`` the job's length (5), ``FAKE_HOLD`` seconds to hold output instead of the
config's ``output_hold`` (0: a write per line, as guards wrote before ``node.guard.outbox``),
``FAKE_FAIL`` ``HOST:SECONDS`` (that node's rank fails with exit 1 after SECONDS),
``FAKE_READY`` ``HOST:FILE`` (that node's ``ready`` facts are the JSON in FILE: a hostile
guard), ``FAKE_EVENTS`` a file each node appends ``HOST KIND TIME`` to (its failure, the stop it was
told) for timing a teardown across nodes; ``FAKE_SCHED=idle`` starts each fake node in the
head's session (its own process group) under ``SCHED_IDLE``, so it gets a CPU only when the
head does not want one. Real nodes are other machines. Here, each fake in its
own session is its own autogroup (``kernel.sched_autogroup_enabled``), weighted like the
head's, whatever its policy.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import selectors
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ptcluster.node


def _shipped(name: str) -> Any:
    """A shipped node module (``guard/outbox`` under ``node/``), loaded from its file (as the
    packer ships it: no package)."""
    spec = importlib.util.spec_from_file_location(
        name.rpartition("/")[2], Path(ptcluster.node.__file__).parent / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


wire = _shipped("wire")
outbox = _shipped("guard/outbox")


class FakeNode:
    def __init__(self, host: str, cfg: dict[str, Any]) -> None:
        self.host = host
        self.cfg = cfg
        first, last = cfg["ranks"]
        self.ranks = list(range(first, last + 1))
        self.rate = float(os.environ.get("FAKE_RATE", "0"))
        self.seconds = float(os.environ.get("FAKE_SECONDS", "5"))
        fail_host, _, fail_at = os.environ.get("FAKE_FAIL", "").partition(":")
        self.fail_at = float(fail_at) if fail_host == host else None
        self.events = os.environ.get("FAKE_EVENTS")
        self.out = sys.stdout.buffer
        hold = os.environ.get("FAKE_HOLD", cfg.get("output_hold", 0.0))
        self.box = outbox.Outbox(self.emit, float(hold))
        self.sent = {r: 0 for r in self.ranks}
        self.every = wire.TIMING_EVERY  # (seconds between two timing frames: set by run)

    def note(self, kind: str) -> None:
        if self.events:
            with open(self.events, "a") as f:
                f.write(f"{self.host} {kind} {time.time():.6f}\n")

    def emit(self, data: bytes) -> None:
        self.out.write(data)
        self.out.flush()

    def send(self, data: bytes) -> None:
        self.box.now(data)

    def run(self, stdin: int, buf: bytes) -> int:
        self.send(wire.hello("guard"))
        self.send(wire.encode("ready", self.ready()))
        sel = selectors.DefaultSelector()
        sel.register(stdin, selectors.EVENT_READ)
        went, stop = None, ""
        beat = float(self.cfg.get("heartbeat_every", 1.0))
        every = self.every = wire.timing_every(beat)
        next_hb = time.monotonic() + beat
        next_timing = None
        next_line: dict[int, float] = {}  # per rank: when it prints its next line
        while True:
            now = time.monotonic()
            waits = [next_hb - now]
            if next_timing is not None:
                waits.append(next_timing - now)
            held = self.box.due()  # (seconds from now)
            if held is not None:
                waits.append(held)
            elif next_line:  # the next line: written when its hold is up
                waits.append(min(next_line.values()) + self.box.hold - now)
            if went is not None:
                waits.append(went + (self.fail_at if self.fail_at is not None
                                     else self.seconds) - now)
            for _key, _ in sel.select(max(0.0, min(waits))):
                chunk = os.read(stdin, 65536)
                if not chunk:
                    sel.unregister(stdin)
                    stop = stop or "the head's channel closed"
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    kind, payload = wire.split(line.decode())
                    if kind == "go" and went is None:
                        went = time.monotonic()
                        self.go()
                        # Each node at its own phase, as independent nodes are (the same
                        # phase everywhere made every node's lines one burst a second), and
                        # each rank too: a guard reads a rank's lines as they come
                        phases = random.Random(self.host)
                        next_timing = went + every * (0.5 + phases.random())
                        if self.rate:
                            next_line = {r: went + phases.random() / self.rate
                                         for r in self.ranks}
                    elif kind == "stop":
                        self.note("stop")
                        stop = "stopped by the head"
            now = time.monotonic()
            for r, due in next_line.items():
                # Every line due by now, held from when its rank printed it (so a node wakes
                # when a write is due, not for every line: the head sees what a guard sends)
                while due <= now:
                    self.sent[r] += 1
                    self.box.later(wire.encode_text("o", r, f"line {self.sent[r]}".encode()),
                                   came=due)
                    due += 1.0 / self.rate
                next_line[r] = due
            if stop:
                return self.end(-15, stop)
            if went is not None and self.fail_at is not None and now - went >= self.fail_at:
                self.note("fail")
                return self.end(1, "job ended")
            if went is not None and now - went >= self.seconds:
                return self.end(0, "job ended")
            if now >= next_hb:
                idle = {str(r): 0.0 for r in self.ranks} if went is not None else None
                self.send(wire.encode("hb", {"t": time.time(), "idle": idle}))
                next_hb += beat
            if next_timing is not None and now >= next_timing:
                self.send(self.timing())
                next_timing += every
            self.box.flush_due()

    def ready(self) -> Any:
        """A guard's ready facts (``guard.prechecks.precheck``'s keys), or ``FAKE_READY``'s."""
        host, _, path = os.environ.get("FAKE_READY", "").partition(":")
        if host == self.host:
            return json.loads(Path(path).read_text())
        return {"hostname": self.host, "pid": os.getpid(), "python": sys.executable,
                "time": time.time(), "workdir": os.getcwd(), "subreaper": True}

    def go(self) -> None:
        self.send(wire.encode("started", {"pid": os.getpid()}))
        for r in self.ranks:
            self.send(wire.encode(wire.Kind.RSTART,
                                  {"rank": r, "pid": os.getpid(), "t": time.time()}))

    def timing(self) -> bytes:
        """What a guard's ``node.guard.schedstat`` reports for ranks that all keep up: half of
        the time running, a little waiting for a CPU, one collective completed."""
        span = self.every
        figures = {"span": span, "run": span / 2, "delay": span / 100, "collectives": 1}
        return wire.encode(wire.Kind.TIMING, {"t": time.time(), "node": {"mem_available": 0.5},
                                         "ranks": {str(r): figures for r in self.ranks}})

    def end(self, code: int, reason: str) -> int:
        for r in self.ranks:
            self.send(wire.encode(wire.Kind.REXIT, {"rank": r, "code": code, "t": time.time(),
                                               "duration": 1.0, "lines": self.sent[r]}))
        self.send(wire.encode("exit", {"code": code, "reason": reason, "t": time.time()}))
        self.note(f"sent {sum(self.sent.values())}")
        return 0


def fake_job(nodes: int, slots: int = 8, job_id: str = "fake") -> tuple[Any, dict[str, Any]]:
    """For the head's side: the plan of a job on ``nodes`` fake nodes of ``slots`` ranks, and
    a transport per node that starts this program instead of a guard (through the real
    channel: the preamble is sent and read as a guard's would be)."""
    from dataclasses import dataclass

    from ptcluster.cluster.load import parse_cluster_text
    from ptcluster.launch.plan import Target, plan_launch
    from ptcluster.remote.transport import Transport

    @dataclass
    class FakeTransport(Transport):
        host: str

        def argv(self, node_argv: list[str]) -> list[str]:
            return [sys.executable, __file__, self.host]

        def spawn(self, node_argv: list[str]) -> subprocess.Popen[bytes]:
            if os.environ.get("FAKE_SCHED") != "idle":
                return super().spawn(node_argv)
            return subprocess.Popen(self.argv(node_argv), stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    process_group=0)

    text = "master: {port: 29500}\nnodes:\n" + "".join(
        f"  - {{host: f{i}, slots: {slots}}}\n" for i in range(nodes))
    spec = parse_cluster_text(text, "<fake nodes>")
    plan = plan_launch(spec, Target(script="fake.py"), port=29500, job_id=job_id)
    return plan, {n.host: FakeTransport(n.host) for n in spec.nodes}


def main() -> int:
    if os.environ.get("FAKE_SCHED") == "idle":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    buf = b""
    while buf.count(b"\n") < 2:  # the packed guard (not ours to run), then the config
        chunk = os.read(0, 65536)
        if not chunk:
            return 2
        buf += chunk
    _program, config, rest = buf.split(b"\n", 2)
    return FakeNode(sys.argv[1], json.loads(config)).run(0, rest)


if __name__ == "__main__":
    sys.exit(main())
