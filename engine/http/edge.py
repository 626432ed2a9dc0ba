"""The connection-level edge of the server: body draining, hypercorn settings and fixes.

These keep one client from hanging its own connection, piling up others, or holding the
engine by not reading:

* **Early answers drain the body.** A 413 (the body crossed ``--max-request-bytes``, counted
  as it arrives, chunked or not), 401, 404 or 405 can be sent before the client has sent
  its whole body. A client that writes the whole body before reading (most do) would then
  block on a full TCP window, and the unread rest would poison the next request on the
  keep-alive connection. So after the answer the connection keeps reading and dropping
  the body (quart stops storing it once it is over the limit) for up to
  :data:`DRAIN_SECONDS`; then the connection is reused, or closed if the client is still
  sending.
* **Closing actually closes.** hypercorn's trio worker closes a connection (``Connection:
  close``, an unread body) and restarts its keep-alive timer from the application's task,
  which quart-trio has already cancelled by then, so the ``send_eof`` checkpoint raised
  ``Cancelled`` and the socket was never shut down (the client waited forever for EOF),
  and idle keep-alive connections were never closed (hypercorn issues #106 and #330 show
  the symptoms). The fault is hypercorn's trio worker, not the app:
  :func:`shield_hypercorn_close` shields those two steps.
* **A client that stops reading is let go.** A write waits at most ``--send-timeout``
  seconds for the client to take it: on the socket (:func:`shield_hypercorn_close`'s
  ``protocol_send``: the connection is closed) and, for an HTTP/2 stream whose window is
  shut, in the application (:func:`send_within`: the response is abandoned and the stream
  reset). Either way the response's engine requests are aborted and their KV blocks freed.
  Without it, an HTTP/2 client with a zero flow-control window held every running slot of
  the engine, and an HTTP/1 client that stopped reading held its slot to the end of the
  generation. An HTTP/2 write waits as soon as the client's window is shut, whether it
  shrank to 0 or started there (:func:`patch_hypercorn_h2`), not only once hypercorn's
  stream buffer is full: 32 KiB is a couple of hundred streamed tokens, which a slow
  generation takes minutes to write.
* **HTTP/2 holds to account** (:func:`patch_hypercorn_h2`): a stream's send buffer and a
  shut flow-control window push back on the application (hypercorn's buffer grew without
  bound when the client's window was closed), a stream whose response was abandoned is
  reset (hypercorn left it open,
  counting against the connection's streams for ever), and a connection that opened with
  the prior-knowledge preface and no request closes after the keep-alive timeout like an
  idle HTTP/1 one (hypercorn never timed it out: 450 such connections used up the file
  descriptors). ``--h2-max-concurrent-streams`` bounds the streams of one connection;
  a client that opens more loses the connection (h2's rule).
* **Limits** on header size and count, and keep-alive and body timeouts, set in
  :func:`hypercorn_limits` and the app config. Unknown transfer codings
  (``Transfer-Encoding: xchunked``) get h11's 501 (RFC 9112 section 6.1), which hypercorn
  sends since 0.16 (before, every h11 error was a 400; ``pyproject.toml`` asks for 0.17).
* **Out of descriptors, answered.** When every file descriptor is taken (a flood of
  connections past the open-file limit, which ``serve`` first raises to the hard limit),
  trio's accept loop logged an error every 0.1 s and retried, and new connections waited
  in the kernel's listen backlog until descriptors came back. Now the listening socket
  keeps one spare descriptor (:class:`DescriptorReserve`, :func:`reserve_descriptors`)
  and spends it to answer each such connection with a 503 and close it at once; one
  warning line per :data:`ACCEPT_ERROR_LOG_SECONDS` says so. A connection the client
  closes gives its descriptor back at once (:func:`shield_hypercorn_close`), so the
  server serves again as soon as connections close. Should the spare be lost (another
  thread took the descriptor), trio's retry remains, its log quieted by
  :func:`quiet_accept_errors`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import h2.errors
import h2.exceptions
import h11
import trio
import trio._highlevel_serve_listeners as trio_serve_listeners
from h11 import _writers
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol import h2 as hyper_h2
from hypercorn.protocol.events import Body, Data, StreamClosed
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio import tcp_server
from hypercorn.trio.tcp_server import TCPServer
from quart_trio.wrappers.request import TrioBody, TrioRequest

from engine.http.errors import APIError

logger = logging.getLogger("engine.http")

# A body refused early is read and dropped for at most this long: enough for a client on
# a slow link to finish sending a few MB, short enough that a client sending forever
# holds its connection only briefly.
DRAIN_SECONDS = 10.0
# Headers: hypercorn/h11 refuse a head larger than this with a 400 and close (16 KiB is
# h11's default and nginx's large_client_header_buffers order of magnitude); no client of
# this API needs more than a few dozen headers.
MAX_HEADER_BYTES = 16 * 1024
MAX_HEADERS = 100
# An idle keep-alive connection (or one that never finishes its request head) is closed
# after this long, so idle or slow connections cannot pile up.
KEEP_ALIVE_SECONDS = 5.0
# A request body must arrive within this long (quart answers 408 otherwise); a prompt is
# at most a few MB.
BODY_TIMEOUT_SECONDS = 60.0
# One write of a response may wait this long for the client to read (--send-timeout). A
# client that reads at all takes a chunk in milliseconds; one that has not read for this
# long holds a running slot and KV blocks for nothing. Long enough for a network stall.
SEND_TIMEOUT_SECONDS = 30.0
SEND_TIMEOUT_CONFIG = "ENGINE_SEND_TIMEOUT"
# Concurrent streams on one HTTP/2 connection (--h2-max-concurrent-streams): RFC 9113
# recommends no fewer than 100, hypercorn's default. A stream is a request: a client
# wanting more opens another connection, as HTTP/1 clients do for each request.
H2_MAX_CONCURRENT_STREAMS = 100


class SlowReaderError(Exception):
    """A response write waited past the send timeout: the client is not reading."""


async def send_within(send: Any, message: Any, seconds: float) -> None:
    """``await send(message)``, or :class:`SlowReaderError` after ``seconds``."""
    with trio.move_on_after(seconds if seconds > 0 else math.inf) as scope:
        await send(message)
    if scope.cancelled_caught:
        raise SlowReaderError(f"the client read nothing for {seconds:g} s (--send-timeout)")


class DrainableBody(TrioBody):
    """quart-trio's request body that also says when the client has sent all of it."""

    def __init__(self, expected_content_length: int | None, max_content_length: int | None) -> None:
        super().__init__(expected_content_length, max_content_length)
        self.sent = trio.Event()

    def set_complete(self) -> None:
        super().set_complete()
        self.sent.set()


