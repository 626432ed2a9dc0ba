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
  generation.
* **HTTP/2 holds to account** (:func:`patch_hypercorn_h2`): a stream's send buffer pushes
  back on the application (hypercorn's let it grow without bound when the client's window
  was closed), a stream whose response was abandoned is reset (hypercorn left it open,
  counting against the connection's streams for ever), and a connection that opened with
  the prior-knowledge preface and no request closes after the keep-alive timeout like an
  idle HTTP/1 one (hypercorn never timed it out: 450 such connections used up the file
  descriptors). ``--h2-max-concurrent-streams`` bounds the streams of one connection;
  a client that opens more loses the connection (h2's rule).
* **Limits** on header size and count, and keep-alive and body timeouts, set in
  :func:`hypercorn_limits` and the app config. Unknown transfer codings
  (``Transfer-Encoding: xchunked``) get h11's 501.
* **Out of descriptors, quietly.** When every file descriptor is taken (a flood of
  connections past the open-file limit, which ``serve`` first raises to the hard limit),
  trio's accept loop logs an error with a traceback every 0.1 s and retries; new
  connections wait in the kernel's listen backlog until descriptors come back (idle
  keep-alive connections close after :data:`KEEP_ALIVE_SECONDS`). :func:`quiet_accept_errors`
  turns the flood of tracebacks into one line per :data:`ACCEPT_ERROR_LOG_SECONDS`.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import h2.errors
import h2.exceptions
import trio
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol import h2 as hyper_h2
from hypercorn.protocol.events import StreamClosed
from hypercorn.trio.tcp_server import TCPServer
from quart_trio.wrappers.request import TrioBody, TrioRequest

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

    Idempotent. hypercorn calls ``TCPServer.protocol_send`` from the application's task
    for ``Closed`` (close the socket) and ``Updated`` (restart or stop the keep-alive
    timer); quart-trio has cancelled that task by then, so both were skipped: a
    ``Connection: close`` request or one whose body was left unread never got its EOF,
    and an idle keep-alive connection was never timed out. Each step is short (a shutdown,
    a close, a timer restart), so shielding it cannot hang, but for a write to a client
    that does not read: that one waits at most ``config.engine_send_timeout`` seconds
    (set by ``serve_app``), then the connection is closed.
    """
    if getattr(TCPServer.protocol_send, "shielded_by_engine", False):
        return
    TCPServer.protocol_send = _shielded(_timed_protocol_send(TCPServer.protocol_send))
    TCPServer._close = _shielded(TCPServer._close)


def _timed_protocol_send(protocol_send: Any) -> Any:
    async def timed(self: Any, event: Any) -> None:
        if not isinstance(event, RawData):
            await protocol_send(self, event)
            return
        seconds = getattr(self.config, "engine_send_timeout", None) or math.inf
        async with self.send_lock:
            try:
                # hypercorn shields the write (a cancelled half-write would corrupt the
                # connection); a stalled one ends the connection instead.
                with trio.move_on_after(seconds) as stalled:
                    await self.stream.send_all(event.data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await self.protocol.handle(Closed())
                return
        if stalled.cancelled_caught:
            # Forcefully: a TLS close would write again. The reading task then fails on
            # the closed stream and closes the protocol, which tells the application the
            # client has gone.
            await trio.aclose_forcefully(self.stream)

    return timed


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


def patch_hypercorn_h2() -> None:
    """Fix three holes of hypercorn's HTTP/2 (see the module docstring); idempotent.

    * ``StreamBuffer.pop`` released a writer waiting on a full buffer whenever the chunk it
      took was small, the empty chunk of a closed window included, so the application's
      writes never waited: the buffer now releases writers once *it* is below the low-water
      mark.
    * A stream closed while its response is unfinished (the application gave up on it) is
      reset with CANCEL and its buffer closed; the send task then forgets it.
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
            if buffer is not None and not buffer._complete:
                # No EndBody came: the response was abandoned mid-way. The send task
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

    initiate = hyper_h2.H2Protocol.initiate

    async def initiate_then_time_idle(self: Any, *args: Any) -> None:
        await initiate(self, *args)
        if self.idle:
            await self.send(Updated(idle=True))

    pop.patched_by_engine = True  # type: ignore[attr-defined]
    hyper_h2.StreamBuffer.pop = pop
    hyper_h2.H2Protocol.stream_send = reset_abandoned
    hyper_h2.H2Protocol.initiate = initiate_then_time_idle
