"""One node channel: start a node program over a transport and talk to it in frames.

The one copy of the session plumbing that ``run``, ``doctor`` and ``monitor`` (and ``setup``
next) use, in the shape of pyinfra's connectors: start the program, frames both ways, heartbeats
on their own thread, a close reason that keeps ssh's own last words.

Threads per channel, none of them waiting on anyone's console:
  writer     sends queued frames (the preamble first), so ``send`` never blocks the caller
  heartbeat  queues ``hb`` every interval while the channel is open
  stdout     reads frames in chunks and hands them to ``on_frames`` (may block: backpressure)
  stderr     keeps ssh's / the node's stderr; handed over line by line too
When both streams reach EOF the process is reaped (in that thread, never the caller's) and
``on_closed(exit_code, stderr_tail)`` is called exactly once.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import IO, Any

from ptcluster.node import Program
from ptcluster.node.wire import encode
from ptcluster.remote.bootstrap import node_argv, preamble
from ptcluster.remote.transport import Transport, explain_start_failure

log = logging.getLogger(__name__)
STDERR_TAIL = 40


class NodeChannel:
    """A node program started over ``transport``; frames in, frames out.

    ``on_frames(lines)`` gets the program's stdout as decoded lines (without newlines), in
    order, in batches; ``on_stderr(line)`` each stderr line; ``on_closed(code, stderr)`` once.
    Callbacks run on the channel's reader threads: they must be quick or hand off.
    """

    def __init__(self, transport: Transport, python: str, program: Program,
                 config: dict[str, Any], *, on_frames: Callable[[list[str]], None],
                 on_closed: Callable[[int | None, list[str]], None],
                 on_stderr: Callable[[str], None] | None = None,
                 heartbeat: float | None = None, tag: str = "-") -> None:
        self.host = transport.host
        self.transport = transport
        self.argv = node_argv(python, program, tag)
        self.first = preamble(program, config)
        self.on_frames = on_frames
        self.on_closed = on_closed
        self.on_stderr = on_stderr or (lambda line: None)
        self.heartbeat = heartbeat
        self.proc: subprocess.Popen[bytes] | None = None
        self.stderr: deque[str] = deque(maxlen=STDERR_TAIL)
        self.last_recv = time.monotonic()
        """Monotonic time data last came from the node (stdout or stderr)."""
        self.busy = False
        """True while a batch is being handed over (the node is not silent, we are slow)."""
        self._out: queue.Queue[bytes | None] = queue.Queue()
        self._closed = threading.Event()
        self._input_closed = False
        self._stderr_done = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- life ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Spawn the program (raises ``OSError`` when the transport cannot be started)."""
        self.proc = self.transport.spawn(self.argv)
        self.last_recv = time.monotonic()
        self._out.put(self.first)
        targets: list[Callable[[], None]] = [self._write, self._read_stdout, self._read_stderr]
        if self.heartbeat:
            targets.append(self._beat)
        for target in targets:
            t = threading.Thread(target=target, name=f"channel-{self.host}-{target.__name__}",
                                 daemon=True)
            t.start()
            self._threads.append(t)

    def send(self, kind: str, payload: dict[str, Any] | None = None) -> None:
        """Queue a frame for the node (never blocks)."""
        if not self._closed.is_set():
            self._out.put(encode(kind, payload))

    def close_input(self) -> None:
        """EOF to the node program (it ends its work and exits); once is enough."""
        if not self._input_closed:
            self._input_closed = True
            self._out.put(None)

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

    def close(self, deadline: float) -> None:
        """EOF, then wait until ``deadline`` (monotonic) and kill what is still running."""
        self.close_input()
        if not self._closed.wait(max(0.0, deadline - time.monotonic())):
            self.signal(signal.SIGKILL)
            self._closed.wait(5.0)

    # -- threads ------------------------------------------------------------------------------
    def _write(self) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        stdin = self.proc.stdin
        while True:
            data = self._out.get()
            if data is None:
                break
            try:
                stdin.write(data)
                stdin.flush()
            except (OSError, ValueError):
                break  # the channel is gone: the readers report why
        try:
            stdin.close()
        except OSError:
            pass

    def _beat(self) -> None:
        assert self.heartbeat is not None
        while not self._closed.wait(self.heartbeat):
            self._out.put(b"hb\n")

    def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        stream: IO[bytes] = self.proc.stdout
        rest = b""
        try:
            while True:
                chunk = stream.read1(1 << 16)  # type: ignore[attr-defined]
                if not chunk:
                    break
                self.last_recv = time.monotonic()
                lines = (rest + chunk).split(b"\n")
                rest = lines.pop()
                if lines:
                    self._hand_over([raw.decode(errors="replace") for raw in lines])
            if rest:
                self._hand_over([rest.decode(errors="replace")])
        except Exception:  # noqa: BLE001 - a callback bug is this node's failure, not a hang
            log.exception("%s: reading the channel failed", self.host)
            self.stderr.append("ptcluster: reading the channel failed (see -vv)")
        finally:
            self._stderr_done.wait(10.0)  # ssh's last words come before the close
            self._finish()

    def _hand_over(self, lines: list[str]) -> None:
        self.busy = True
        try:
            self.on_frames(lines)
        finally:
            self.busy = False
            self.last_recv = time.monotonic()

    def _read_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        try:
            for raw in iter(self.proc.stderr.readline, b""):
                self.last_recv = time.monotonic()
                line = raw.decode(errors="replace").rstrip("\r\n")
                self.stderr.append(line)
                self.on_stderr(line)
        except Exception:  # noqa: BLE001
            log.exception("%s: reading stderr failed", self.host)
        finally:
            self._stderr_done.set()

    def _finish(self) -> None:
        assert self.proc is not None
        try:
            code: int | None = self.proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:  # streams closed but the process lingers
            self.signal(signal.SIGKILL)
            code = self.proc.wait()
        self._out.put(None)
        self._closed.set()
        try:
            self.on_closed(code, list(self.stderr))
        except Exception:  # noqa: BLE001
            log.exception("%s: on_closed failed", self.host)


def start_all(channels: list[NodeChannel],
              on_error: Callable[[NodeChannel, str, str], None]) -> list[NodeChannel]:
    """Start every channel; the ones that could not start go to ``on_error(channel, problem,
    fix)``; never raises."""
    started = []
    for channel in channels:
        try:
            channel.start()
        except OSError as exc:
            # (the local program that failed: ssh or srun, or the interpreter for a local node)
            program = channel.transport.argv(channel.argv)[0]
            on_error(channel, *explain_start_failure(program, exc))
            continue
        started.append(channel)
    return started


def close_all(channels: list[NodeChannel], timeout: float) -> None:
    """EOF to every channel, then one shared deadline for all of them (not one each)."""
    deadline = time.monotonic() + timeout
    for channel in channels:
        channel.close_input()
    for channel in channels:
        channel.close(deadline)
