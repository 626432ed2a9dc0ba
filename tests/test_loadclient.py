"""The benchmarks' HTTP/1.1 load generator (``engine.cli.loadclient``) against a raw socket
server that writes its answers byte by byte as the test says: server-sent events split
anywhere, as the ``openai`` client's own SSE decoder reads the same bytes; keep-alive, a
server that closes, a connection cut mid-answer, and the concurrency bound."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable, Iterator

import orjson
import pytest
from openai._streaming import SSEDecoder

from engine.cli.loadclient import Exchange, LoadClient, LoadClientError, request_json

Handler = Callable[[socket.socket, bytes, int], bool]  # (conn, request, n) -> keep alive?


class RawServer:
    """Accepts connections; reads each request head and its Content-Length body, then
    hands the socket to ``handler``, which writes the answer and says whether the
    connection stays open for the next request."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        pending = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in pending:
                    data = conn.recv(65536)
                    if not data:
                        return
                    pending += data
                head, _, pending = pending.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(pending) < length:
                    pending += conn.recv(65536)
                body, pending = pending[:length], pending[length:]
                with self.lock:
                    self.requests += 1
                    n = self.requests
                    self.in_flight += 1
                    self.max_in_flight = max(self.max_in_flight, self.in_flight)
                try:
                    keep = self.handler(conn, head + b"\r\n\r\n" + body, n)
                finally:
                    with self.lock:
                        self.in_flight -= 1
                if not keep:
                    return

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def serve() -> Iterator[Callable[[Handler], RawServer]]:
    servers: list[RawServer] = []

    def start(handler: Handler) -> RawServer:
        servers.append(RawServer(handler))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def chunked(pieces: list[bytes]) -> list[bytes]:
    """``pieces`` as HTTP/1.1 chunks, the last chunk after them."""
    return [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p] + [b"0\r\n\r\n"]


class Events(Exchange):
    def __init__(self, path: str = "/events", json: object = None) -> None:
        super().__init__("POST", path, json if json is not None else {"ask": 1})
        self.events: list[bytes] = []
        self.body_seen: bytes | None = None
        self.error: str | None = None

    def on_event(self, data: bytes, now: float) -> None:
        self.events.append(data)

    def on_body(self, body: bytes) -> None:
        self.body_seen = body

    def on_end(self, now: float, error: str) -> None:
        self.error = error


def test_events_split_anywhere_read_as_openai_reads_them(serve) -> None:
    rng = random.Random(7)
    stream = b"".join([
        b'data: {"a": 1}\n\n',
        b": a comment line, no event\n\n",
        b"event: named\r\ndata: first line\r\ndata: second line\r\n\r\n",
        b'data: {"text": "caf\xc3\xa9 \\n"}\r\n\r\n',
        b"data:no space after the colon\n\n",
        b"id: 4\nretry: 10\n\n",
        b'data: {"b": 2}\r\rdata: [DONE]\n\n',
    ])
    # Random cuts, and one after every CR: a CR LF split across two reads is one line end.
    cuts = sorted(set(rng.sample(range(1, len(stream)), 40))
                  | {i + 1 for i, byte in enumerate(stream) if byte == 13})
    pieces = [stream[i:j] for i, j in zip([0, *cuts], [*cuts, len(stream)], strict=True)]

    def handler(conn: socket.socket, request: bytes, n: int) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        for piece in chunked(pieces):
            conn.sendall(piece)
            time.sleep(0.001)  # separate reads on the client side
        return True

    server = serve(handler)
    exchange = Events()
    with LoadClient(server.url) as client:
        client.run([exchange])
    expected = [sse.data.encode() for sse in SSEDecoder().iter_bytes(iter([stream]))
                if sse.data]
    assert exchange.error == ""
    assert exchange.status == 200
    assert exchange.events == expected
    assert len(expected) == 6  # the comment and the id/retry-only event carry no data


def test_keep_alive_connection_close_and_a_server_that_closed(serve) -> None:
    def handler(conn: socket.socket, request: bytes, n: int) -> bool:
        body = orjson.dumps({"n": n, "echo": orjson.loads(request.split(b"\r\n\r\n", 1)[1])})
        close = b"connection: close" in request.lower()
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n%s\r\n%s" % (
                         len(body), b"connection: close\r\n" if close else b"", body))
        # The third request's connection is closed by the server right after it, as an
        # idle keep-alive timeout would, without saying so.
        return not close and n != 3

    server = serve(handler)
    with LoadClient(server.url) as client:
        answers = [request_json(client, "POST", "/x", {"i": i}) for i in range(3)]
        assert server.connections == 1  # kept alive
        time.sleep(0.05)
        # The pooled connection is dead now: the request goes again on a new one.
        answers.append(request_json(client, "POST", "/x", {"i": 3}))
        assert server.connections == 2
        answers.append(request_json(client, "POST", "/x", {"i": 4},
                                    headers={"Connection": "close"}))
        answers.append(request_json(client, "POST", "/x", {"i": 5}))
        assert server.connections == 3
    assert [(status, body["echo"]["i"]) for status, body in answers] == [
        (200, i) for i in range(6)]


def test_a_cut_answer_is_an_error_and_the_others_finish(serve) -> None:
    def handler(conn: socket.socket, request: bytes, n: int) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        pieces = chunked([b"data: 1\n\n", b"data: 2\n\n"])
        if b"cut" in request:
            conn.sendall(pieces[0])
            conn.shutdown(socket.SHUT_RDWR)
            return False
        for piece in pieces:
            conn.sendall(piece)
        return True

    server = serve(handler)
    exchanges = [Events(json={"cut": True}), Events(json={"whole": True})]
    with LoadClient(server.url) as client:
        client.run(exchanges)
    cut, whole = exchanges
    assert cut.events == [b"1"] and cut.error
    assert whole.events == [b"1", b"2"] and whole.error == ""


def test_no_server_is_an_error_per_exchange() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    exchanges = [Events(), Events()]
    with LoadClient(f"http://127.0.0.1:{port}") as client:
        client.run(exchanges)
        with pytest.raises(LoadClientError):
            request_json(client, "GET", "/v1/models")
    assert all("cannot connect" in e.error for e in exchanges)


def test_at_most_max_concurrency_in_flight_and_every_answer_read(serve) -> None:
    def handler(conn: socket.socket, request: bytes, n: int) -> bool:
        time.sleep(0.02)
        body = b'{"ok": true}'
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        return True

    server = serve(handler)
    exchanges = [Events(path=f"/r{i}") for i in range(12)]
    with LoadClient(server.url) as client:
        client.run(exchanges, max_concurrency=3)
    assert server.max_in_flight == 3
    assert server.connections == 3
    assert [e.body_seen for e in exchanges] == [b'{"ok": true}'] * 12
