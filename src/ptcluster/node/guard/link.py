"""The guard's link to the head: what it reads from the head (``go``, ``stacks``, ``stop``, EOF)
and what it sends on its own schedule (heartbeats, ``timing``, ``stacks``), and the stop state
the head, a signal or a lost link sets.

Standard library only; a part of the guard (shipped by ``remote.bootstrap``). The heartbeat runs
on its own thread and never waits on output (STYLE 13): how fast the head reads decides nothing;
nor on the guard's own looks at the machine (``watch``, another thread).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from ptcluster.node.guard.machine import MachineWatch
from ptcluster.node.guard.outbox import Outbox
from ptcluster.node.guard.progress import ProgressMeter, fit_stacks
from ptcluster.node.guard.rank_server import RankServer
from ptcluster.node.guard.schedstat import SchedstatMeter
from ptcluster.node.rank_wire import FR_VAR, TIMING_OFF_VAR
from ptcluster.node.wire import (
    HEARTBEAT_EVERY,
    HEARTBEAT_TIMEOUT,
    MAX_FRAME,
    Beat,
    GuardConfig,
    Kind,
    encode,
    split,
    timing_every,
)


class StopRequest:
    """Why the guard stops, set once by whoever asks first: the head (``stop``), a lost link (EOF,
    no heartbeat), a signal. Signal-safe: ``request`` sets state only."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reason = ""
        self.by_head = False
        self.time = 0.0
        self.signal = ""
        """The name of the signal that stopped the guard, when one did."""
        self.final = False
        """The head's stop says that no attempt follows (the user's stop: ``final``)."""
        self.wake_fd, self._wake_w = os.pipe()
        """Readable once a stop is asked (for a ``select`` that waits on a process too)."""
        os.set_blocking(self._wake_w, False)

    def request(self, reason: str, by_head: bool = False, signum: int = 0) -> None:
        if not self.event.is_set():
            self.reason, self.by_head, self.time = reason, by_head, time.time()
            self.signal = signal.Signals(signum).name if signum else ""
            self.event.set()
            try:
                os.write(self._wake_w, b"x")
            except OSError:  # (full: a wake-up is there already)
                pass

    def is_set(self) -> bool:
        return self.event.is_set()

    def wait(self, timeout: float) -> bool:
        return self.event.wait(timeout)


