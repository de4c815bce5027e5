"""The relay of files sent by digest (``ptcluster push``'s data, the project's environment's
wheels): a node stores each file as it arrives and passes it on to the next node of a chain
(head -> n1 -> n2 -> ...), so that the head sends each byte once. :class:`Relay` is a node's
place in the chain, the same in both programs (``node.data_agent``, ``node.venv_agent``); the
head sets the chain up (``remote.blobs.link``).

A listener binds to this node's cluster address only (the head says which) and accepts one
connection: from the upstream peer's address, that first sends this push's secret (random, per
push, told each node over the head's own channel), compared with ``hmac.compare_digest`` before
any other byte is read; anything else is closed and the listener waits on. Standard library
only; a part of the programs that use it.

A peer whose link is cut sends no FIN: without more, the node after it would wait
``STREAM_TIMEOUT`` on its socket and the one before it would block in a send. Both ends of a
relay connection ask the kernel instead (``keep_alive``): after ``PROBE_IDLE`` s without a
packet it sends probes, which the peer's kernel answers however long its program waits on its
own upstream (a healthy relay is never taken for a lost one), and ``TCP_USER_TIMEOUT`` ends
the connection once probes or sent data went unacknowledged ``PEER_LOST`` s: a cut peer is
dropped in about that long (tcp(7)), and the head sends what it lacks itself.
"""

import hmac
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import BinaryIO

from ptcluster.node.wire import Kind, control, encode, split

ACCEPT_TIMEOUT = 120.0
"""Seconds a listener waits for its upstream peer."""
SECRET_TIMEOUT = 10.0
STREAM_TIMEOUT = 600.0
"""Seconds without a byte from the upstream peer (its link up: its kernel answers) after which
it counts as gone."""
PROBE_IDLE = 3
"""Seconds without a packet after which the kernel asks the peer (then every ``PROBE_EVERY``)."""
PROBE_EVERY = 2
PEER_LOST = 12
"""Seconds of unanswered probes or unacknowledged data after which the peer counts as lost."""


def keep_alive(conn: socket.socket) -> None:
    """The kernel's watch of the peer's link on ``conn`` (Linux's options; elsewhere none)."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", PROBE_IDLE), ("TCP_KEEPINTVL", PROBE_EVERY),
                        ("TCP_KEEPCNT", PEER_LOST // PROBE_EVERY),
                        ("TCP_USER_TIMEOUT", PEER_LOST * 1000)):
        if hasattr(socket, name):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _read_exact(conn: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        block = conn.recv(size - len(data))
        if not block:
            return None
        data += block
    return data


class Listener:
    def __init__(self, bind: str, secret: str, peer: str) -> None:
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((bind, 0))
        self.sock.listen(4)
        self.port = int(self.sock.getsockname()[1])
        self.secret, self.peer = secret.encode(), peer
        self.refused = 0

    def accept(self) -> socket.socket | None:
        """The upstream peer's connection, its secret checked; None when none came in time."""
        deadline = time.monotonic() + ACCEPT_TIMEOUT
        try:
            while time.monotonic() < deadline:
                self.sock.settimeout(max(deadline - time.monotonic(), 0.01))
                conn, addr = self.sock.accept()
                conn.settimeout(SECRET_TIMEOUT)
                try:
                    said = _read_exact(conn, len(self.secret)) if addr[0] == self.peer else None
                except OSError:
                    said = None
                if said is not None and hmac.compare_digest(said, self.secret):
                    keep_alive(conn)
                    conn.settimeout(STREAM_TIMEOUT)
                    return conn
                self.refused += 1
                conn.close()
        except OSError:
            pass
        finally:
            self.sock.close()
        return None


def connect(addr: str, port: int, secret: str) -> socket.socket:
    """The connection to the next node, this push's secret said first."""
    conn = socket.create_connection((addr, port), timeout=SECRET_TIMEOUT)
    keep_alive(conn)
    conn.sendall(secret.encode())
    conn.settimeout(STREAM_TIMEOUT)
    return conn


def ssh_address() -> str:
    """This node's address on the network the head reached it on (ssh's ``SSH_CONNECTION``:
    the relay's listener binds there); "" when not reached by ssh."""
    said = os.environ.get("SSH_CONNECTION", "").split()
    return said[2] if len(said) == 4 else ""


Receive = Callable[[BinaryIO, dict], None]
"""Stores one file whose ``blob`` frame is given, reading exactly its bytes from the stream and
passing each block on (``Relay.forward``); raises EOFError when the stream ends short."""


class Relay:
    """This node's place in a chain: its files from the node before it (read on a thread of
    their own, ``listen``) or from the head, each passed on to the node after it (``link``) as
    it comes. A node after it that is gone is dropped (the head sends it what it lacks); one
    before it that is gone ends the upstream (the head sends this node what it lacks)."""

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.downstream: socket.socket | None = None
        self.upstream: threading.Thread | None = None

    def listen(self, msg: dict) -> dict:
        """``relay {bind, secret, peer}`` -> ``{port}``: the upstream node's files, on a thread."""
        try:
            listener = Listener(str(msg["bind"]), str(msg["secret"]), str(msg["peer"]))
        except OSError as exc:
            return {"problem": f"cannot listen on {msg['bind']}: {exc.strerror or exc}"}

        def upstream() -> None:
            conn = listener.accept()
            if conn is not None:
                with conn, conn.makefile("rb") as stream:
                    try:
                        for raw in iter(stream.readline, b""):
                            kind, payload = split(raw.decode().rstrip("\n"))
                            if kind == Kind.BLOB:
                                self.receive(stream, control(payload))
                    except (OSError, EOFError, ValueError):
                        pass  # (upstream gone: what is missing is sent by the head)
            self.end_downstream()

        self.upstream = threading.Thread(target=upstream, daemon=True)
        self.upstream.start()
        return {"port": listener.port}

    def link(self, msg: dict) -> dict:
        """``link {addr, port, secret}`` -> ``{ok}``: every file received is passed on there."""
        try:
            self.downstream = connect(str(msg["addr"]), int(msg["port"]), str(msg["secret"]))
        except OSError as exc:
            return {"ok": False, "problem": f"cannot reach {msg['addr']}:{msg['port']}: "
                    f"{exc.strerror or exc}"}
        return {"ok": True}

    def announce(self, msg: dict) -> None:
        """A file's ``blob`` frame, to the next node ahead of its bytes."""
        if self.downstream is not None:
            self.forward(encode(Kind.BLOB, msg))

    def forward(self, data: bytes) -> None:
        """To the next node; a next node gone is dropped (the head sends it what it lacks)."""
        if self.downstream is None:
            return
        try:
            self.downstream.sendall(data)
        except OSError:
            self.end_downstream()

    def end_downstream(self) -> None:
        if self.downstream is not None:
            try:
                self.downstream.close()
            except OSError:
                pass
            self.downstream = None

    def finish(self) -> None:
        """Every file of the chain in (or its upstream gone), the next node told so (EOF): what
        this node has now is all the relay brings it."""
        if self.upstream is not None:
            self.upstream.join()
            self.upstream = None
        self.end_downstream()
