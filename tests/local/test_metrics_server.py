"""`monitor --serve`'s server (M5, `monitor.httpd`), real sockets against it: a scrape is
answered while 2,000 idle connections are open; an idle connection is closed after its
timeout; over the cap the oldest idle one goes, never the new one; a request head is
bounded; the exposition is made at most once a second; a bearer token and TLS when asked."""

from __future__ import annotations

import resource
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ptcluster.errors import UsageError
from ptcluster.monitor import httpd, metrics
from ptcluster.monitor.httpd import MAX_REQUEST, MetricsServer
from tests.unit.test_metrics import NOW, views

GET = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"


def exporter() -> metrics.Exporter:
    return metrics.Exporter(views, dict, stale=8.0, clock=lambda: NOW)


@pytest.fixture
def serving(request: pytest.FixtureRequest) -> Iterator[MetricsServer]:
    server = metrics.serve(exporter(), "127.0.0.1", 0, **getattr(request, "param", {}))
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def connect(server: MetricsServer) -> socket.socket:
    return socket.create_connection(server.server_address[:2], timeout=10)


def answer(sock: socket.socket, request: bytes = GET) -> tuple[str, bytes]:
    """The status line and body of the answer to ``request`` on ``sock``."""
    sock.sendall(request)
    got = b""
    while b"\r\n\r\n" not in got:
        more = sock.recv(65536)
        assert more, got
        got += more
    head, _, body = got.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length and not request.startswith(b"HEAD"):
        body += sock.recv(65536)
    return head.split(b"\r\n")[0].decode(), body


def closed(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_a_scrape_is_answered_within_a_second_while_2000_idle_connections_are_open(
        serving: MetricsServer) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 4200:
        pytest.skip(f"2,000 connections both ends need 4,200 files; the hard limit is {hard}")
    idle = [connect(serving) for _ in range(2000)]
    try:
        for s in idle[::100]:
            s.send(b"GET /metr")  # (some half a request)
        time.sleep(0.5)  # (every one accepted)
        sock = connect(serving)
        t0 = time.monotonic()
        status, body = answer(sock)
        took = time.monotonic() - t0
        sock.close()
        assert status == "HTTP/1.1 200 OK" and b"ptcluster_node_up" in body
        assert took < 1.0, took
        print(f"scrape with 2,000 idle connections open: {took * 1000:.1f} ms")
        assert len(serving.conns) >= 2000  # (none was dropped to answer it)
    finally:
        for s in idle:
            s.close()


@pytest.mark.parametrize("serving", [{"idle": 0.5}], indirect=True)
def test_a_connection_without_a_whole_request_is_closed_after_the_timeout(
        serving: MetricsServer) -> None:
    half, kept = connect(serving), connect(serving)
    half.send(b"GET /metrics HTTP/1.1\r\n")  # (never ends its head)
    assert answer(kept)[0] == "HTTP/1.1 200 OK"
    t0 = time.monotonic()
    assert closed(half, 5.0) and closed(kept, 5.0)  # (idle again after its answer)
    assert 0.3 < time.monotonic() - t0 < 2.0
    assert not serving.conns


def test_over_the_cap_the_oldest_idle_connection_goes_never_the_new_one() -> None:
    server = MetricsServer(lambda: b"x 1\n", "text/plain", "127.0.0.1", 0, most=5).start()
    try:
        old = [connect(server) for _ in range(5)]
        time.sleep(0.3)
        new = connect(server)
        assert answer(new)[0] == "HTTP/1.1 200 OK"
        assert closed(old[0], 2.0)
        assert not any(closed(s, 0.05) for s in old[1:])
        assert len(server.conns) == 5
    finally:
        server.shutdown()
        server.server_close()


def test_a_request_head_longer_than_the_limit_is_refused_and_closed(
        serving: MetricsServer) -> None:
    sock = connect(serving)
    status, _ = answer(sock, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * MAX_REQUEST)
    assert status.startswith("HTTP/1.1 431") and closed(sock, 2.0)


def test_the_exposition_is_made_at_most_once_a_second() -> None:
    made = []
    server = MetricsServer(lambda: made.append(1) or b"x 1\n", "text/plain", "127.0.0.1", 0,
                           cache=1.0).start()
    try:
        sock = connect(server)
        for _ in range(20):
            assert answer(sock)[0] == "HTTP/1.1 200 OK"  # (keep-alive: one connection)
        assert len(made) == 1
        time.sleep(1.1)
        answer(sock)
        assert len(made) == 2
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("serving", [{"token": "s3cret-token"}], indirect=True)
def test_a_token_is_asked_when_set(serving: MetricsServer) -> None:
    for header in (b"", b"Authorization: Bearer wrong\r\n",
                   b"Authorization: Basic s3cret-token\r\n"):
        sock = connect(serving)
        status, body = answer(sock, b"GET /metrics HTTP/1.1\r\n" + header + b"\r\n")
        assert status == "HTTP/1.1 401 Unauthorized" and b"ptcluster" not in body, header
        sock.close()
    sock = connect(serving)
    status, body = answer(sock, b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer s3cret-token"
                                b"\r\n\r\n")
    assert status == "HTTP/1.1 200 OK" and b"ptcluster_node_up" in body


def test_a_token_file_others_can_read_or_that_is_empty_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text("t0ken\n")
    f.chmod(0o640)
    assert httpd.read_token(str(f)) == "t0ken"
    f.chmod(0o644)
    with pytest.raises(UsageError, match="others can read it"):
        httpd.read_token(str(f))
    f.chmod(0o600)
    f.write_text("  \n")
    with pytest.raises(UsageError, match="not one token"):
        httpd.read_token(str(f))


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl here to make a self-signed certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


def test_tls_with_a_self_signed_certificate(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    server = metrics.serve(exporter(), "127.0.0.1", 0,
                           tls=httpd.tls_context(str(cert), str(key)), idle=2.0)
    try:
        client = ssl.create_default_context(cafile=str(cert))
        with client.wrap_socket(connect(server), server_hostname="127.0.0.1") as sock:
            status, body = answer(sock)
        assert status == "HTTP/1.1 200 OK" and b"ptcluster_node_up" in body
        plain = connect(server)  # (no TLS spoken: an answer in clear text never comes)
        plain.sendall(GET)
        assert closed(plain, 5.0)
    finally:
        server.shutdown()
        server.server_close()
