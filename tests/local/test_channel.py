"""The node channel (remote/channel.py) with real processes: how a channel ends, and the
fan-out window. The guard's side of a channel is in test_guard.py; many channels at once in
test_head_scale.py."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

from ptcluster.node import GUARD
from ptcluster.node.wire import encode
from ptcluster.remote.channel import NodeChannel, close_all, start_all
from ptcluster.remote.transport import Transport


@dataclass
class Shell(Transport):
    """A "node" that runs a shell command (the node program's argv is ignored)."""

    host: str
    script: str
    spawned: list[float] = field(default_factory=list)

    def argv(self, node_argv: list[str]) -> list[str]:
        return ["sh", "-c", self.script]

    def spawn(self, node_argv: list[str]) -> subprocess.Popen[bytes]:
        self.spawned.append(time.monotonic())
        return super().spawn(node_argv)


def test_a_channel_ends_when_its_process_does_though_a_child_keeps_its_stderr() -> None:
    # What ssh does with ControlPersist: the master it forks keeps the stderr it was given
    # (OpenSSH bug 1988), so stderr's end may come only when the master goes, minutes later.
    script = "echo 'the last words' >&2; (sleep 60 <&- >&- &); exit 3"
    closed: list[tuple[float, int | None, list[str]]] = []
    done = threading.Event()

    def on_closed(code: int | None, stderr: list[str]) -> None:
        closed.append((time.monotonic(), code, stderr))
        done.set()

    t = Shell("n0", script)
    channel = NodeChannel(t, "python3", GUARD, {}, on_frames=lambda lines: None,
                          on_closed=on_closed)
    t0 = time.monotonic()
    channel.start()
    assert channel.proc is not None
    try:
        assert done.wait(8.0), "the channel waited for the stderr of a process that had ended"
        at, code, stderr = closed[0]
        assert code == 3 and stderr == ["the last words"]
        assert at - t0 < 8.0 and channel.closed
    finally:
        os.killpg(channel.proc.pid, signal.SIGKILL)  # the sleep we started (its group)


def test_at_most_the_window_of_channels_is_in_its_handshake_at_once() -> None:
    # Each "node" takes 0.3 s to say its first word; with a window of 2, the third starts only
    # after one of the first two has spoken, and every channel still starts and ends.
    spoke: dict[str, float] = {}
    closed: dict[str, int | None] = {}
    lock = threading.Lock()
    transports = [Shell(f"n{i}", "sleep 0.3; echo hello; cat >/dev/null") for i in range(5)]

    def frames(host: str, lines: list[str]) -> None:
        with lock:  # (when its first read came: before the next channel was started)
            spoke.setdefault(host, by_host[host].last_recv)

    def on_closed(host: str, code: int | None, stderr: list[str]) -> None:
        with lock:
            closed[host] = code

    channels = [NodeChannel(t, "python3", GUARD, {},
                            on_frames=lambda lines, h=t.host: frames(h, lines),
                            on_closed=lambda code, err, h=t.host: on_closed(h, code, err))
                for t in transports]
    by_host = {c.host: c for c in channels}
    errors: list[str] = []
    started = start_all(channels, lambda c, said: errors.append(said.what), window=2)
    assert len(started) == 5 and not errors
    deadline = time.monotonic() + 20
    while len(spoke) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    close_all(started, timeout=10)
    assert len(spoke) == 5 and set(closed) == {t.host for t in transports}
    for t in transports:  # at each start: how many had started and not yet spoken
        at = t.spawned[0]
        in_flight = [u for u in transports if u.spawned and u.spawned[0] <= at
                     and spoke[u.host] > at]
        assert len(in_flight) <= 2, (t.host, [u.host for u in in_flight])
    assert transports[2].spawned[0] >= min(spoke["n0"], spoke["n1"])


def test_a_channel_whose_streams_end_together_ends_cleanly(caplog) -> None:
    # stdout's end and stderr's last words in one wake-up of the hub, the process already
    # gone: the stderr event of that same batch must not be read after stderr was closed.
    import logging

    caplog.set_level(logging.WARNING, logger="ptcluster.remote.hub")
    closed: list[tuple[int | None, list[str]]] = []
    channels = [NodeChannel(Shell(f"n{i}", "sleep 0.2; echo bye >&2"), "python3",
                            GUARD, {}, on_frames=lambda lines: None,
                            on_closed=lambda code, err: closed.append((code, err)))
                for i in range(40)]
    started = start_all(channels, lambda c, said: None, window=40)
    close_all(started, timeout=20)
    assert len(closed) == 40 and all(c == (0, ["bye"]) for c in closed), closed[:3]
    assert not [r for r in caplog.records if "failed" in r.getMessage()], caplog.text[-2000:]


def test_megabytes_of_raw_bytes_and_frames_reach_the_node_whole_and_in_order() -> None:
    # The hub writes a pipe's worth at a time while the pipe takes it, and does not rest
    # between passes while more is queued (a file on its way): every byte once, in the order
    # queued, then the input's end. A slow reader (the node's dd) keeps the pipe full.
    import hashlib

    from ptcluster.node.wire import Kind

    got: list[str] = []
    closed = threading.Event()
    t = Shell("n0", "dd bs=4096 status=none | sha256sum")
    channel = NodeChannel(t, "python3", GUARD, {}, on_frames=got.extend,
                          on_closed=lambda code, err: closed.set())
    channel.start()
    expected = hashlib.sha256(channel.first)
    for i in range(24):
        block = os.urandom((1 << 20) + i)  # (not a multiple of the pipe's size)
        channel.send_raw(block)
        channel.send(Kind.HB)
        expected.update(block + encode(Kind.HB))
        while channel.queued > 4 << 20:
            time.sleep(0.001)
    channel.close_input()
    assert closed.wait(60.0), "the node's input never ended"
    assert [line.split()[0] for line in got if line.strip()] == [expected.hexdigest()]


NODE_READS_BLOBS = """
import hashlib, json, sys
inp = sys.stdin.buffer
inp.read(FIRST)
beats, blobs = 0, []
for line in iter(inp.readline, b""):
    kind, _, body = line.partition(b" ")
    if kind == b"hb":
        beats += 1
    elif kind == b"blob":
        msg = json.loads(body)
        blobs.append(hashlib.sha256(inp.read(msg["size"])).hexdigest() == msg["sha256"])
    else:
        blobs.append(line[:40])
print(beats, *blobs, flush=True)
"""


def test_a_heartbeat_never_lands_inside_the_raw_bytes_a_frame_announced() -> None:
    # A channel with heartbeats (the environment's ship) whose wheel goes in pieces while the
    # pipe drains between them: the beats wait until the announced bytes are all queued.
    import hashlib
    import sys

    from ptcluster.node.wire import Kind

    got: list[str] = []
    closed = threading.Event()
    t = Shell("n0", "")
    channel = NodeChannel(t, "python3", GUARD, {}, on_frames=got.extend, heartbeat=0.005,
                          on_closed=lambda code, err: closed.set())
    t.script = f"{sys.executable} -c '{NODE_READS_BLOBS.replace('FIRST', str(len(channel.first)))}'"
    channel.start()
    for _ in range(3):
        data = os.urandom(256 << 10)
        channel.send(Kind.BLOB, {"sha256": hashlib.sha256(data).hexdigest(),
                                 "size": len(data)}, raw=len(data))
        for i in range(0, len(data), 16 << 10):
            channel.send_raw(data[i:i + (16 << 10)])
            time.sleep(0.002)  # the queue drains: a beat is due meanwhile
        time.sleep(0.05)
    channel.close_input()
    assert closed.wait(60.0), "the node's input never ended"
    beats, *blobs = [line for line in got if line.strip()][0].split()
    assert blobs == ["True"] * 3 and int(beats) > 0, got


def test_a_channel_closed_before_its_turn_is_never_started() -> None:
    # A job that ends while its last nodes wait for their turn (a failure early in a launch of
    # hundreds): those nodes must not be started afterwards, for nothing (their guard would take
    # its leases, a fixed port among them, just as the next attempt starts).
    transports = [Shell(f"n{i}", "sleep 0.5; echo hello; cat >/dev/null") for i in range(4)]
    closed: dict[str, list[str]] = {}
    channels = [NodeChannel(t, "python3", GUARD, {}, on_frames=lambda lines: None,
                            on_closed=lambda code, err, h=t.host: closed.setdefault(h, err))
                for t in transports]
    started = start_all(channels, lambda c, said: None, window=1)
    close_all(started, timeout=10)
    assert [bool(t.spawned) for t in transports] == [True, False, False, False]
    assert set(closed) == {"n0", "n1", "n2", "n3"}
    assert closed["n3"] == ["not started: closed before its turn came"]


def test_the_heartbeats_of_many_channels_come_from_one_timer(tmp_path) -> None:
    # 1024 channels with a heartbeat each: one timer wakes the hub once an interval for all of
    # them, not 1024 times. Every node still gets its heartbeats.
    from ptcluster.remote.hub import HEARTBEAT, hub

    transports = [Shell(f"n{i}", f"cat > {tmp_path}/in{i}") for i in range(12)]
    channels = [NodeChannel(t, "python3", GUARD, {}, on_frames=lambda lines: None,
                            on_closed=lambda code, err: None, heartbeat=0.1)
                for t in transports]
    def beats(i: int) -> int:
        path = tmp_path / f"in{i}"
        return path.read_bytes().count(b"\n" + HEARTBEAT) if path.exists() else 0

    started = start_all(channels, lambda c, said: None, window=12)
    try:
        # (waits on what the nodes received, not on the hub's cadence: a loaded machine may
        # delay the hub's thread, never skip a beat)
        deadline = time.monotonic() + 30
        while min(beats(i) for i in range(12)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        beating, timers = hub().beating(0.1)
        assert beating == set(channels) and timers == 1, (beating, timers)
    finally:
        close_all(started, timeout=10)
    assert min(beats(i) for i in range(12)) >= 3, [beats(i) for i in range(12)]
    deadline = time.monotonic() + 10
    while hub().beating(0.1) != (set(), 0) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert hub().beating(0.1) == (set(), 0)  # (its timer gone with the last channel)


def test_channels_held_by_one_backlog_are_looked_at_once_a_poll_and_freed_together() -> None:
    # A consumer that falls behind holds every channel; the hub then asks its backlog once a
    # poll for all of them (at 1024 held channels it asked 1024 times every 20 ms), and when it
    # has caught up every channel reads again and loses nothing.
    from ptcluster.remote.hub import BACKLOG_POLL

    lines_each, width = 3000, 100
    total = lines_each * (width + 1)  # (bytes, newlines included)
    behind = threading.Event()
    behind.set()
    calls: list[float] = []

    def backlog() -> bool:
        calls.append(time.monotonic())
        return behind.is_set()

    got: dict[str, int] = {}
    lock = threading.Lock()

    def frames(host: str, lines: list[str]) -> None:
        with lock:
            got[host] = got.get(host, 0) + sum(len(line) + 1 for line in lines)

    transports = [Shell(f"n{i}", f"yes {'x' * width} | head -n {lines_each}; cat >/dev/null")
                  for i in range(10)]
    channels = [NodeChannel(t, "python3", GUARD, {},
                            on_frames=lambda lines, h=t.host: frames(h, lines),
                            on_closed=lambda code, err: None, backlog=backlog)
                for t in transports]
    started = start_all(channels, lambda c, said: None, window=10)
    try:
        deadline = time.monotonic() + 10
        while not all(c.held for c in channels) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(c.held for c in channels)
        t0 = time.monotonic()
        time.sleep(0.5)
        asked = len([t for t in calls if t0 <= t < t0 + 0.5])
        assert asked <= 2 * 0.5 / BACKLOG_POLL, asked  # ~25 for all ten, not ~250
        behind.clear()
        deadline = time.monotonic() + 10
        while sum(got.values()) < 10 * total and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not any(c.held for c in channels)
    finally:
        close_all(started, timeout=10)
    assert all(got.get(t.host) == total for t in transports), got


def test_a_call_while_the_hub_drains_its_wakeups_is_never_lost(monkeypatch) -> None:
    # Another thread's call lands while the hub reads its wake-up pipe: the hub must still wake
    # for every call after it (it slept in its selector for good, with a request undelivered).
    import ptcluster.remote.hub as ch

    h = ch.Hub()
    real_read, ran, once = os.read, [], threading.Event()

    def read(fd: int, n: int) -> bytes:
        if fd == h._wake_r and not once.is_set():
            once.set()
            other = threading.Thread(target=lambda: h._call(lambda: ran.append("between")))
            other.start()
            other.join()
        return real_read(fd, n)

    monkeypatch.setattr(ch.os, "read", read)
    h._call(lambda: ran.append("first"))
    deadline = time.monotonic() + 10
    while len(ran) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # (the hub back in its selector: no timer, no channel to wake it)
    h._call(lambda: ran.append("later"))
    while len(ran) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ran == ["first", "between", "later"]


ENDLESS = """
import os, sys, time
done, chunk = 0, b"x" * 65536
while done < (32 << 20):  # one 32 MiB line, no newline; how much got out, after each write
    done += os.write(1, chunk)
    with open(sys.argv[1] + ".new", "w") as f:  # (replaced whole: a kill never leaves it empty)
        f.write(str(done))
    os.replace(sys.argv[1] + ".new", sys.argv[1])
time.sleep(60)
"""


def test_a_node_that_sends_an_endless_line_loses_its_channel_and_no_other_waits(
        tmp_path) -> None:
    # A hostile node writes a 32 MiB line without a newline. The head keeps at most MAX_FRAME
    # of it: that channel is closed with the reason, its writer is stopped (killed) well before
    # its 32 MiB are out, and another node's frames go on being read meanwhile. Before: the head
    # buffered all of it, a copy of the whole pending line per 64 KiB read (quadratic: 7 s of the
    # one I/O thread), and never closed the channel.
    from ptcluster.node.wire import MAX_FRAME
    from ptcluster.remote.hub import TOO_LONG

    script = tmp_path / "endless.py"
    script.write_text(ENDLESS)
    written = tmp_path / "written"
    closed: dict[str, tuple[float, int | None, list[str]]] = {}
    heard: list[float] = []
    done = threading.Event()

    def on_closed(host: str, code: int | None, err: list[str]) -> None:
        closed[host] = (time.monotonic(), code, err)
        done.set()

    bad = NodeChannel(Shell("bad", f"exec python3 {script} {written}"), "python3", GUARD, {},
                      on_frames=lambda lines: None,
                      on_closed=lambda code, err: on_closed("bad", code, err))
    good = NodeChannel(Shell("good", "while :; do echo 'hb {}'; sleep 0.02; done"), "python3",
                       GUARD, {}, on_frames=lambda lines: heard.extend(
                           time.monotonic() for _ in lines),
                       on_closed=lambda code, err: on_closed("good", code, err))
    good.start()
    t0 = time.monotonic()
    bad.start()
    assert bad.proc is not None
    try:
        assert done.wait(30), "the channel of the endless line was never closed"
        at, code, err = closed["bad"]
        assert err[-1] == TOO_LONG and code == -signal.SIGKILL, (code, err)
        assert int(written.read_text()) <= MAX_FRAME + (2 << 20)  # (read at most that: bounded)
        until = time.monotonic() + 15  # (a loaded machine: the other channel's next frame)
        while not any(t > at for t in heard) and time.monotonic() < until:
            time.sleep(0.05)
        assert "good" not in closed and any(t > at for t in heard)
        gaps = [b - a for a, b in zip(heard, heard[1:], strict=False) if b > t0]
        print(f"closed after {at - t0:.3f} s; the other channel's longest gap "
              f"{max(gaps):.3f} s")
    finally:
        close_all([good], timeout=5)
        if bad.proc.poll() is None:
            os.killpg(bad.proc.pid, signal.SIGKILL)