class HeadLink:
    """The channel to the head: frames out (through the outbox), frames in, heartbeats."""

    def __init__(self, cfg: GuardConfig, stop: StopRequest) -> None:
        self.cfg = cfg
        self.stop = stop
        self.out = Outbox(self.emit, float(cfg.get("output_hold", 0.0)))
        self.go = threading.Event()
        self.master_port: int | None = None
        """The rendezvous port the master's guard chose (``master.port: auto``), told with
        ``go``."""
        self.warm = False
        """The head's ``go`` says every node's ranks come from a warm pool (its ``warm``)."""
        self.last_hb = time.monotonic()
        self.ranks: RankServer | None = None
        """The rank server once torchrun starts: what heartbeats, ``timing`` and ``stacks``
        report on."""
        self.meter: ProgressMeter | None = None
        self.machine: MachineWatch | None = None
        """What the machine saw (OOM kills, the GPU driver's Xids): it collects the ranks' trees
        and reads the kernel's log on every beat."""
        self.schedstat: SchedstatMeter | None = None

    # -- out ----------------------------------------------------------------------------------
    def emit(self, data: bytes) -> None:
        """Into the channel (the outbox's writer: called by one thread at a time)."""
        try:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
        except (OSError, ValueError):
            self.stop.request("the head's channel is closed")

    def write(self, data: bytes) -> None:
        """A control frame: at once (with the output held before it, ``guard.outbox``)."""
        self.out.now(data)

    def send(self, kind: str, payload: object = None) -> None:
        self.write(encode(kind, payload))

    # -- in -----------------------------------------------------------------------------------
    def read_head(self) -> None:
        """The head's frames until EOF (the head gone, or the link lost: the guard stops)."""
        while True:
            try:
                line = sys.stdin.buffer.readline()
            except (OSError, ValueError):
                line = b""
            if not line:
                self.stop.request("the head's channel closed (head gone or link lost)")
                return
            self.last_hb = time.monotonic()
            kind, payload = split(line.decode(errors="replace").rstrip("\n"))
            if kind == Kind.GO:
                try:
                    told = json.loads(payload) if payload else {}
                except ValueError:
                    told = {}
                if isinstance(told, dict) and told.get("master_port"):
                    self.master_port = int(told["master_port"])
                self.warm = isinstance(told, dict) and told.get("warm") is True
                self.go.set()
            elif kind == Kind.STACKS:
                threading.Thread(target=self.send_stacks, args=(payload,), daemon=True).start()
            elif kind == Kind.STOP:
                try:
                    told = json.loads(payload)
                    reason, final = told.get("reason") or "", told.get("final") is True
                except (ValueError, AttributeError):
                    reason, final = "", False
                self.stop.final = self.stop.final or final
                self.stop.request(f"stopped by the head{': ' + reason if reason else ''}",
                                  by_head=True)

    # -- on its own schedule ------------------------------------------------------------------
    def heartbeat(self, finished: threading.Event) -> None:
        """Every ``heartbeat_every`` s until ``finished`` (also during the teardown: the guard is
        still here), on a fixed schedule: a beat with each rank's idle seconds and nothing else.
        The beats are what the head counts as this node's life (``RunOptions.node_silence``),
        so no work of the guard's own may make one late: the ranks' trees, the kernel's log (a
        ``journalctl`` may take seconds) and ``timing`` are ``watch``'s, on a thread of their
        own. Stops the job when the head has been silent ``heartbeat_timeout`` s."""
        timeout = float(self.cfg.get("heartbeat_timeout", HEARTBEAT_TIMEOUT))
        every = float(self.cfg.get("heartbeat_every", HEARTBEAT_EVERY))
        due = time.monotonic() + every
        while not finished.wait(max(0.0, due - time.monotonic())):
            # (the next beat one interval after this one was due, not after its work; a beat
            # more than an interval late starts the schedule anew rather than a burst)
            due += every
            if due <= time.monotonic():
                due = time.monotonic() + every
            beat: Beat = {"t": time.time()}
            if self.meter is not None and not self.stop.is_set():
                try:
                    beat["idle"] = self.meter.sample()
                except Exception:  # noqa: BLE001 - progress is advice; the heartbeat is not
                    pass
            self.send(Kind.HB, beat)
            if not self.stop.is_set() and time.monotonic() - self.last_hb > timeout:
                self.stop.request(f"no heartbeat from the head for {timeout:.0f} s")

    def watch(self, finished: threading.Event) -> None:
        """Every ``heartbeat_every`` s while ranks run, until ``finished``: the ranks' trees and
        the kernel's log (``machine``: OOM kills, Xids, sent at once), and every
        ``timing_every`` s the ``timing`` frame. Advice: however long a look takes, it delays
        the next look, never a heartbeat."""
        every = float(self.cfg.get("heartbeat_every", HEARTBEAT_EVERY))
        next_timing = time.monotonic() + timing_every(every)
        while not finished.wait(every):
            if self.stop.is_set():
                continue
            if self.machine is not None and self.ranks is not None:
                try:
                    self.machine.scan(dict(self.ranks.probes.pids))
                    for xid in self.machine.new_xids():
                        self.send(Kind.XID, xid)
                except Exception:  # noqa: BLE001 - advice only
                    pass
            if time.monotonic() >= next_timing and \
                    self.cfg["env"].get(TIMING_OFF_VAR) != "0":
                next_timing = time.monotonic() + timing_every(every)
                self.send_timing()

    def send_timing(self) -> None:
        """Each running rank's main-thread figures since the last frame and the node's, for the
        head's straggler report (``guard.schedstat``: /proc only, nothing inside the ranks)."""
        if self.ranks is None:
            return
        try:
            if self.schedstat is None:
                self.schedstat = SchedstatMeter()
            probes = self.ranks.probes
            pids = dict(probes.pids)
            counts = dict(probes.fr_counts)
            ready = dict(probes.ready)
            completed: dict[int, float] = {}
            for rank in pids:
                got = counts.get(rank)
                if isinstance(got, dict) and "completed" in got:
                    completed[rank] = float(got["completed"])
                elif ready[rank][2] if rank in ready else self.recorder_on():
                    completed[rank] = 0.0  # its recorder is on and it completed none yet
            ranks = self.schedstat.sample(pids, completed, time.monotonic())
            if ranks:
                self.send(Kind.TIMING, {"t": time.time(), "ranks": ranks,
                                        "node": self.schedstat.node()})
        except Exception:  # noqa: BLE001 - advice only: never the guard's end
            return

    def last_look(self) -> None:
        """The kernel's log once more when every rank has ended, before the guard's ``exit``:
        an Xid the driver wrote in the ranks' last moments is said (the watch looks once a
        heartbeat, and a rank that exits 0 carries none)."""
        if self.machine is None:
            return
        try:
            self.machine.look()
            for xid in self.machine.new_xids():
                self.send(Kind.XID, xid)
        except Exception:  # noqa: BLE001 - advice only: never the guard's end
            return

    def recorder_on(self) -> bool:
        """Whether the ranks' flight recorder is on (``TORCH_FR_BUFFER_SIZE`` in their env)."""
        try:
            return int(self.cfg["env"].get(FR_VAR) or 0) > 0
        except ValueError:
            return False

    def send_stacks(self, payload: str) -> None:
        """Every rank's stacks for the head (``guard.progress``); the job is not disturbed."""
        try:
            ask = json.loads(payload) if payload else {}
        except ValueError:
            ask = {}
        if not isinstance(ask, dict):
            ask = {}
        native = bool(ask.get("native"))
        ranks = self.ranks.probes.collect(native) if self.ranks is not None else {}
        ranks = fit_stacks(ranks, MAX_FRAME - 4096)  # (room for the frame's other fields)
        self.send(Kind.STACKS, {"id": ask.get("id"), "ranks": ranks, "t": time.time()})
