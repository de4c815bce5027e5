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
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import IO, TYPE_CHECKING

from ptcluster.node.wire import MAX_FRAME, Kind, encode

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
than the reads; a write or a read a few milliseconds later costs nothing. Not slept after a pass
that wrote to a pipe and has more queued for it (a file on its way: ``remote.blobs``): a node's
stdin pipe holds 64 KiB, so a rest after each write capped every channel at 64 KiB per 5 ms
(13 MB/s; ``ptcluster push`` to 3 nodes took 7.5x one rsync); select() still waits for the pipe
to take more, so a stalled node costs nothing."""
BACKLOG_POLL = 0.02
"""How often the channels held back by their consumer's ``backlog()`` are looked at again (one
call of each distinct ``backlog`` per look, however many channels it holds)."""
EXIT_POLL = PASS_SECONDS
"""How often a process whose streams ended is looked at until it has exited (it closes them as
it exits: it is gone within a look or two; at 20 ms, each job's end waited ~20-40 ms here)."""
MAX_STDERR_LINE = 64 * 1024
"""A node's stderr line longer than this is handed over in pieces of this size (it is text for
people, like a rank's output line: ``guard.rank_server.MAX_LINE``)."""
TOO_LONG = (f"ptcluster: frame too long: the node sent a line of more than {MAX_FRAME >> 20} "
            "MiB, which no node program of ptcluster sends; its channel is closed")
"""The close reason of a channel whose node sent a frame longer than ``MAX_FRAME``."""
HEARTBEAT = encode(Kind.HB)
"""The head's heartbeat frame, written once (every channel with a ``heartbeat`` gets it)."""


IN, OUT, ERR = "in", "out", "err"
"""A channel's streams: the node program's stdin, stdout and stderr."""


class _Link:
    """The hub's own record of one channel: its process's pipes and what the hub knows of them
    (the channel keeps its outgoing buffer; this is the hub thread's state alone)."""

    __slots__ = ("channel", "proc", "pipes", "open", "rest", "rest_size", "held", "reap_from")

    def __init__(self, channel: NodeChannel, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        self.channel = channel
        self.proc = proc
        self.pipes: dict[str, IO[bytes]] = {IN: proc.stdin, OUT: proc.stdout, ERR: proc.stderr}
        self.open = {OUT, ERR, IN}
        """The streams not yet at their end (stdin: not yet closed)."""
        self.rest: dict[str, list[bytes]] = {OUT: [], ERR: []}
        """What is left of a line, per stream, until its newline comes: the chunks as read,
        joined once (a line of many reads costs its length, not its length squared)."""
        self.rest_size = {OUT: 0, ERR: 0}
        """The bytes in ``rest``, per stream (bounded: ``MAX_FRAME``, ``MAX_STDERR_LINE``)."""
        self.held = False
        """True while the consumer's backlog holds this channel's frames back (the node is not
        silent: we are slow)."""
        self.reap_from: float | None = None
        """When both streams ended: the process has ``REAP_WAIT`` s to exit."""

    def pipe(self, stream: str) -> IO[bytes]:
        return self.pipes[stream]


class Hub:
    """The one I/O thread of a process's node channels: a selector over their pipes, a timer
    heap for heartbeats and deadlines, and a to-do list that other threads fill (``add``,
    ``wake_writer``) so that only this thread touches the selector and its records."""

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
        self._links: dict[NodeChannel, _Link] = {}
        """Every channel added and not yet reaped."""
        self._held: dict[Callable[[], bool], set[_Link]] = {}
        """The channels whose stdout is not read, by the consumer's ``backlog`` that holds them
        (a runner gives all its channels one: one look frees them all)."""
        self._next_look = 0.0
        self._streaming = False
        """This pass wrote to a pipe that has more queued: the next pass does not rest."""
        self._beats: dict[float, set[_Link]] = {}
        """The channels that get a heartbeat, by interval: one timer for each interval, not one
        per channel (1024 channels: one wake-up a second, not 1024)."""
        self._thread = threading.Thread(target=self._run, name="channels", daemon=True)
        self._thread.start()

    # -- from any thread ----------------------------------------------------------------------
    def add(self, channel: NodeChannel) -> None:
        """Serve ``channel``, whose process (``channel.proc``) has just been started."""
        self._call(lambda: self._add(channel))

    def wake_writer(self, channel: NodeChannel) -> None:
        """``channel`` has something new to write (or its input is to end)."""
        self._call(lambda: self._write_channel(channel))

    def holds(self, channel: NodeChannel) -> bool:
        """True while ``channel``'s consumer is why nothing new is read from it (held back)."""
        link = self._links.get(channel)
        return link is not None and link.held

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
            began, self._streaming = time.monotonic(), False
            timeout = 0.0 if self._todo else None
            if self._timers and timeout is None:
                timeout = max(0.0, self._timers[0][0] - time.monotonic())
            if self._held:
                timeout = BACKLOG_POLL if timeout is None else min(timeout, BACKLOG_POLL)
            for key, _ in self.sel.select(timeout):
                if key.data is None:
                    self._drain_wakeups()
                else:
                    self._serve(*key.data)
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
            if rest > 0 and not self._todo and not self._streaming:
                time.sleep(rest)

    def _serve(self, link: _Link, stream: str) -> None:
        """One selector event: ``stream`` of ``link`` can be written or read."""
        if stream not in link.open:
            return  # (ended by an earlier event of this same batch)
        try:
            if stream == IN:
                self._write(link)
            else:
                self._read(link, stream)
        except Exception:  # noqa: BLE001 - one channel's bug ends that channel only
            log.exception("%s: the channel failed", link.channel.host)
            link.channel.stderr.append("ptcluster: reading the channel failed (see -vv)")
            self._eof(link, OUT)
            self._eof(link, ERR)

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
        assert c.proc is not None
        link = self._links[c] = _Link(c, c.proc)
        for stream in (OUT, ERR, IN):
            os.set_blocking(link.pipe(stream).fileno(), False)
        self.sel.register(link.pipe(OUT), selectors.EVENT_READ, (link, OUT))
        self.sel.register(link.pipe(ERR), selectors.EVENT_READ, (link, ERR))
        if c.heartbeat:
            c.push(HEARTBEAT, closing_too=True)  # (the first one now, the next on the timer)
            beating = self._beats.get(c.heartbeat)
            if beating is None:
                beating = self._beats[c.heartbeat] = set()
                self._at(time.monotonic() + c.heartbeat, partial(self._beat, c.heartbeat))
            beating.add(link)
        self._write(link)

    def beating(self, interval: float) -> tuple[set[NodeChannel], int]:
        """The channels given a heartbeat every ``interval`` s, and the timers that wake the
        hub for them (one, however many channels): what a test or a debugger may look at."""
        links = set(self._beats.get(interval, ()))
        timers = [fn for _, _, fn in list(self._timers)
                  if isinstance(fn, partial) and fn.func == self._beat and fn.args == (interval,)]
        return {link.channel for link in links}, len(timers)

    def _beat(self, interval: float) -> None:
        """A heartbeat to every channel of ``interval`` that still writes; the next in
        ``interval`` while any is left."""
        beating = self._beats[interval]
        for link in list(beating):
            if link.channel.closed or IN not in link.open:
                beating.discard(link)
                continue
            if link.channel.push(HEARTBEAT):  # (else its write is pending already: pipe full)
                self._write(link)
        if beating:
            self._at(time.monotonic() + interval, partial(self._beat, interval))
        else:
            del self._beats[interval]

    def _write_channel(self, c: NodeChannel) -> None:
        link = self._links.get(c)
        if link is not None:  # (not yet added: its add writes; reaped: nothing to write to)
            self._write(link)

    def _write(self, link: _Link) -> None:
        if IN not in link.open:
            return
        c, stdin = link.channel, link.pipe(IN)
        fd = stdin.fileno()
        broken = full = False
        while not (broken or full):  # a pipe's worth at a time while the pipe takes it all
            data, eof = c.pending()
            sent = 0
            try:
                sent = os.write(fd, data) if data else 0
            except BlockingIOError:
                pass
            except OSError:  # the node's end is gone: the readers say why
                broken = True
            full = sent < len(data)
            left = c.written(len(data) if broken else sent)
            self._streaming = self._streaming or bool(sent and left)
            if not left:
                break
        registered = self._writing(link)
        if broken or (eof and not left):
            if registered:
                self.sel.unregister(stdin)
            link.open.discard(IN)
            if c.heartbeat:
                self._beats.get(c.heartbeat, set()).discard(link)
            try:
                stdin.close()
            except OSError:
                pass
        elif left and not registered:
            self.sel.register(stdin, selectors.EVENT_WRITE, (link, IN))
        elif not left and registered:
            self.sel.unregister(stdin)

    def _writing(self, link: _Link) -> bool:
        """Whether the selector waits for ``link``'s stdin to take more."""
        try:
            key = self.sel.get_key(link.pipe(IN))
        except KeyError:
            return False
        return bool(key.data and key.data[1] == IN)

    def _read(self, link: _Link, stream: str) -> bool:
        """One read of ``stream``; True when it brought data."""
        c, f = link.channel, link.pipe(stream)
        if stream == OUT and c.backlog is not None and c.backlog():
            self._hold(link)
            return False
        try:
            chunk = os.read(f.fileno(), READ_SIZE)
        except BlockingIOError:
            return False
        except OSError:
            chunk = b""
        if not chunk:
            self._eof(link, stream)
            return False
        c.heard(time.monotonic())  # (connected: the next node's handshake may start)
        lines = self._lines(link, stream, chunk)
        if stream == ERR:
            for raw in lines:
                c.got_stderr(raw.decode(errors="replace").rstrip("\r"))
            return True
        too_long = next((i for i, raw in enumerate(lines) if len(raw) > MAX_FRAME), None)
        if too_long is not None or link.rest_size[OUT] > MAX_FRAME:
            del lines[len(lines) if too_long is None else too_long:]
        if lines:
            c.on_frames([raw.decode(errors="replace") for raw in lines])
        if too_long is not None or link.rest_size[OUT] > MAX_FRAME:
            self._too_long(link)
            return False
        return True

    @staticmethod
    def _lines(link: _Link, stream: str, chunk: bytes) -> list[bytes]:
        """The lines ``chunk`` completes; its unfinished end waits in ``link.rest``. A stderr
        line that grows past ``MAX_STDERR_LINE`` is handed over in pieces; stdout's is bounded
        by the caller (``MAX_FRAME``: the channel is closed)."""
        parts = link.rest[stream]
        end = chunk.rfind(b"\n")
        if end < 0:
            parts.append(chunk)
            link.rest_size[stream] += len(chunk)
            if stream == OUT or link.rest_size[ERR] <= MAX_STDERR_LINE:
                return []
            whole = b"".join(parts)
            parts.clear()
            link.rest_size[ERR] = 0
            return [whole[i:i + MAX_STDERR_LINE] for i in range(0, len(whole), MAX_STDERR_LINE)]
        parts.append(chunk[:end])
        lines = b"".join(parts).split(b"\n")
        parts.clear()
        tail = chunk[end + 1:]
        if tail:
            parts.append(tail)
        link.rest_size[stream] = len(tail)
        return lines

    def _too_long(self, link: _Link) -> None:
        """The node sent a frame longer than ``MAX_FRAME``: its channel ends now, with that
        reason (its transport killed: nothing more of it is read), the others go on."""
        c = link.channel
        log.warning("%s: %s", c.host, TOO_LONG)
        c.reason = TOO_LONG
        link.rest[OUT].clear()
        link.rest_size[OUT] = 0
        c.signal(signal.SIGKILL)
        self._eof(link, OUT)

    def _hold(self, link: _Link) -> None:
        assert link.channel.backlog is not None
        self.sel.unregister(link.pipe(OUT))
        link.held = True
        self._held.setdefault(link.channel.backlog, set()).add(link)

    def _resume(self, backlog: Callable[[], bool]) -> None:
        """Every channel ``backlog`` holds reads again once it says the consumer caught up."""
        if backlog():
            return
        now = time.monotonic()
        for link in self._held.pop(backlog, ()):
            link.held = False
            link.channel.last_recv = now
            if OUT in link.open:
                self.sel.register(link.pipe(OUT), selectors.EVENT_READ, (link, OUT))

    def _eof(self, link: _Link, stream: str) -> None:
        if stream not in link.open:
            return
        link.open.discard(stream)
        c, f = link.channel, link.pipe(stream)
        if link.held and stream == OUT:
            assert c.backlog is not None
            held = self._held.get(c.backlog)
            if held is not None:
                held.discard(link)
                if not held:
                    del self._held[c.backlog]
            link.held = False
        else:
            self.sel.unregister(f)
        rest = b"".join(link.rest[stream])
        link.rest[stream].clear()
        link.rest_size[stream] = 0
        try:
            if rest and stream == OUT:
                c.on_frames([rest.decode(errors="replace")])
            elif rest:
                c.got_stderr(rest.decode(errors="replace").rstrip("\r"))
        except Exception:  # noqa: BLE001
            log.exception("%s: handing over the channel's last words failed", c.host)
        f.close()
        if stream == OUT and ERR in link.open:
            self._last_words(link, time.monotonic() + STDERR_WAIT)
        elif not ({OUT, ERR} & link.open):
            link.reap_from = time.monotonic()
            self._reap(link)

    def _last_words(self, link: _Link, until: float) -> None:
        """stdout ended: stderr ends with the process, not with its EOF. ssh writes its last
        words before it exits, so once it has exited they are in the pipe; its EOF may never
        come while another process holds the pipe (a ControlPersist master that ssh forked
        keeps the stderr it was given: OpenSSH bug 1988)."""
        if ERR not in link.open:
            return
        if link.proc.poll() is None and time.monotonic() < until:
            self._at(time.monotonic() + EXIT_POLL, lambda: self._last_words(link, until))
            return
        for _ in range(64):  # what is in the pipe, then the end (<= 4 MiB)
            if ERR not in link.open or not self._read(link, ERR):
                break
        self._eof(link, ERR)

    def _reap(self, link: _Link) -> None:
        assert link.reap_from is not None
        code = link.proc.poll()
        if code is None:
            if time.monotonic() - link.reap_from < REAP_WAIT:
                self._at(time.monotonic() + EXIT_POLL, lambda: self._reap(link))
                return
            link.channel.signal(signal.SIGKILL)  # streams closed but the process lingers
            code = link.proc.wait()
        if IN in link.open:
            if self._writing(link):
                self.sel.unregister(link.pipe(IN))
            link.open.discard(IN)
            try:
                link.pipe(IN).close()
            except OSError:
                pass
        self._links.pop(link.channel, None)
        link.channel.ended(code)


_hub: Hub | None = None
_hub_lock = threading.Lock()


def hub() -> Hub:
    """This process's hub (a new one in a forked child: threads do not survive a fork)."""
    global _hub
    with _hub_lock:
        if _hub is None or _hub.pid != os.getpid():
            _hub = Hub()
        return _hub