class EdgeRequest(TrioRequest):
    body_class = DrainableBody


async def drain_unread_body(request: Any) -> None:
    """Wait (bounded) until the client has sent the rest of a body nobody read.

    quart-trio's receive task keeps appending what arrives meanwhile; a body over the
    limit is no longer stored, one under it is bounded by the limit.
    """
    body = getattr(request, "body", None)
    if isinstance(body, DrainableBody) and not body.sent.is_set():
        with trio.move_on_after(DRAIN_SECONDS):
            await body.sent.wait()


def hypercorn_limits(config: Any, *, h2_max_concurrent_streams: int = H2_MAX_CONCURRENT_STREAMS
                     ) -> None:
    """Set the connection limits of a hypercorn ``Config``."""
    config.h11_max_incomplete_size = MAX_HEADER_BYTES
    config.keep_alive_timeout = KEEP_ALIVE_SECONDS
    config.h2_max_concurrent_streams = h2_max_concurrent_streams
    # No read_timeout: it would also cut a client that only listens to a long stream.


def shield_hypercorn_close() -> None:
    """Make hypercorn's trio worker finish its connection bookkeeping even when it runs in
    a cancelled task, and give up on a socket write that stalls.

    Idempotent; checked against hypercorn 0.18.0 (``hypercorn/trio/tcp_server.py``).
    hypercorn calls ``TCPServer.protocol_send`` from the application's task
    for ``Closed`` (close the socket) and ``Updated`` (restart or stop the keep-alive
    timer); quart-trio has cancelled that task by then, so both were skipped: a
    ``Connection: close`` request or one whose body was left unread never got its EOF,
    and an idle keep-alive connection was never timed out. Each step is short (a shutdown,
    a close, a timer restart), so shielding it cannot hang, but for a write to a client
    that does not read: that one waits at most ``config.engine_send_timeout`` seconds
    (set by ``serve_app``), then the connection is closed.

    And a connection the client closed gives its descriptor back at once: hypercorn
    left the keep-alive timer running after the read loop saw
    EOF, and the connection's task group (so its socket) waited for the timer, up to
    :data:`KEEP_ALIVE_SECONDS` per closed connection, which matters most when the
    descriptors have run out.
    """
    if getattr(TCPServer.protocol_send, "shielded_by_engine", False):
        return
    TCPServer.protocol_send = _timed_protocol_send(TCPServer.protocol_send)
    TCPServer._close = _close_once(TCPServer._close)
    TCPServer._read_data = _stop_timer_after(TCPServer._read_data)
    _close_handled_streams_once()


