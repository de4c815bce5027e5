"""`monitor --serve`'s HTTP server: one thread, one ``selectors`` loop, every connection
bounded (M5).

prometheus_client's own server gives each connection a thread with no read timeout, so
anyone who can connect (another user of the head, with the default localhost) holds as many
threads of ours as they open sockets. Here a connection costs a socket and a small buffer:
reads are event-driven; a connection without a complete request within ``idle`` s (10 by
default, again after each answer) is closed; a request longer than :data:`MAX_REQUEST` is
answered 431 and closed; over ``most`` connections the oldest idle one is closed, never the
new one; the soft limit of open files is raised to the hard one at start. The exposition is
made at most once per ``cache`` s whatever the number of scrapes. Optional: a bearer token
(Prometheus' ``authorization: {credentials_file: FILE}``), compared with
``hmac.compare_digest``, and TLS (``ssl``, the handshake driven by the same loop).

HTTP/1.1 as a scraper speaks it: ``GET``/``HEAD`` of ``/metrics`` (``/`` too), keep-alive unless
``Connection: close`` (or HTTP/1.0), no request body.
"""

from __future__ import annotations

import gzip
import hmac
import resource
import selectors
import socket
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ptcluster.errors import PtclusterError, UsageError

MAX_REQUEST = 8192
"""Longest request head (request line and headers) answered."""
PATHS = ("/metrics", "/")


def raise_open_files() -> int:
    """The soft limit of open files raised to the hard one (where it is lower); the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def read_token(path: str) -> str:
    """The bearer token in ``path`` (its whitespace stripped, as Prometheus'
    ``credentials_file``); refused when empty or readable by others (it is a secret)."""
    try:
        st = Path(path).stat()
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--serve-token-file {path}: cannot be read: {exc}") from None
    if st.st_mode & 0o004:
        raise UsageError(f"--serve-token-file {path}: others can read it",
                         f"chmod o-r {path} (its group may read it: Prometheus' own)")
    if not token or any(c.isspace() or not c.isprintable() for c in token):
        raise UsageError(f"--serve-token-file {path}: not one token (empty, or with spaces "
                         "or control characters inside)")
    return token


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    """A TLS server context of ``cert`` and ``key`` (PEM), TLS 1.2 at least."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise PtclusterError(f"--serve-cert {cert} --serve-key {key}: cannot be loaded: {exc}",
                             "give a PEM certificate and its PEM private key") from None
    return context


@dataclass
class Conn:
    sock: socket.socket
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytes = b""
    shaking: bool = False
    """A TLS handshake not done yet."""
    close_after: bool = False


@dataclass(frozen=True)
class Answer:
    status: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


