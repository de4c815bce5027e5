"""The relay of ``ptcluster push``: a node stores each file as it arrives and passes it on to
the next node of a chain (head -> n1 -> n2 -> ...), so that the head sends each byte once.

A listener binds to this node's cluster address only (the head says which) and accepts one
connection: from the upstream peer's address, that first sends this push's secret (random, per
push, told each node over the head's own channel), compared with ``hmac.compare_digest`` before
any other byte is read; anything else is closed and the listener waits on. Standard library
only; a part of the push program (``node.data_agent``).

A peer whose link is cut sends no FIN: without more, the node after it would wait
``STREAM_TIMEOUT`` on its socket and the one before it would block in a send. Both ends of a
relay connection ask the kernel instead (``keep_alive``): after ``PROBE_IDLE`` s without a
packet it sends probes, which the peer's kernel answers however long its program waits on its
own upstream (a healthy relay is never taken for a lost one), and ``TCP_USER_TIMEOUT`` ends
the connection once probes or sent data went unacknowledged ``PEER_LOST`` s: a cut peer is
dropped in about that long (tcp(7)), and the head sends what it lacks itself.
"""

import hmac
import socket
import time

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