def _close_handled_streams_once() -> None:
    """``trio.serve_listeners`` closes each connection's stream once its handler returns
    (``aclose_forcefully``: a cancelled scope, a checkpoint and a pass of the run loop,
    about 25 us), though hypercorn's handler has always closed it by then (``_close``).
    A stream whose socket is already closed is left as it is; any other is closed as trio
    does. Checked against trio 0.35.0 (``trio/_highlevel_serve_listeners.py``, whose
    accept loop starts ``_run_handler`` by its module name for each connection)."""
    if getattr(trio_serve_listeners._run_handler, "patched_by_engine", False):
        return

    async def run_handler(stream: Any, handler: Any) -> None:
        try:
            await handler(stream)
        finally:
            if not (type(stream) is trio.SocketStream and stream.socket.fileno() == -1):
                await trio.aclose_forcefully(stream)

    run_handler.patched_by_engine = True  # type: ignore[attr-defined]
    trio_serve_listeners._run_handler = run_handler  # type: ignore[assignment]


class IdleTimer:
    """hypercorn's keep-alive timer (``TrioSingleTask``: one task a connection, restarted
    when the connection goes idle, stopped when a request arrives), without its lock and
    ``nursery.start``: each restart took the lock and waited a run-loop pass for the new
    task to report its cancel scope, twice a keep-alive request. Here the scope is made
    before the task, so ``stop`` and ``restart`` never wait; a scope cancelled before its
    task enters it cancels the task on entry. The same calls, the same timing."""

    def __init__(self) -> None:
        self._scope: trio.CancelScope | None = None

    async def restart(self, task_group: Any, action: Any) -> None:
        if self._scope is not None:
            self._scope.cancel()
        scope = self._scope = trio.CancelScope()

        async def run() -> None:
            with scope:
                await action()

        task_group._nursery.start_soon(run)

    async def stop(self) -> None:
        if self._scope is not None:
            self._scope.cancel()
            self._scope = None


def use_idle_timer() -> None:
    """hypercorn's trio connections take :class:`IdleTimer` as their keep-alive timer.
    Idempotent; checked against hypercorn 0.18.0 (``TCPServer.__init__`` makes its
    ``idle_task`` from the module's ``TrioSingleTask``)."""
    tcp_server.TrioSingleTask = IdleTimer  # type: ignore[misc]


