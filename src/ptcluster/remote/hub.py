"""The one I/O thread of a process's node channels (``remote.channel``): a selector over their
pipes, one timer heap for every heartbeat and deadline, backpressure from a consumer's
``backlog()``, each stream's EOF, ssh's last words, and the reaping of the process.

Nothing in it waits on anyone: writes are non-blocking, reads hand frames to the channel's
``on_frames`` (which must not block); a consumer that falls behind says so through ``backlog()``
and the hub stops reading that channel's frames (the node's writes wait in the pipe) while
writes, heartbeats and other channels go on.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import selectors
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ptcluster.remote.channel import NodeChannel

log = logging.getLogger(__name__)
READ_SIZE = 1 << 16
STDERR_WAIT = 10.0
"""After stdout's EOF, how long the process may take to exit before its stderr is closed."""
REAP_WAIT = 10.0
"""After both streams' EOF, how long the process may take to exit before it is SIGKILLed."""
PASS_SECONDS = 0.005
"""Shortest time between two passes of the hub's loop: what becomes ready sooner is read with
the next pass. At 1024 nodes whose output is spread over the second, a pass for each read
(~3000 a second: a wake-up, the selector, the interpreter lock handed back and forth) cost more
than the reads; a write or a read a few milliseconds later costs nothing."""
BACKLOG_POLL = 0.02
"""How often the channels held back by their consumer's ``backlog()`` are looked at again (one
call of each distinct ``backlog`` per look, however many channels it holds)."""


