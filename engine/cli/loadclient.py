"""A lean HTTP/1.1 load generator: one thread, one ``selectors`` loop over keep-alive
connections, h11 for the framing, server-sent events split as they arrive.

A load generator on the same machine as the server takes its CPU from the server's
cores, so it has to be cheap. On the two-core dev host, streaming SmolLM2's tokens at
concurrency 1, httpx under trio spent about 440 µs of CPU a token; a bare trio socket
read, with no HTTP at all, 220-250 µs (trio's run loop costs 50-60 µs a wake-up on an
idle host, more beside a busy model); a blocking ``recv``, 60-75 µs. This loop pays
one ``epoll`` wait and one ``recv`` per readable socket, then h11's parser. It speaks
what the benchmarks need (JSON bodies, streamed or whole answers, ``http`` and
``https``); user-facing code talks to servers with the ``openai`` client or httpx.

Each request is an :class:`Exchange`; :func:`run_exchanges` sends them (at most
``max_concurrency`` in flight, Poisson arrivals at ``request_rate`` a second) and calls
their hooks as the answers arrive.
"""

from __future__ import annotations

import math
import random
import selectors
import socket
import ssl
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

import h11
import orjson

_READ = 65536


class LoadClientError(Exception):
    """The server could not be reached, or broke HTTP/1.1."""


class Exchange:
    """One request and its answer. Subclasses read the answer through the hooks:
    :meth:`on_head` (the status), :meth:`on_event` (each server-sent event's data, for a
    ``text/event-stream`` answer) or :meth:`on_body` (every other answer's body, whole),
    then :meth:`on_end` (``error`` is "" when the exchange completed)."""

    def __init__(self, method: str, path: str, json: Any = None,
                 headers: dict[str, str] | None = None) -> None:
        self.method, self.path = method, path
        self.body = b"" if json is None else orjson.dumps(json)
        self.has_json = json is not None
        self.headers = headers or {}
        self.status = 0
        self.started = 0.0  # perf_counter when the request went out
        self._sse = False
        self._pending = b""
        self._chunks: list[bytes] = []
        self._retried = False

    # -- hooks ---------------------------------------------------------------------------

    def on_head(self, status: int, headers: dict[str, str]) -> None:
        pass

    def on_event(self, data: bytes, now: float) -> None:
        pass

    def on_body(self, body: bytes) -> None:
        pass

    def on_end(self, now: float, error: str) -> None:
        pass

    # -- the loop's side -----------------------------------------------------------------

    def _head(self, event: h11.Response) -> None:
        self.status = event.status_code
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers}
        self._sse = headers.get("content-type", "").startswith("text/event-stream")
        self.on_head(self.status, headers)

    def _data(self, chunk: bytes, now: float) -> None:
        if not self._sse:
            self._chunks.append(chunk)
            return
        pending = self._pending + chunk if self._pending else chunk
        held = b""
        if b"\r" in pending:
            # Lines may end in CR LF or CR: both become LF. A CR at the end waits for the
            # next read, which may begin with its LF.
            if pending.endswith(b"\r"):
                pending, held = pending[:-1], b"\r"
            pending = pending.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        while (end := pending.find(b"\n\n")) >= 0:
            block, pending = pending[:end], pending[end + 2:]
            if block.startswith(b"data: ") and b"\n" not in block:
                self.on_event(block[6:], now)  # the usual event: one data line
                continue
            data = [line[5:].removeprefix(b" ") for line in block.split(b"\n")
                    if line.startswith(b"data:")]
            if data:  # an event without data (a comment, a keep-alive) is no event
                self.on_event(b"\n".join(data), now)
        self._pending = pending + held

    def _end(self, now: float, error: str) -> None:
        if not error and not self._sse:
            self.on_body(b"".join(self._chunks))
        self.on_end(now, error)


class _Connection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.h11 = h11.Connection(h11.CLIENT)
        self.exchange: Exchange | None = None
        self.reused = False  # kept alive from an earlier exchange