def frame_h11_body_chunks() -> None:
    """Frame an HTTP/1.1 chunked response body's data here, not through h11's state
    machine: every streamed token's frame went through h11's ``send`` (event checks,
    state transitions that a body chunk never makes, the writer's three writes), a tenth
    of the event loop's work per frame. The bytes are h11's (``tests/test_http_edge.py``
    compares them); any other event, a body with a Content-Length, or an h11 whose
    internals differ goes through hypercorn and h11 as before. Idempotent; checked
    against hypercorn 0.18.0 and h11 0.16.0."""
    if getattr(H11Protocol.stream_send, "patched_by_engine", False):
        return
    stream_send = H11Protocol.stream_send
    chunked = getattr(_writers, "ChunkedWriter", None)

    async def send_chunk(self: Any, event: Any) -> None:
        if type(event) is Body and event.data:
            conn = self.connection
            if conn.our_state is h11.SEND_BODY and chunked is not None \
                    and type(getattr(conn, "_writer", None)) is chunked:
                data = event.data
                await self.send(RawData(data=b"%x\r\n%b\r\n" % (len(data), data)))
                return
        await stream_send(self, event)

    send_chunk.patched_by_engine = True  # type: ignore[attr-defined]
    H11Protocol.stream_send = send_chunk  # type: ignore[method-assign]


def _stop_timer_after(read_data: Any) -> Any:
    async def read_then_stop_timer(self: Any) -> None:
        await read_data(self)
        # Nothing more will arrive: no idle time to measure. A response still being
        # written keeps the connection's task group (and socket) open until it ends.
        await self.idle_task.stop()

    return read_then_stop_timer


def _timed_protocol_send(protocol_send: Any) -> Any:
    shielded_send = _shielded(protocol_send)

    async def timed(self: Any, event: Any) -> None:
        if not isinstance(event, RawData):
            await shielded_send(self, event)
            return
        data = event.data
        if type(self.stream) is trio.SocketStream and not self.send_lock.locked():
            # Nobody else is writing: hand the bytes to the kernel now, without the
            # lock's and trio's send checkpoints (each a pass of the run loop, per streamed
            # frame). What the socket does not take, or an error, goes the usual way.
            try:
                data = data[os.write(self.stream.socket.fileno(), data):]
            except OSError:
                pass
            if not data:
                return
        seconds = getattr(self.config, "engine_send_timeout", None) or math.inf
        # One scope both shields the write (hypercorn's: a cancelled half-write would
        # corrupt the connection) and bounds it, lock included: a stalled write ends the
        # connection instead. One scope, not a shield around a timer: every streamed
        # token passes here, and each cancel scope was about a twentieth of the event
        # loop's CPU time at concurrency 32 (docs/benchmarks.md, issue 42).
        broken = False
        with trio.CancelScope(shield=True, deadline=trio.current_time() + seconds) as stalled:
            async with self.send_lock:
                try:
                    await self.stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    broken = True
        if broken:
            with trio.CancelScope(shield=True):  # bookkeeping that must finish, untimed
                await self.protocol.handle(Closed())
        elif stalled.cancelled_caught:
            # Forcefully: a TLS close would write again. The reading task then fails on
            # the closed stream and closes the protocol, which tells the application the
            # client has gone.
            await trio.aclose_forcefully(self.stream)

    timed.shielded_by_engine = True  # type: ignore[attr-defined]
    return timed


def _close_once(close: Any) -> Any:
    """hypercorn's ``TCPServer._close``, shielded, and run once a connection: hypercorn
    calls it from every path that sees the end (the response's ``Closed``, the protocol's,
    the read loop's, ``run``'s ``finally``), six times a ``Connection: close`` request,
    and each repeat paid a cancel scope, a ``send_eof`` that raised on the closed stream
    and two passes of the run loop for nothing. A repeat while the first is still
    closing returns at once: the first finishes the close."""

    async def close_once(self: Any) -> None:
        if getattr(self, "_engine_closing", False):
            return
        self._engine_closing = True
        with trio.CancelScope(shield=True):
            await close(self)

    return close_once


