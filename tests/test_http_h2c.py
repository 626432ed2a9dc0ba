"""Cleartext HTTP/2 only with ``--enable-h2c`` (issue 28: hypercorn served prior-knowledge
h2 and the ``Upgrade: h2c`` dance on the plain port, though the docs offer HTTP/2 with TLS
only). The client side is the ``h2`` package (hypercorn's own HTTP/2 dependency), on raw
loopback sockets."""

from __future__ import annotations

import socket

import h2.config
import h2.connection
import h2.events
import pytest
from http_fake_engine import open_fake_engine
from http_server import ServerThread

from engine.models.testing import write_tiny_model
from engine.models.tokenizer import Tokenizer

TIMEOUT = 30.0  # hang guard for one socket read


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_folder(write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"))


@pytest.fixture(scope="module", params=[False, True], ids=["default", "enable_h2c"])
def server(request, tokenizer):
    opener = lambda: open_fake_engine(tokenizer, served_model_name="tiny")  # noqa: E731
    with ServerThread(opener, serve_options={"enable_h2c": request.param}) as srv:
        srv.h2c = request.param
        yield srv


def _connect(server: ServerThread) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _h2_get(sock: socket.socket, conn: h2.connection.H2Connection, path: str,
            stream_id: int = 1) -> dict[bytes, bytes]:
    """Send GET ``path`` on ``stream_id`` (unless it is the upgrade's stream 1, already
    sent) and read until its response headers arrive; returns them."""
    if stream_id != 1 or not conn.streams:
        conn.send_headers(stream_id, [(":method", "GET"), (":path", path),
                                      (":scheme", "http"), (":authority", "x")],
                          end_stream=True)
    sock.sendall(conn.data_to_send())
    while True:
        data = sock.recv(65536)
        assert data, "the server closed the HTTP/2 connection"
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived) and event.stream_id == stream_id:
                return dict(event.headers)
        sock.sendall(conn.data_to_send())


def test_prior_knowledge_http2_in_cleartext_only_with_enable_h2c(server) -> None:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    with _connect(server) as sock:
        if not server.h2c:
            sock.sendall(conn.data_to_send())
            answer = _read_all(sock)  # the server closes after its answer
            assert answer.startswith(b"HTTP/1.1 505 "), answer
            assert b"--enable-h2c" in answer
            return
        headers = _h2_get(sock, conn, "/health")
        assert headers[b":status"] == b"200"


def test_an_h2c_upgrade_is_answered_in_http1_unless_enabled(server) -> None:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    settings = conn.initiate_upgrade_connection()  # the HTTP2-Settings value, base64url
    request = (b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: Upgrade, HTTP2-Settings\r\n"
               b"upgrade: h2c\r\nhttp2-settings: " + settings + b"\r\n\r\n")
    with _connect(server) as sock:
        sock.sendall(request)
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(65536)
            assert chunk, head
            head += chunk
        if not server.h2c:
            assert head.startswith(b"HTTP/1.1 200 "), head
            return
        assert head.startswith(b"HTTP/1.1 101 "), head
        # The rest is HTTP/2: the answer to the upgraded request on stream 1.
        for event in conn.receive_data(head.partition(b"\r\n\r\n")[2]):
            if isinstance(event, h2.events.ResponseReceived):
                assert dict(event.headers)[b":status"] == b"200"
                return
        assert _h2_get(sock, conn, "/health", stream_id=1)[b":status"] == b"200"


def test_plain_http1_is_served_either_way(server) -> None:
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert _read_all(sock).startswith(b"HTTP/1.1 200 ")