class MetricsServer:
    """``body()`` (the exposition) on ``addr:port``; ``token``: the bearer token every request
    must carry (None: none asked); ``tls``: a server context (None: plain HTTP). ``start()``
    serves on a thread of its own until ``shutdown()``; ``server_close()`` closes every socket."""

    def __init__(self, body: Callable[[], bytes], content_type: str, addr: str, port: int, *,
                 token: str | None = None, tls: ssl.SSLContext | None = None,
                 idle: float = 10.0, most: int | None = None, cache: float = 1.0) -> None:
        self.body, self.content_type = body, content_type
        self.token = None if token is None else token.encode()
        self.tls, self.idle, self.cache = tls, idle, cache
        limit = raise_open_files()
        self.most = most or max(16, min(limit - 64, 1 << 16))
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.listener.bind((addr, port))
            self.listener.listen(1024)
        except OSError:
            self.listener.close()
            raise
        self.listener.setblocking(False)
        self.server_address = self.listener.getsockname()
        self.conns: OrderedDict[socket.socket, tuple[Conn, float]] = OrderedDict()
        """Every open connection, the one whose deadline comes first first (its deadline)."""
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self._wake_r, self._wake_w = socket.socketpair()
        self.selector.register(self._wake_r, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._made: tuple[float, dict[bool, bytes]] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> MetricsServer:
        self._thread = threading.Thread(target=self.serve, name="metrics", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        self._stop.set()
        self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(10.0)

    def server_close(self) -> None:
        for sock in list(self.conns):
            self._drop(sock)
        for s in (self.listener, self._wake_r, self._wake_w):
            s.close()
        self.selector.close()

    def serve(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            self._expire(now)
            wait = min(1.0, max(0.0, next(iter(self.conns.values()))[1] - now)) \
                if self.conns else 1.0
            for key, events in self.selector.select(wait):
                if key.fileobj is self.listener:
                    self._accept()
                elif key.fileobj is not self._wake_r:
                    self._ready(key.fileobj, events)  # type: ignore[arg-type]

    def _expire(self, now: float) -> None:
        while self.conns:
            sock, (_, deadline) = next(iter(self.conns.items()))
            if deadline > now:
                return
            self._drop(sock)

    def _accept(self) -> None:
        for _ in range(256):  # (then the loop looks at the others again)
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # (out of files: the oldest idle connection makes room)
                if not self._evict():
                    return
                continue
            while len(self.conns) >= self.most and self._evict():
                pass
            self._add(sock)

    def _add(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        conn = Conn(sock)
        if self.tls is not None:
            try:
                conn.sock = self.tls.wrap_socket(sock, server_side=True,
                                                 do_handshake_on_connect=False)
            except (OSError, ValueError):
                sock.close()
                return
            conn.shaking = True
        self.conns[conn.sock] = (conn, time.monotonic() + self.idle)
        self.selector.register(conn.sock, selectors.EVENT_READ, conn)

    def _evict(self) -> bool:
        """Closes the oldest connection that is not being answered; whether there was one."""
        for sock, (conn, _) in self.conns.items():
            if not conn.outbox:
                self._drop(sock)
                return True
        return False

    def _drop(self, sock: socket.socket) -> None:
        self.conns.pop(sock, None)
        try:
            self.selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    def _ready(self, sock: socket.socket, events: int) -> None:
        entry = self.conns.get(sock)
        if entry is None:
            return
        conn = entry[0]
        try:
            if conn.shaking:
                conn.sock.do_handshake()  # type: ignore[attr-defined]
                conn.shaking = False
            if conn.outbox:
                self._send(conn)
            elif not self._receive(conn):
                self._drop(sock)
                return
            if conn.sock in self.conns and not conn.outbox:
                self._answer_next(conn)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
            return
        except OSError:  # (ssl.SSLError included: a peer that is gone or speaks no TLS)
            self._drop(sock)

    def _receive(self, conn: Conn) -> bool:
        """Whatever the peer sent; False when it closed."""
        while len(conn.inbox) <= MAX_REQUEST:
            try:
                got = conn.sock.recv(MAX_REQUEST + 1)
            except (ssl.SSLWantReadError, BlockingIOError):
                return True
            if not got:
                return False
            conn.inbox += got
        return True

    def _answer_next(self, conn: Conn) -> None:
        """The next complete request of ``conn`` answered (or its end, when it sent too much)."""
        end = conn.inbox.find(b"\r\n\r\n")
        if end < 0:
            if len(conn.inbox) > MAX_REQUEST:
                self._reply(conn, Answer("431 Request Header Fields Too Large", b"too long\n"),
                            close=True)
            return
        head, conn.inbox = bytes(conn.inbox[:end]), conn.inbox[end + 4:]
        answer, close, method = self._handle(head)
        self._reply(conn, answer, close, method == "HEAD")

    def _handle(self, head: bytes) -> tuple[Answer, bool, str]:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return Answer("400 Bad Request", b"bad request\n"), True, ""
        method, target, version = parts
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        connection = headers.get("connection", "").lower()
        close = connection == "close" or (version == "HTTP/1.0" and connection != "keep-alive")
        if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
            return Answer("400 Bad Request", b"no body, please\n"), True, method
        if method not in ("GET", "HEAD"):
            return Answer("405 Method Not Allowed", b"GET only\n", (("Allow", "GET, HEAD"),)), \
                close, method
        if self.token is not None and not self._authorized(headers.get("authorization", "")):
            return Answer("401 Unauthorized", b"a bearer token is needed\n",
                          (("WWW-Authenticate", 'Bearer realm="ptcluster"'),)), close, method
        if target.partition("?")[0] not in PATHS:
            return Answer("404 Not Found", b"see /metrics\n"), close, method
        gz = "gzip" in headers.get("accept-encoding", "").lower()
        try:
            body = self._exposition(gz)
        except Exception:  # noqa: BLE001 - a scrape fails, the server goes on
            return Answer("500 Internal Server Error", b"the exposition failed\n"), close, method
        return Answer("200 OK", body, (("Content-Type", self.content_type),
                                       *((("Content-Encoding", "gzip"),) if gz else ()))), \
            close, method

    def _authorized(self, given: str) -> bool:
        scheme, _, credentials = given.partition(" ")
        assert self.token is not None
        return hmac.compare_digest(credentials.strip().encode(), self.token) \
            and scheme.lower() == "bearer"

    def _exposition(self, gz: bool) -> bytes:
        """The exposition (gzipped: Prometheus asks so), made anew at most every ``cache`` s."""
        now = time.monotonic()
        if self._made is None or now - self._made[0] >= self.cache:
            self._made = (now, {False: self.body()})
        made = self._made[1]
        if gz not in made:
            made[gz] = gzip.compress(made[False], compresslevel=6)
        return made[gz]

    def _reply(self, conn: Conn, answer: Answer, close: bool, head_only: bool = False) -> None:
        lines = [f"HTTP/1.1 {answer.status}", f"Content-Length: {len(answer.body)}",
                 *(f"{k}: {v}" for k, v in answer.headers),
                 "Connection: " + ("close" if close else "keep-alive")]
        conn.outbox = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + \
            (b"" if head_only else answer.body)
        conn.close_after = close
        self.selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
        self._send(conn)

    def _send(self, conn: Conn) -> None:
        while conn.outbox:
            sent = conn.sock.send(conn.outbox)  # (raises BlockingIOError when full)
            conn.outbox = conn.outbox[sent:]
        if conn.close_after:
            self._drop(conn.sock)
            return
        self.selector.modify(conn.sock, selectors.EVENT_READ, conn)
        self.conns[conn.sock] = (conn, time.monotonic() + self.idle)
        self.conns.move_to_end(conn.sock)