def _shielded(method: Any) -> Any:
    async def shielded(self: Any, *args: Any) -> None:
        with trio.CancelScope(shield=True):
            await method(self, *args)

    shielded.shielded_by_engine = True  # type: ignore[attr-defined]
    return shielded


# One "out of descriptors" line at most this often: enough to see it is still happening.
ACCEPT_ERROR_LOG_SECONDS = 10.0


class _AcceptErrorFilter(logging.Filter):
    """Rate-limits trio's accept-loop errors (see :func:`quiet_accept_errors`)."""

    def __init__(self, interval: float = ACCEPT_ERROR_LOG_SECONDS) -> None:
        super().__init__()
        self.interval = interval
        self._last = -float("inf")
        self._suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        if now - self._last < self.interval:
            self._suppressed += 1
            return False
        self._last = now
        # trio's message names the errno ("accept returned EMFILE (Too many open
        # files); retrying in 0.1 seconds"); the traceback says nothing more.
        reason = record.getMessage()
        record.msg = ("%s: new connections wait in the listen backlog until descriptors "
                      "free up (%d more such errors in the last %.0f s not logged)")
        record.args = (reason, self._suppressed, self.interval)
        record.exc_info = None
        record.exc_text = None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        self._suppressed = 0
        return True


def quiet_accept_errors() -> None:
    """Log trio's "accept returned EMFILE" at most once per
    :data:`ACCEPT_ERROR_LOG_SECONDS`, as a warning without a traceback. Idempotent."""
    accept_logger = logging.getLogger("trio.serve_listeners")
    if not any(isinstance(f, _AcceptErrorFilter) for f in accept_logger.filters):
        accept_logger.addFilter(_AcceptErrorFilter())


# An accept that failed for want of a descriptor: the process's (EMFILE) or the system's
# (ENFILE). A spare descriptor helps with both; ENOMEM and ENOBUFS it cannot.
_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)
# Bytes read and dropped from a refused connection before it is closed: a request head
# (at most MAX_HEADER_BYTES) and a little body. Closing a socket with unread data sends a
# reset, which can make the client drop the answer it has not read yet.
_REFUSED_READ_BYTES = 64 * 1024
_REFUSAL = APIError(
    503, "The server has no file descriptor free for a new connection (too many open "
    "connections); retry later.", type="service_unavailable", code="too_many_connections")
_REFUSAL_BODY = json.dumps(_REFUSAL.body(), separators=(",", ":")).encode()
# Retry-After: 1, as the app's other 503s (idle keep-alive connections close within
# KEEP_ALIVE_SECONDS and give their descriptors back).
OUT_OF_DESCRIPTORS_ANSWER = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"content-length: " + str(len(_REFUSAL_BODY)).encode() + b"\r\nretry-after: 1\r\n"
    b"connection: close\r\n\r\n" + _REFUSAL_BODY)