class LoadClient:
    """Keep-alive connections to one server (``base_url``, ``http`` or ``https``);
    ``headers`` go on every request. Not thread-safe: one :func:`run_exchanges` at a
    time."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None,
                 timeout: float | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self._tls = ssl.create_default_context() if parts.scheme == "https" else None
        self._host = parts.hostname
        self._port = parts.port or (443 if self._tls else 80)
        self._prefix = parts.path.rstrip("/")
        default_port = self._port == (443 if self._tls else 80)
        self._headers = [("host", self._host if default_port else f"{self._host}:{self._port}"),
                         ("user-agent", "engine-bench"),
                         *((k.lower(), v) for k, v in (headers or {}).items())]
        self._timeout = timeout
        self._idle: list[_Connection] = []

    def __enter__(self) -> LoadClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.sock.close()

    def _connect(self) -> _Connection:
        try:
            sock = socket.create_connection((self._host, self._port), timeout=self._timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self._host)
        except OSError as exc:
            raise LoadClientError(f"cannot connect to {self._host}:{self._port}: {exc}") from exc
        return _Connection(sock)

    def _send(self, conn: _Connection, exchange: Exchange) -> None:
        head = list(self._headers)
        if exchange.has_json:
            head.append(("content-type", "application/json"))
        head.append(("content-length", str(len(exchange.body))))
        head += [(k.lower(), v) for k, v in exchange.headers.items()]
        data = conn.h11.send(h11.Request(method=exchange.method, target=self._prefix + exchange.path,
                                         headers=head))
        data += conn.h11.send(h11.Data(data=exchange.body)) or b""
        data += conn.h11.send(h11.EndOfMessage()) or b""
        if self._tls is None:
            conn.sock.sendall(data)  # a blocking socket (with the client's timeout)
        else:
            # TLS sockets wait non-blocking in the selector: a readable socket may hold
            # only part of a record, which a blocking read would wait out.
            conn.sock.settimeout(self._timeout)
            conn.sock.sendall(data)
            conn.sock.setblocking(False)
        exchange.started = time.perf_counter()

    def run(self, exchanges: Iterable[Exchange], *, max_concurrency: int | None = None,
            request_rate: float = math.inf, rng: random.Random | None = None,
            on_done: Callable[[Exchange], None] | None = None) -> float:
        """Send every exchange, at most ``max_concurrency`` in flight, the next one
        arriving ``rng.expovariate(request_rate)`` seconds after the last (all at once
        when the rate is infinite); the seconds from the first send to the last answer.
        An exchange that fails (connection refused or reset, bad HTTP, ``timeout``
        seconds without a byte) ends with its error; the others go on."""
        queue = iter(exchanges)
        rng = rng or random.Random()
        selector = selectors.DefaultSelector()
        active: dict[int, _Connection] = {}
        next_arrival = time.perf_counter()
        exhausted = False
        first = True
        start = time.perf_counter()

        def finish(conn: _Connection, now: float, error: str, reusable: bool,
                   stale: bool = False) -> None:
            exchange = conn.exchange
            assert exchange is not None
            selector.unregister(conn.sock)
            del active[conn.sock.fileno()]
            conn.exchange = None
            if stale and not exchange._retried:
                # A kept-alive connection the server had closed before reading the
                # request: send it once more, on a new connection.
                conn.sock.close()
                exchange._retried = True
                try:
                    launch(exchange, fresh=True)
                    return
                except LoadClientError as exc:
                    error = str(exc)
            if reusable:
                conn.h11.start_next_cycle()
                conn.reused = True
                self._idle.append(conn)
            else:
                conn.sock.close()
            exchange._end(now, error)
            if on_done is not None:
                on_done(exchange)

        def launch(exchange: Exchange, fresh: bool = False) -> None:
            for attempt in (0, 1):
                conn = self._idle.pop() if self._idle and not (fresh or attempt) else self._connect()
                try:
                    self._send(conn, exchange)
                    break
                except OSError as exc:
                    conn.sock.close()
                    # A kept-alive connection the server closed meanwhile: one new one.
                    if attempt or not isinstance(exc, (BrokenPipeError, ConnectionResetError)):
                        raise LoadClientError(f"{exchange.method} {exchange.path}: {exc}") from exc
            conn.exchange = exchange
            active[conn.sock.fileno()] = conn
            selector.register(conn.sock, selectors.EVENT_READ, conn)

        try:
            while True:
                now = time.perf_counter()
                while not exhausted and now >= next_arrival and (
                        max_concurrency is None or len(active) < max_concurrency):
                    exchange = next(queue, None)
                    if exchange is None:
                        exhausted = True
                        break
                    if first:
                        start, first = now, False
                    try:
                        launch(exchange)
                    except LoadClientError as exc:
                        exchange._end(time.perf_counter(), str(exc))
                        if on_done is not None:
                            on_done(exchange)
                    if math.isfinite(request_rate):
                        next_arrival = now + rng.expovariate(request_rate)
                if exhausted and not active:
                    return time.perf_counter() - start
                arrival = not exhausted and math.isfinite(request_rate) and (
                    max_concurrency is None or len(active) < max_concurrency)
                if len(active) == 1 and not arrival and self._tls is None:
                    # One answer to wait for and nothing to send meanwhile: a blocking read
                    # on its socket, one system call instead of a poll and a read.
                    (conn,) = active.values()
                    self._readable(conn, finish)
                    continue
                wait = max(0.0, next_arrival - time.perf_counter()) if arrival else self._timeout
                ready = selector.select(wait)
                if not ready and active and not arrival:
                    now = time.perf_counter()
                    for conn in list(active.values()):
                        finish(conn, now, f"no answer in {self._timeout} s", False)
                    continue
                for key, _ in ready:
                    self._readable(key.data, finish)
        finally:
            for conn in list(active.values()):
                conn.sock.close()
            selector.close()

    def _readable(self, conn: _Connection, finish: Callable[..., None]) -> None:
        exchange = conn.exchange
        assert exchange is not None
        try:
            data = conn.sock.recv(_READ)
            if self._tls is not None:  # TLS may hold more decrypted bytes than one recv
                while conn.sock.pending():  # type: ignore[attr-defined]
                    data += conn.sock.recv(_READ)
        except (BlockingIOError, ssl.SSLWantReadError):
            return
        except TimeoutError:
            finish(conn, time.perf_counter(), f"no answer in {self._timeout} s", False)
            return
        except OSError as exc:
            now = time.perf_counter()
            finish(conn, now, f"{exchange.method} {exchange.path}: {exc}", False,
                   stale=conn.reused and not exchange.status)
            return
        now = time.perf_counter()
        h = conn.h11
        try:
            h.receive_data(data)
            while True:
                event = h.next_event()
                kind = type(event)
                if kind is h11.Data:
                    exchange._data(bytes(event.data), now)
                elif event is h11.NEED_DATA:
                    return
                elif kind is h11.Response:
                    exchange._head(event)
                elif kind is h11.EndOfMessage:
                    finish(conn, now, "", h.our_state is h11.DONE and h.their_state is h11.DONE)
                    return
                elif kind is h11.ConnectionClosed:
                    finish(conn, now, f"{exchange.method} {exchange.path}: the server closed "
                           "the connection", False, stale=conn.reused and not exchange.status)
                    return
                # InformationalResponse (100 Continue) and anything else: read on
        except h11.ProtocolError as exc:
            # Closed before any answer, on a kept-alive connection: the server had closed
            # it idle (its keep-alive timeout) as the request went out.
            stale = conn.reused and not exchange.status and not data
            finish(conn, now, f"{exchange.method} {exchange.path}: bad HTTP from the server: "
                   f"{exc}", False, stale=stale)


class JSONExchange(Exchange):
    """A request whose whole answer is JSON: ``result`` after the run."""

    result: Any = None
    error = ""

    def on_body(self, body: bytes) -> None:
        try:
            self.result = orjson.loads(body) if body else None
        except orjson.JSONDecodeError:
            self.result = body

    def on_end(self, now: float, error: str) -> None:
        self.error = error


def request_json(client: LoadClient, method: str, path: str, json: Any = None,
                 headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """One request, answered whole: (status, the answer's JSON, or its bytes when it is
    not JSON). Raises :class:`LoadClientError` when there was no answer."""
    exchange = JSONExchange(method, path, json, headers)
    client.run([exchange])
    if exchange.error:
        raise LoadClientError(exchange.error)
    return exchange.status, exchange.result


__all__ = ["Exchange", "JSONExchange", "LoadClient", "LoadClientError", "request_json"]
