"""One node channel: start a node program over a transport and talk to it in frames.

The one copy of the session plumbing that ``run``, ``doctor``, ``monitor``, ``setup`` and
``kill`` use, in the shape of pyinfra's connectors: start the program, frames both ways,
heartbeats, a close reason that keeps ssh's own last words.

Every channel of the process is served by one I/O thread (``remote.hub``: a selector over every
channel's pipes, and one timer for every heartbeat), so a head with 1024 nodes has the threads
of a head with one. Nothing in it waits on anyone: writes are non-blocking (``send`` queues),
reads hand frames to ``on_frames`` (which must not block), and a consumer that falls behind
says so through ``backlog()``: the hub then stops reading that channel's frames (the node's
writes wait in the pipe: backpressure) while writes, heartbeats and other channels go on.
When both streams reach EOF the process is reaped (without blocking the hub) and
``on_closed(exit_code, stderr_tail)`` is called exactly once, on the hub's thread.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping

from ptcluster.errors import Problem
from ptcluster.node import Program
from ptcluster.node.wire import encode
from ptcluster.remote.bootstrap import node_argv, preamble
from ptcluster.remote.hub import Hub, hub
from ptcluster.remote.transport import Transport, explain_start_failure

log = logging.getLogger(__name__)
STDERR_TAIL = 40
PENDING_MAX = 64 << 10
"""Bytes the hub takes from a channel's queue per write at most: a pipe's default capacity
(it writes again while the pipe takes all; at 256 KiB, a 64 KiB pipe had each byte of a file
copied four times)."""


class NodeChannel:
    """A node program started over ``transport``; frames in, frames out.

    ``on_frames(lines)`` gets the program's stdout as decoded lines (without newlines), in
    order, in batches; ``on_stderr(line)`` each stderr line; ``on_closed(code, stderr)`` once.
    Callbacks run on the hub's thread: they must be quick and never block (hand off; say
    ``backlog()`` is True to be given nothing more for a while).
    """

    def __init__(self, transport: Transport, python: str, program: Program,
                 config: Mapping[str, object], *, on_frames: Callable[[list[str]], None],
                 on_closed: Callable[[int | None, list[str]], None],
                 on_stderr: Callable[[str], None] | None = None,
                 heartbeat: float | None = None, tag: str = "-",
                 backlog: Callable[[], bool] | None = None) -> None:
        self.host = transport.host
        self.transport = transport
        self.argv = node_argv(python, program, tag)
        self.first = preamble(program, config)
        self.on_frames = on_frames
        self.on_closed = on_closed
        self.on_stderr = on_stderr or (lambda line: None)
        self.heartbeat = heartbeat
        self.backlog = backlog
        self.proc: subprocess.Popen[bytes] | None = None
        self.stderr: deque[str] = deque(maxlen=STDERR_TAIL)
        self.last_recv = time.monotonic()
        """Monotonic time data last came from the node (stdout or stderr)."""
        self.reason: str | None = None
        """Why the head closed the channel itself (``hub.TOO_LONG``): the last line of the
        stderr ``on_closed`` gets, after the node's own last words."""
        self._closed = threading.Event()
        self._lock = threading.Lock()  # the outgoing buffer: send() may come from any thread
        self._out = bytearray()
        self._raw_owed = 0
        """Raw bytes a frame announced that are not queued yet: no heartbeat may come between."""
        self._eof_asked = False
        self._hub: Hub | None = None
        self._window: Fanout | None = None
        """The window this channel was started in, until it said its first word or closed."""

    # -- life ---------------------------------------------------------------------------------
    def start(self, window: Fanout | None = None) -> None:
        """Spawn the program (raises ``OSError`` when the transport cannot be started); in
        ``window``, whose slot it holds until it says its first word or ends."""
        self._window = window
        try:
            self.proc = self.transport.spawn(self.argv)
        except OSError:
            self._window = None
            raise
        self.last_recv = time.monotonic()
        with self._lock:  # (first: frames may have been queued while it waited its turn)
            self._out[:0] = self.first
        self._hub = hub()
        self._hub.add(self)

    def send(self, kind: str, payload: Mapping[str, object] | None = None, *, raw: int = 0) -> None:
        """Queue a frame for the node (never blocks); ``raw``: the bytes it announces, which
        :meth:`send_raw` queues next (no heartbeat is queued until they all are)."""
        with self._lock:
            self._raw_owed += raw
        self._queue(encode(kind, payload))

    def send_raw(self, data: bytes) -> None:
        """Queue raw bytes for the node (never blocks): what a frame announced (a wheel after
        its ``blob`` frame). Queue in pieces and watch ``queued``: what is queued stays in the
        head's memory until the pipe takes it (the hub copies at most :data:`PENDING_MAX` of it
        per write)."""
        with self._lock:
            self._raw_owed = max(0, self._raw_owed - len(data))
        self._queue(data)

    @property
    def queued(self) -> int:
        """Bytes queued for the node, not yet written to its pipe."""
        with self._lock:
            return len(self._out)

    def close_input(self) -> None:
        """EOF to the node program (it ends its work and exits), after what is queued; a
        channel still waiting for its turn (``start_all``'s window) is then never started:
        it is closed when its turn comes."""
        with self._lock:
            if self._eof_asked:
                return
            self._eof_asked = True
        if self._hub is not None:
            self._hub.wake_writer(self)

    def signal(self, sig: int) -> None:
        """Signal the transport process's group (ssh, or the local program)."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def closing(self) -> bool:
        """``close_input`` was called: nothing more is queued, the input ends."""
        return self._eof_asked

    @property
    def held(self) -> bool:
        """True while the consumer's backlog holds this channel's frames back (the node is not
        silent: we are slow)."""
        hub = self._hub
        return hub is not None and hub.holds(self)

    def close(self, deadline: float) -> None:
        """EOF, then wait until ``deadline`` (monotonic) and kill what is still running."""
        self.close_input()
        if not self._closed.wait(max(0.0, deadline - time.monotonic())):
            self.signal(signal.SIGKILL)
            self._closed.wait(5.0)

    # -- the hub's side (its thread) and the fan-out window's ----------------------------------
    def pending(self) -> tuple[bytes, bool]:
        """The first :data:`PENDING_MAX` bytes queued for the node, and whether its input is to
        end after them (the hub asks again while more is queued: a large queue, a wheel on its
        way, is not copied whole for every 64 KiB the pipe takes)."""
        with self._lock, memoryview(self._out) as queued:  # (one copy, not a slice's two)
            return bytes(queued[:PENDING_MAX]), self._eof_asked and \
                len(self._out) <= PENDING_MAX

    def written(self, count: int) -> bool:
        """The first ``count`` bytes queued are written (or lost with the pipe); True while
        more is queued."""
        with self._lock:
            del self._out[:count]
            return bool(self._out)

    def push(self, data: bytes, *, closing_too: bool = False) -> bool:
        """Queue ``data`` from the hub's own thread (a heartbeat: it writes itself), unless the
        input is to end (``closing_too``: even then) or raw bytes are owed (the heartbeat would
        land inside them: it is skipped); True when nothing was queued before it (a write is
        due now, else one is pending already)."""
        with self._lock:
            if (self._eof_asked and not closing_too) or self._raw_owed:
                return False
            was_empty = not self._out
            self._out += data
        return was_empty

    def heard(self, now: float) -> None:
        """Data came from the node at ``now``: connected, so its window's slot is free (the
        next node's handshake may start)."""
        self.last_recv = now
        window = self._window
        if window is not None:
            window.done(self)

    def got_stderr(self, line: str) -> None:
        """A line of the program's stderr (kept in the tail, handed to ``on_stderr``)."""
        self.stderr.append(line)
        self.on_stderr(line)

    def left(self, window: Fanout) -> None:
        """``window`` no longer holds a slot for this channel."""
        if self._window is window:
            self._window = None

    def ended(self, code: int | None, stderr: list[str] | None = None, *,
              tell: bool = True) -> None:
        """The channel is over (its process reaped, or never started): closed, its window's
        slot free, ``on_closed(code, stderr or the tail)`` unless not ``tell``."""
        self._closed.set()
        window = self._window
        if window is not None:
            window.done(self)
        if not tell:
            return
        said = list(self.stderr) if stderr is None else stderr
        try:
            self.on_closed(code, said + [self.reason] if self.reason else said)
        except Exception:  # noqa: BLE001
            log.exception("%s: on_closed failed", self.host)

    def _queue(self, data: bytes) -> None:
        if self._closed.is_set():
            return
        with self._lock:
            if self._eof_asked:
                return
            was_empty = not self._out
            self._out += data
        if was_empty and self._hub is not None:
            self._hub.wake_writer(self)