class DescriptorReserve:
    """One spare descriptor kept for a listening socket, so that a connection arriving when
    every other descriptor is taken is answered at once instead of waiting in the listen
    backlog (libev's documented remedy for EMFILE on accept).

    :meth:`refuse_one` closes the spare, accepts the waiting connection on the descriptor
    it frees, writes ``answer`` (an HTTP/1.1 503; nothing on a TLS listener, whose
    handshake has not happened), closes the connection and takes the spare again. Another
    thread may take the freed descriptor first; then nothing is refused and trio's accept
    loop retries as before.
    """

    def __init__(self, fd: int, answer: bytes) -> None:
        self.fd = fd
        self.answer = answer
        self._spare: int | None = None
        self._take_spare()
        self._last_log = -math.inf
        self._unlogged = 0

    def _take_spare(self) -> None:
        if self._spare is None:
            try:
                self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                pass  # none free now; taken again at the next refusal

    def close(self) -> None:
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None

    def refuse_one(self) -> bool | None:
        """Answer and close one connection waiting to be accepted: True when one was,
        False when none waits (Linux's accept fails with EMFILE before it looks for a
        connection), None when no descriptor could be freed for it."""
        if self._spare is None:
            self._take_spare()
            return None
        os.close(self._spare)
        self._spare = None
        # A second socket object on the listening descriptor, detached before it is
        # dropped, so that only hypercorn's object ever closes the descriptor.
        listening = socket.socket(fileno=self.fd)
        try:
            conn = listening.accept()[0]
        except OSError as exc:
            self._take_spare()
            # EAGAIN: none waits. Else another thread took the freed descriptor first.
            return False if isinstance(exc, BlockingIOError) else None
        finally:
            listening.detach()
        with conn:
            conn.setblocking(False)
            with contextlib.suppress(OSError):
                conn.recv(_REFUSED_READ_BYTES)
            with contextlib.suppress(OSError):
                conn.send(self.answer)  # a fresh socket's send buffer takes it whole
        self._take_spare()  # the descriptor conn held
        self._log()
        return True

    def _log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < ACCEPT_ERROR_LOG_SECONDS:
            self._unlogged += 1
            return
        logger.warning("out of file descriptors: a new connection was refused at once "
                       "(%d more in the last %.0f s); open connections hold the rest of the "
                       "open-file limit", self._unlogged, ACCEPT_ERROR_LOG_SECONDS)
        self._last_log, self._unlogged = now, 0


# The listening descriptors served with a reserve, by descriptor number: trio's listener
# knows only its socket, and a descriptor number is what both sides share. serve_app adds
# and removes its own (reserve_descriptors).
_RESERVES: dict[int, DescriptorReserve] = {}


@contextlib.contextmanager
def reserve_descriptors(fd: int, *, tls: bool) -> Iterator[DescriptorReserve]:
    """Refuse new connections on the listening descriptor ``fd`` with a 503 (``tls``: by
    closing them) while descriptors have run out, for the duration of the block."""
    _patch_trio_accept()
    reserve = DescriptorReserve(fd, b"" if tls else OUT_OF_DESCRIPTORS_ANSWER)
    _RESERVES[fd] = reserve
    try:
        yield reserve
    finally:
        if _RESERVES.get(fd) is reserve:
            del _RESERVES[fd]
        reserve.close()


def _patch_trio_accept() -> None:
    """Make ``trio.SocketListener.accept`` refuse connections through the listening
    socket's :class:`DescriptorReserve` when accept fails for want of a descriptor;
    idempotent. Checked against trio 0.35.0 and hypercorn 0.18.0: hypercorn's trio worker
    serves its sockets with ``trio.serve_listeners`` over ``trio.SocketListener``s, whose
    ``accept`` leaves EMFILE to ``serve_listeners``, which logs it and retries every
    0.1 s while the connection waits in the backlog. Listeners without a reserve keep
    trio's behaviour."""
    if getattr(trio.SocketListener.accept, "patched_by_engine", False):
        return
    accept = trio.SocketListener.accept

    async def accept_or_refuse(self: trio.SocketListener) -> trio.SocketStream:
        while True:
            try:
                return await accept(self)
            except OSError as exc:
                reserve = _RESERVES.get(self.socket.fileno())
                if exc.errno not in _OUT_OF_DESCRIPTORS or reserve is None:
                    raise
                refused = reserve.refuse_one()
                if refused is None:
                    raise  # trio's loop logs it and retries in 0.1 s
            if refused:
                # A flood of refusals still lets the other tasks run.
                await trio.lowlevel.checkpoint()
            else:
                # Nothing waits: sleep until a connection does (trio's loop would retry
                # the failing accept every 0.1 s).
                await trio.lowlevel.wait_readable(self.socket)

    accept_or_refuse.patched_by_engine = True  # type: ignore[attr-defined]
    trio.SocketListener.accept = accept_or_refuse  # type: ignore[method-assign]


