"""The guard's side of its ranks: one Unix socket, every rank's output and records as frames.

Standard library only; shipped with the guard (shipped by ``remote.bootstrap``).
"""

import os
import select
import selectors
import socket
import threading
import time
from typing import Any

from ptcluster.node.guard.outbox import Outbox
from ptcluster.node.guard.progress import StackProbes
from ptcluster.node.rank_wire import (
    BAD_RECORD,
    CTL,
    ERR,
    ERROR,
    EXIT,
    PROBE,
    REPORT,
    START,
    STREAMS,
    RankError,
    RankExit,
    RankStart,
    decode_record,
    header,
)
from ptcluster.node.wire import MAX_FRAME, RANK_FRAMES, Kind, encode, encode_text

MAX_LINE = 65536
"""Longer output lines are cut into pieces of this size (bounded memory per stream)."""
MAX_RECORD = MAX_FRAME // 4
"""A longer record is not sent on (its frame, its JSON written again, could pass the head's
``MAX_FRAME`` and end the job's channel): the head gets a bad-record report instead."""
EXIT_WAIT = 2.0
"""Seconds a rank's exit frame waits for the rest of its output (streams held by children)."""
IDLE_FLUSH = 1.0
"""Seconds after which a partial output line (no newline yet) is sent as it is."""
PASS_WAIT = 0.05
"""Seconds the server waits for its streams at most before it looks at its timers."""


