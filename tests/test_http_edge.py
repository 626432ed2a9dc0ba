"""The connection edge: early answers drain their body, closing closes, idle connections
time out, header limits. Raw sockets against the real hypercorn server (fake engine)."""

from __future__ import annotations

import re
import socket
import time

import httpx
import pytest
from http_fake_engine import open_fake_engine
from http_server import ServerThread

from engine.http import edge
from engine.models.testing import write_tiny_model
from engine.models.tokenizer import Tokenizer

MAX_REQUEST_BYTES = 4096
# Shortened for the test (the served default is edge.KEEP_ALIVE_SECONDS).
KEEP_ALIVE = 0.5
READ_LIMIT = 10.0  # hang guard for one socket read


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tokenizer = Tokenizer.from_folder(write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"))
    opener = lambda: open_fake_engine(  # noqa: E731
        tokenizer, step_delay=0.001, max_model_len=256, served_model_name="tiny")
    patch = pytest.MonkeyPatch()
    patch.setattr(edge, "KEEP_ALIVE_SECONDS", KEEP_ALIVE)
    try:
        with ServerThread(opener, max_request_bytes=MAX_REQUEST_BYTES) as srv:
            yield srv
    finally:
        patch.undo()


@pytest.fixture(scope="module")
def h2c_server(tmp_path_factory):
    """The same server with cleartext HTTP/2 (--enable-h2c)."""
    tokenizer = Tokenizer.from_folder(write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"))
    opener = lambda: open_fake_engine(  # noqa: E731
        tokenizer, step_delay=0.001, max_model_len=256, served_model_name="tiny")
    patch = pytest.MonkeyPatch()
    patch.setattr(edge, "KEEP_ALIVE_SECONDS", KEEP_ALIVE)
    try:
        with ServerThread(opener, max_request_bytes=MAX_REQUEST_BYTES,
                          serve_options={"enable_h2c": True}) as srv:
            yield srv
    finally:
        patch.undo()


def _connect(server) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(READ_LIMIT)
    return sock


def _read_response(sock: socket.socket) -> tuple[int, bytes, bytes]:
    """(status, head, body) of one Content-Length response."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed mid-response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head, re.IGNORECASE).group(1))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return int(head.split()[1]), head, body


def _post_head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {length}\r\n\r\n").encode()


HEALTH = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"


def test_connection_close_is_honoured(server) -> None:
    # Regression: hypercorn's trio worker never shut the socket (its close ran in a
    # cancelled task), so the client waited for an EOF that never came.
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert _read_response(sock)[0] == 200
        assert sock.recv(1) == b""


def test_an_idle_keep_alive_connection_is_closed(server) -> None:
    with _connect(server) as sock:
        sock.sendall(HEALTH)
        assert _read_response(sock)[0] == 200
        t0 = time.monotonic()
        assert sock.recv(1) == b""
        assert time.monotonic() - t0 < READ_LIMIT


def test_a_413_sent_before_the_body_drains_it_and_the_connection_goes_on(server) -> None:
    # Regression: after an early 413 the next request on the keep-alive connection never
    # got an answer (the unread body stayed in the way).
    body = b"x" * (MAX_REQUEST_BYTES * 3)
    with _connect(server) as sock:
        sock.sendall(_post_head("/v1/completions", len(body)))
        status, _, answer = _read_response(sock)  # answered before any body byte
        assert status == 413 and b"request_too_large" in answer
        sock.sendall(body + HEALTH)
        assert _read_response(sock)[0] == 200


@pytest.mark.parametrize(("path", "status"), [("/nowhere", 404), ("/v1/models", 405)])
def test_an_early_error_with_an_unread_body_leaves_the_connection_usable(server, path, status) -> None:
    body = b'{"prompt": "' + b"a" * 2000 + b'"}'
    with _connect(server) as sock:
        sock.sendall(_post_head(path, len(body)))
        assert _read_response(sock)[0] == status
        sock.sendall(body + HEALTH)
        assert _read_response(sock)[0] == 200


def test_a_chunked_body_is_counted_as_it_arrives_and_refused_with_413(server) -> None:
    # Regression: a 10 MB chunked body was not refused; the client timed out after two
    # minutes. httpx sends the whole body before it reads, so it also shows the drain.
    def chunks():
        for _ in range(1024):
            yield b"a" * 1024  # 1 MiB in all, 256x the limit

    with httpx.Client(base_url=server.base_url, timeout=READ_LIMIT) as client:
        response = client.post("/v1/completions", content=chunks(),
                               headers={"content-type": "application/json"})
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"
        assert client.get("/health").status_code == 200  # same pooled connection


def test_too_many_or_too_large_headers_get_431_and_a_huge_head_400(server) -> None:
    many = "".join(f"x-h{i}: v\r\n" for i in range(edge.MAX_HEADERS + 1))
    large = "x-big: " + "a" * edge.MAX_HEADER_BYTES + "\r\n"
    for extra in (many, large):
        with _connect(server) as sock:
            sock.sendall(f"GET /health HTTP/1.1\r\nhost: x\r\n{extra}\r\n".encode())
            status, _, body = _read_response(sock)
            assert status == 431 and b"headers_too_large" in body
    # A head far past the limit is refused too (by h11 when it arrives in pieces).
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 200_000 + b"\r\n\r\n")
        assert _read_response(sock)[0] in (400, 431)


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def test_an_idle_http2_connection_is_closed_like_an_http1_one(h2c_server) -> None:
    # Regression: a connection that sent only the HTTP/2 preface (and its SETTINGS) was
    # never closed; 450 of them used up the server's file descriptors.
    import h2.connection

    client = h2.connection.H2Connection()
    client.initiate_connection()
    with _connect(h2c_server) as sock:
        sock.sendall(client.data_to_send())
        t0 = time.monotonic()
        while sock.recv(65536):  # the server's SETTINGS, then its close
            pass
        assert time.monotonic() - t0 < READ_LIMIT


def test_an_http2_connection_closes_once_its_last_stream_is_done(h2c_server) -> None:
    import h2.connection
    import h2.events

    client = h2.connection.H2Connection()
    client.initiate_connection()
    stream = client.get_next_available_stream_id()
    client.send_headers(stream, [(":method", "GET"), (":path", "/health"), (":scheme", "http"),
                                 (":authority", "x")], end_stream=True)
    events = []
    with _connect(h2c_server) as sock:
        sock.sendall(client.data_to_send())
        while data := sock.recv(65536):
            events.extend(client.receive_data(data))
            sock.sendall(client.data_to_send())
    assert any(isinstance(e, h2.events.StreamEnded) and e.stream_id == stream for e in events)


@pytest.mark.parametrize("coding", [b"xchunked", b"gzip, chunked", b"chunked, xchunked"])
def test_an_unknown_transfer_coding_gets_501(server, coding: bytes) -> None:
    with _connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ntransfer-encoding: " + coding + b"\r\n\r\n")
        # The body after the head, as a client that waits for nothing sends it.
        sock.sendall(b"5\r\nhello\r\n0\r\n\r\n")
        status, head, _ = _read_response(sock)
        assert status == 501
        assert sock.recv(1) == b""  # and the connection is closed