class Hub:
    """The one I/O thread of a process's node channels: a selector over their pipes, a timer
    heap for heartbeats and deadlines, and a to-do list that other threads fill (``wake_*``) so
    that only this thread touches the selector."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.sel = selectors.DefaultSelector()
        self._todo: deque[Callable[[], None]] = deque()
        self._woken = False
        """A wake-up is in the pipe and not yet seen by the hub."""
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._held: dict[Callable[[], bool], set[NodeChannel]] = {}
        """The channels whose stdout is not read, by the consumer's ``backlog`` that holds them
        (a runner gives all its channels one: one look frees them all)."""
        self._next_look = 0.0
        self._beats: dict[float, set[NodeChannel]] = {}
        """The channels that get a heartbeat, by interval: one timer for each interval, not one
        per channel (1024 channels: one wake-up a second, not 1024)."""
        self._thread = threading.Thread(target=self._run, name="channels", daemon=True)
        self._thread.start()

    # -- from any thread ----------------------------------------------------------------------
    def add(self, channel: NodeChannel) -> None:
        self._call(lambda: self._add(channel))

    def wake_writer(self, channel: NodeChannel) -> None:
        self._call(lambda: self._write(channel))

    def _call(self, fn: Callable[[], None]) -> None:
        self._todo.append(fn)
        if self._woken or threading.current_thread() is self._thread:
            return  # (the loop runs its to-do list before it sleeps again)
        self._woken = True  # one wake-up for a burst (a stop to 1024 nodes), not one each
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # the pipe is full of wake-ups already: the hub will look
            pass

    # -- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            began = time.monotonic()
            timeout = 0.0 if self._todo else None
            if self._timers and timeout is None:
                timeout = max(0.0, self._timers[0][0] - time.monotonic())
            if self._held:
                timeout = BACKLOG_POLL if timeout is None else min(timeout, BACKLOG_POLL)
            for key, _ in self.sel.select(timeout):
                if key.data is None:
                    self._drain_wakeups()
                    continue
                channel, stream = key.data
                if stream not in channel._open:
                    continue  # (ended by an earlier event of this same batch)
                try:
                    if stream == "in":
                        self._write(channel)
                    else:
                        self._read(channel, stream)
                except Exception:  # noqa: BLE001 - one channel's bug ends that channel only
                    log.exception("%s: the channel failed", channel.host)
                    channel.stderr.append("ptcluster: reading the channel failed (see -vv)")
                    self._eof(channel, "out")
                    self._eof(channel, "err")
            while self._todo:
                self._safely(self._todo.popleft())
            now = time.monotonic()
            while self._timers and self._timers[0][0] <= now:
                self._safely(heapq.heappop(self._timers)[2])
            if self._held and now >= self._next_look:
                self._next_look = now + BACKLOG_POLL
                for backlog in list(self._held):
                    self._safely(partial(self._resume, backlog))
            rest = began + PASS_SECONDS - time.monotonic()
            if rest > 0 and not self._todo:
                time.sleep(rest)

    @staticmethod
    def _safely(fn: Callable[[], None]) -> None:
        """A bug in one step (a consumer's callback) must not end the thread every channel
        of the process depends on."""
        try:
            fn()
        except Exception:  # noqa: BLE001
            log.exception("node channels: a step failed")

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        # Only now, with the pipe empty, and before the to-do list is run: a call from here on
        # writes a wake-up again. Cleared before the reads, a call in between had its byte read
        # here and left the flag set, so every later call believed a wake-up was on its way and
        # the hub slept in its selector with their work undone (a setup hung on it).
        self._woken = False

    def _at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (when, next(self._seq), fn))

    def _add(self, c: NodeChannel) -> None:
        assert c.proc is not None and c.proc.stdout and c.proc.stderr and c.proc.stdin
        for f in (c.proc.stdout, c.proc.stderr, c.proc.stdin):
            os.set_blocking(f.fileno(), False)
        c._open = {"out", "err", "in"}
        self.sel.register(c.proc.stdout, selectors.EVENT_READ, (c, "out"))
        self.sel.register(c.proc.stderr, selectors.EVENT_READ, (c, "err"))
        if c.heartbeat:
            with c._lock:
                c._out += b"hb\n"  # (the first one now, the next on the interval's timer)
            beating = self._beats.get(c.heartbeat)
            if beating is None:
                beating = self._beats[c.heartbeat] = set()
                self._at(time.monotonic() + c.heartbeat, partial(self._beat, c.heartbeat))
            beating.add(c)
        self._write(c)

    def _beat(self, interval: float) -> None:
        """A heartbeat to every channel of ``interval`` that still writes; the next in
        ``interval`` while any is left."""
        beating = self._beats[interval]
        for c in list(beating):
            if c._closed.is_set() or "in" not in c._open:
                beating.discard(c)
                continue
            with c._lock:
                if c._eof_asked:
                    continue
                was_empty = not c._out
                c._out += b"hb\n"
            if was_empty:  # (else its write is pending already: the pipe is full)
                self._write(c)
        if beating:
            self._at(time.monotonic() + interval, partial(self._beat, interval))
        else:
            del self._beats[interval]

    def _write(self, c: NodeChannel) -> None:
        if "in" not in c._open:
            return
        assert c.proc is not None and c.proc.stdin is not None
        fd = c.proc.stdin.fileno()
        with c._lock:
            data, eof = bytes(c._out), c._eof_asked
        sent, broken = 0, False
        while sent < len(data):
            try:
                sent += os.write(fd, data[sent:sent + READ_SIZE])
            except BlockingIOError:
                break
            except OSError:  # the node's end is gone: the readers say why
                broken = True
                break
        with c._lock:
            del c._out[:len(data) if broken else sent]
            left = bool(c._out)
        registered = self._registered(c, "in")
        if broken or (eof and not left):
            if registered:
                self.sel.unregister(c.proc.stdin)
            c._open.discard("in")
            if c.heartbeat:
                self._beats.get(c.heartbeat, set()).discard(c)
            try:
                c.proc.stdin.close()
            except OSError:
                pass
        elif left and not registered:
            self.sel.register(c.proc.stdin, selectors.EVENT_WRITE, (c, "in"))
        elif not left and registered:
            self.sel.unregister(c.proc.stdin)

    def _registered(self, c: NodeChannel, stream: str) -> bool:
        assert c.proc is not None and c.proc.stdin is not None
        try:
            key = self.sel.get_key(c.proc.stdin)
        except KeyError:
            return False
        return bool(key.data and key.data[1] == stream)

    def _read(self, c: NodeChannel, stream: str) -> bool:
        """One read of ``stream``; True when it brought data."""
        assert c.proc is not None
        f = c.proc.stdout if stream == "out" else c.proc.stderr
        assert f is not None
        if stream == "out" and c.backlog is not None and c.backlog():
            self._hold(c)
            return False
        try:
            chunk = os.read(f.fileno(), READ_SIZE)
        except BlockingIOError:
            return False
        except OSError:
            chunk = b""
        if not chunk:
            self._eof(c, stream)
            return False
        c.last_recv = time.monotonic()
        if c._fanout is not None:  # connected: the next node's handshake may start
            c._fanout.done(c)
        lines = (c._rest[stream] + chunk).split(b"\n")
        c._rest[stream] = lines.pop()
        if stream == "out":
            if lines:
                c.on_frames([raw.decode(errors="replace") for raw in lines])
        else:
            for raw in lines:
                line = raw.decode(errors="replace").rstrip("\r")
                c.stderr.append(line)
                c.on_stderr(line)
        return True

    def _hold(self, c: NodeChannel) -> None:
        assert c.proc is not None and c.proc.stdout is not None and c.backlog is not None
        self.sel.unregister(c.proc.stdout)
        c.held = True
        self._held.setdefault(c.backlog, set()).add(c)

    def _resume(self, backlog: Callable[[], bool]) -> None:
        """Every channel ``backlog`` holds reads again once it says the consumer caught up."""
        if backlog():
            return
        now = time.monotonic()
        for c in self._held.pop(backlog, ()):
            assert c.proc is not None and c.proc.stdout is not None
            c.held = False
            c.last_recv = now
            if "out" in c._open:
                self.sel.register(c.proc.stdout, selectors.EVENT_READ, (c, "out"))

    def _eof(self, c: NodeChannel, stream: str) -> None:
        assert c.proc is not None
        if stream not in c._open:
            return
        c._open.discard(stream)
        f = c.proc.stdout if stream == "out" else c.proc.stderr
        assert f is not None
        if c.held and stream == "out":
            assert c.backlog is not None
            held = self._held.get(c.backlog)
            if held is not None:
                held.discard(c)
                if not held:
                    del self._held[c.backlog]
            c.held = False
        else:
            self.sel.unregister(f)
        rest, c._rest[stream] = c._rest[stream], b""
        try:
            if rest and stream == "out":
                c.on_frames([rest.decode(errors="replace")])
            elif rest:
                line = rest.decode(errors="replace").rstrip("\r")
                c.stderr.append(line)
                c.on_stderr(line)
        except Exception:  # noqa: BLE001
            log.exception("%s: handing over the channel's last words failed", c.host)
        f.close()
        if stream == "out" and "err" in c._open:
            self._last_words(c, time.monotonic() + STDERR_WAIT)
        elif not ({"out", "err"} & c._open):
            c._reap_from = time.monotonic()
            self._reap(c)

    def _last_words(self, c: NodeChannel, until: float) -> None:
        """stdout ended: stderr ends with the process, not with its EOF. ssh writes its last
        words before it exits, so once it has exited they are in the pipe; its EOF may never
        come while another process holds the pipe (a ControlPersist master that ssh forked
        keeps the stderr it was given: OpenSSH bug 1988)."""
        assert c.proc is not None
        if "err" not in c._open:
            return
        if c.proc.poll() is None and time.monotonic() < until:
            self._at(time.monotonic() + 0.02, lambda: self._last_words(c, until))
            return
        for _ in range(64):  # what is in the pipe, then the end (<= 4 MiB)
            if "err" not in c._open or not self._read(c, "err"):
                break
        self._eof(c, "err")

    def _reap(self, c: NodeChannel) -> None:
        assert c.proc is not None and c._reap_from is not None
        code = c.proc.poll()
        if code is None:
            if time.monotonic() - c._reap_from < REAP_WAIT:
                self._at(time.monotonic() + 0.02, lambda: self._reap(c))
                return
            c.signal(signal.SIGKILL)  # streams closed but the process lingers
            code = c.proc.wait()
        if "in" in c._open:
            if self._registered(c, "in"):
                assert c.proc.stdin is not None
                self.sel.unregister(c.proc.stdin)
            c._open.discard("in")
            try:
                assert c.proc.stdin is not None
                c.proc.stdin.close()
            except OSError:
                pass
        c._closed.set()
        if c._fanout is not None:
            c._fanout.done(c)
        try:
            c.on_closed(code, list(c.stderr))
        except Exception:  # noqa: BLE001
            log.exception("%s: on_closed failed", c.host)


_hub: Hub | None = None
_hub_lock = threading.Lock()


def hub() -> Hub:
    """This process's hub (a new one in a forked child: threads do not survive a fork)."""
    global _hub
    with _hub_lock:
        if _hub is None or _hub.pid != os.getpid():
            _hub = Hub()
        return _hub