class RankServer:
    """The Unix socket the ranks' shims connect to (``node.rank_wire``); one selector thread
    serves every stream.

    Output lines end at ``\n`` or ``\r`` (progress bars), and a partial line is sent after
    ``IDLE_FLUSH`` s without more (prompts). ``probe`` connections go to ``node.guard.progress``;
    every other record is passed to the head as its ``wire.RANK_FRAMES`` frame. A rank's
    ``rexit`` waits until every declared output stream has come and gone (or ``EXIT_WAIT``), so
    the head has a rank's last lines, its traceback included, before it learns that it ended.
    Output goes to ``out`` to be held (``guard.outbox``: many ranks' lines in one write), records
    at once; this thread writes the held output when its hold is up.
    """

    def __init__(self, path: str, out: Outbox, watch: Any = None) -> None:
        self.path = path
        self.out = out
        self.watch = watch
        """What the machine saw (``guard.machine.MachineWatch``): told of every rank's start,
        asked at its failure (OOM kills) and at an error that says the disk was full."""
        self.sel = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        os.chmod(path, 0o600)
        self.listener.listen(1024)
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        self.wake_r, self.wake_w = os.pipe()
        """``close`` wakes the thread (it waits up to ``PASS_WAIT`` s for its streams: every
        job's end waited for it, 25 ms on average)."""
        os.set_blocking(self.wake_w, False)
        self.sel.register(self.wake_r, selectors.EVENT_READ, None)
        self.open_streams: dict[int, int] = {}
        self.seen_streams: dict[int, int] = {}
        self.declared: dict[int, int] = {}
        self.pending: dict[int, tuple[RankExit, float]] = {}
        self.exited: set[int] = set()
        self.probes = StackProbes()
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while True:
            due = self.out.due()
            for key, _ in self.sel.select(PASS_WAIT if due is None else min(PASS_WAIT, due)):
                if key.fileobj == self.wake_r:
                    os.read(self.wake_r, 64)
                elif key.data is None:
                    self.accept()
                else:
                    self.read(key.fileobj, key.data)
            self.out.flush_due()
            self.flush_partial_lines()
            self.flush_exits(force=False)
            if self.closing.is_set() and not self.pending and not self.open_streams:
                return

    def accept(self) -> None:
        while True:  # every waiting connection, so a rank's streams are counted together
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, OSError):
                return
            conn.setblocking(True)
            self.sel.register(conn, selectors.EVENT_READ,
                              {"head": b"", "rank": None, "buf": b"", "cr": False, "at": 0.0,
                               "conn": conn})

    def read(self, conn: Any, st: dict[str, Any]) -> None:
        try:
            data = conn.recv(65536)
        except OSError:
            data = b""
        eof = not data
        if st["rank"] is None:
            st["head"] += data
            if b"\n" not in st["head"] and not eof and len(st["head"]) < 4096:
                return
            first, _, data = st["head"].partition(b"\n")
            try:
                rank, role = header(first)
            except ValueError:
                self.drop(conn)
                return
            st["rank"], st["role"] = rank, role
            if role in STREAMS:
                self.open_streams[rank] = self.open_streams.get(rank, 0) + 1
                self.seen_streams[rank] = self.seen_streams.get(rank, 0) + 1
        if data:
            self.feed(st, data)
        if eof:
            self.drop(conn, st)

    def feed(self, st: dict[str, Any], data: bytes) -> None:
        role, rank = st["role"], st["rank"]
        if role == PROBE:
            self.probes.feed(st, data)
            return
        if role not in STREAMS:
            lines = (st["buf"] + data).split(b"\n")
            st["buf"] = lines.pop()
            for line in lines:
                self.record(rank, line.decode(errors="replace"))
            return
        if st["cr"] and data.startswith(b"\n"):
            data = data[1:]  # the \n of a \r\n split across two reads
        st["cr"] = data.endswith(b"\r")
        lines = (st["buf"] + data).replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        st["buf"] = lines.pop()
        if len(st["buf"]) > MAX_LINE:
            lines.append(st["buf"])
            st["buf"] = b""
        st["at"] = time.monotonic()
        if lines:
            self.probes.output(rank, st["at"])
            kind = Kind.ERR if role == ERR else Kind.OUT
            self.out.later(b"".join(encode_text(kind, rank, line) for line in lines))

    def flush_partial_lines(self) -> None:
        """A partial output line (a prompt, a progress bar) goes out once the rank pauses:
        no new data for ``IDLE_FLUSH`` s *and* none waiting now (when we were slow, e.g. the
        head did not read, the rest of the line may be queued: that is not a pause)."""
        now = time.monotonic()
        for key in list(self.sel.get_map().values()):
            st = key.data
            if st and st.get("buf") and st.get("role") in STREAMS \
                    and now - st["at"] > IDLE_FLUSH:
                if select.select([key.fileobj], [], [], 0)[0]:
                    continue  # more of it is waiting: read it first
                line, st["buf"] = st["buf"], b""
                kind = Kind.ERR if st["role"] == ERR else Kind.OUT
                self.out.later(encode_text(kind, st["rank"], line))

    def record(self, rank: int, line: str) -> None:
        record = decode_record(line) if len(line) <= MAX_RECORD else None
        if record is None:
            text = line[:200] if len(line) <= MAX_RECORD else \
                f"a record of {len(line)} characters (at most {MAX_RECORD}): {line[:100]}"
            self.out.now(encode(RANK_FRAMES[REPORT], {"rank": rank, "kind": BAD_RECORD,
                                                    "text": text}))
            return
        kind, body = record  # (the rank's, as rank_wire declares each record of its kind)
        body["rank"] = rank
        if kind == EXIT:
            ended: RankExit = body
            self.machine_said(rank, ended)
            self.probes.ended(rank)
            self.exited.add(rank)
            self.pending[rank] = (ended, time.monotonic() + EXIT_WAIT)
        elif kind == START:
            started: RankStart = body
            self.declared[rank] = int(started.get("streams", 0))
            self.probes.started(rank, int(started.get("pid", 0)))
            try:
                if self.watch is not None:
                    self.watch.started(rank, int(started.get("pid", 0)),
                                       int(started.get("shim_pid", 0)))
            except Exception:  # noqa: BLE001, S110 - advice only: never this thread's end
                pass
            self.out.now(encode(RANK_FRAMES[START], started))
        elif kind == REPORT:  # (data a rank reports, maybe every step: held as output is)
            self.out.later(encode(RANK_FRAMES[kind], body))
        elif kind == ERROR:
            error: RankError = body
            try:
                disk = self.watch.after_error(error) if self.watch is not None else None
            except Exception:  # noqa: BLE001 - advice only: the error goes out regardless
                disk = None
            if disk:
                error["disk"] = disk
            self.out.now(encode(RANK_FRAMES[kind], error))

    def machine_said(self, rank: int, body: RankExit) -> None:
        """Into a failed rank's exit record: the OOM kills of its tree, the GPU driver's Xids of
        its processes or its GPUs, where any."""
        if self.watch is None or body.get("code") == 0:
            return
        try:
            oom = self.watch.after_exit(rank, body.get("code"))
            xids = self.watch.xids_of(rank)
        except Exception:  # noqa: BLE001 - advice only: the exit goes out regardless
            oom, xids = None, []
        if oom:
            body["oom"] = oom
        if xids:
            body["xids"] = xids
        for xid in self.watch.new_xids():  # (read just now: before the exit, as a warning)
            self.out.now(encode(Kind.XID, xid))

    def drop(self, conn: Any, st: dict[str, Any] | None = None) -> None:
        self.sel.unregister(conn)
        conn.close()
        if st is None or st["rank"] is None:
            return
        if st["buf"] and st["role"] != PROBE:
            self.feed(st, b"\n")
        rank = st["rank"]
        self.probes.dropped(st)
        if st["role"] in STREAMS:
            self.open_streams[rank] -= 1
            if self.open_streams[rank] <= 0:
                del self.open_streams[rank]
        elif st["role"] == CTL and rank not in self.exited:
            # The shim itself died (SIGKILL): no exit record; the head reports it as killed.
            body: RankExit = {"rank": rank, "code": None, "t": time.time(),
                              "note": "ended without an exit record"}
            self.machine_said(rank, body)
            self.probes.ended(rank)
            self.exited.add(rank)
            self.pending[rank] = (body, time.monotonic() + EXIT_WAIT)

    def flush_exits(self, force: bool) -> None:
        now = time.monotonic()
        for rank, (body, deadline) in list(self.pending.items()):
            streams_done = rank not in self.open_streams and \
                self.seen_streams.get(rank, 0) >= self.declared.get(rank, 0)
            if force or streams_done or now >= deadline:
                del self.pending[rank]
                self.out.now(encode(RANK_FRAMES[EXIT], body))

    def close(self, wait: float) -> None:
        """Serve until every stream is closed and every exit is sent, at most ``wait`` s."""
        self.closing.set()
        if self.wake_w < 0:
            return  # (closed before)
        try:
            os.write(self.wake_w, b"x")
        except OSError:  # (full: it is awake already)
            pass
        self.thread.join(timeout=wait)
        if self.thread.is_alive():
            return  # a descendant still holds a stream: its exit goes out with what we have
        self.flush_exits(force=True)
        self.listener.close()
        os.close(self.wake_r)
        os.close(self.wake_w)
        self.wake_w = -1