FANOUT = 64
"""Connections being set up at once (started, not yet heard from): the rest wait their turn,
each started as one of those says its first word or ends. pdsh's default is 32, DeepSpeed's
launcher 1024; a bastion's sshd drops unauthenticated connections beyond its MaxStartups
(10:30:100 by default), so a window there is what keeps a launch of hundreds of nodes whole."""


class Fanout:
    """At most ``window`` channels in their handshake at once; the others start in order as
    those are heard from. Lives on the hub's thread once started."""

    def __init__(self, channels: list[NodeChannel], window: int,
                 on_error: Callable[[NodeChannel, Problem], None]) -> None:
        self.waiting = deque(channels)
        self.window = max(1, window)
        self.on_error = on_error
        self.in_flight: set[NodeChannel] = set()
        self._lock = threading.Lock()  # the caller starts the first window, the hub the rest

    def fill(self) -> list[NodeChannel]:
        """Start channels until the window is full; those that could not be started go to
        ``on_error`` (and count as closed)."""
        with self._lock:
            return self._fill()

    def _fill(self) -> list[NodeChannel]:
        started = []
        while self.waiting and len(self.in_flight) < self.window:
            channel = self.waiting.popleft()
            if channel.closing:  # closed before its turn (the job ended): never started
                channel.ended(None, ["not started: closed before its turn came"])
                continue
            try:
                self.in_flight.add(channel)
                channel.start(window=self)
            except OSError as exc:
                self.in_flight.discard(channel)
                channel.ended(None, tell=False)  # (on_error says why)
                # (the local program that failed: ssh or srun, or the interpreter locally)
                program = channel.transport.argv(channel.argv)[0]
                self.on_error(channel, explain_start_failure(program, exc))
                continue
            started.append(channel)
        return started

    def done(self, channel: NodeChannel) -> None:
        """``channel`` was heard from or ended: its slot goes to the next one waiting."""
        with self._lock:
            channel.left(self)
            self.in_flight.discard(channel)
            self._fill()


def start_all(channels: list[NodeChannel], on_error: Callable[[NodeChannel, Problem], None],
              window: int | None = None) -> list[NodeChannel]:
    """Start every channel, at most ``window`` (default :data:`FANOUT`) in their handshake at
    once (the rest as those are heard from, on the hub's thread); the ones that could not start
    go to ``on_error(channel, problem)`` (maybe later, from the hub's thread) and are
    closed. Returns every channel but those that failed at once; never raises."""
    fanout = Fanout(channels, window or FANOUT, on_error)
    with fanout._lock:  # the first window here; the rest from the hub as the first are heard
        failed = set(channels) - set(fanout._fill()) - set(fanout.waiting)
    return [c for c in channels if c not in failed]


def close_all(channels: list[NodeChannel], timeout: float) -> None:
    """EOF to every channel, then one shared deadline for all of them (not one each)."""
    deadline = time.monotonic() + timeout
    for channel in channels:
        channel.close_input()
    for channel in channels:
        channel.close(deadline)