def patch_hypercorn_h2() -> None:
    """Fix four holes of hypercorn's HTTP/2 (see the module docstring); idempotent. Checked
    against hypercorn 0.18.0 (``hypercorn/protocol/h2.py``) and h2 4.4.1.

    * ``StreamBuffer.pop`` released a writer waiting on a full buffer whenever the chunk it
      took was small, the empty chunk of a closed window included, so the application's
      writes never waited: the buffer now releases writers once *it* is below the low-water
      mark.
    * A write to a stream whose flow-control window is shut waits until what the stream
      has buffered is sent (:func:`_wait_for_window`), so the send timeout measures how
      long the client has not let the server write, as on HTTP/1.
    * A stream closed while its response is unfinished (the application gave up on it,
      before its end or while its end waited on a shut window) is reset with CANCEL and
      its buffer closed; the send task then forgets it.
    * A connection that starts HTTP/2 with no request open (the prior-knowledge preface
      switches an HTTP/1 connection, whose timer its request head had stopped) starts the
      keep-alive timer, as an HTTP/1 connection between requests does.
    """
    if getattr(hyper_h2.StreamBuffer.pop, "patched_by_engine", False):
        return

    async def pop(self: Any, max_length: int) -> bytes:
        length = min(len(self.buffer), max_length)
        data = bytes(self.buffer[:length])
        del self.buffer[:length]
        if len(self.buffer) < hyper_h2.BUFFER_LOW_WATER:
            await self._paused.set()
        if len(self.buffer) == 0:
            await self._is_empty.set()
        return data

    stream_send = hyper_h2.H2Protocol.stream_send

    async def reset_abandoned(self: Any, event: Any) -> None:
        if isinstance(event, StreamClosed):
            buffer = self.stream_buffers.get(event.stream_id)
            if buffer is not None and not buffer.complete:
                # The response was abandoned mid-way: no EndBody came, or it came and its
                # drain gave up with data still unsent (a closed window). The send task
                # removes the stream when it next finds it (it fails on the reset stream).
                try:
                    self.connection.reset_stream(event.stream_id, h2.errors.ErrorCodes.CANCEL)
                except h2.exceptions.ProtocolError:
                    pass  # already closed by the client
                await buffer.close()
                self.priority.unblock(event.stream_id)
                await self.has_data.set()
                await self._flush()
        await stream_send(self, event)
        if isinstance(event, (Body, Data)):
            await _wait_for_window(self, event.stream_id)

    initiate = hyper_h2.H2Protocol.initiate

    async def initiate_then_time_idle(self: Any, *args: Any) -> None:
        await initiate(self, *args)
        if self.idle:
            await self.send(Updated(idle=True))

    pop.patched_by_engine = True  # type: ignore[attr-defined]
    hyper_h2.StreamBuffer.pop = pop
    hyper_h2.H2Protocol.stream_send = reset_abandoned
    hyper_h2.H2Protocol.initiate = initiate_then_time_idle


async def _wait_for_window(protocol: Any, stream_id: int) -> None:
    """After a write to an HTTP/2 stream: while the client's flow-control window (the
    stream's or the connection's) is shut, wait until what the stream has buffered is
    sent, as a write to a stalled HTTP/1 socket waits; the application's send timeout
    then cuts a client that never opens it. Without this, a write waited only once
    hypercorn's buffer held ``BUFFER_HIGH_WATER`` bytes (32 KiB, a couple of hundred
    streamed tokens), so a zero-window client held its running slots for as long as
    the generations took to produce that much."""
    buffer = protocol.stream_buffers.get(stream_id)
    if buffer is None or not buffer.buffer:
        return
    try:
        window = protocol.connection.local_flow_control_window(stream_id)
    except h2.exceptions.ProtocolError:
        return  # the stream is closed or reset: nothing will be sent
    if window <= 0:
        await buffer.drain()
