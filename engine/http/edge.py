"""The connection-level edge of the server: body draining, hypercorn settings and a fix.

Three things keep one client from hanging its own connection or piling up others:

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
* **Limits** on header size and count, and keep-alive and body timeouts, set in
  :func:`hypercorn_limits` and the app config.
* **Out of descriptors, quietly.** When every file descriptor is taken (a flood of
  connections past the open-file limit, which ``serve`` first raises to the hard limit),
  trio's accept loop logs an error with a traceback every 0.1 s and retries; new
  connections wait in the kernel's listen backlog until descriptors come back (idle
  keep-alive connections close after :data:`KEEP_ALIVE_SECONDS`). :func:`quiet_accept_errors`
  turns the flood of tracebacks into one line per :data:`ACCEPT_ERROR_LOG_SECONDS`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import trio
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


def hypercorn_limits(config: Any) -> None:
    """Set the connection limits of a hypercorn ``Config``."""
    config.h11_max_incomplete_size = MAX_HEADER_BYTES
    config.keep_alive_timeout = KEEP_ALIVE_SECONDS
    # No read_timeout: it would also cut a client that only listens to a long stream.


def shield_hypercorn_close() -> None:
    """Make hypercorn's trio worker finish its connection bookkeeping even when it runs in
    a cancelled task.

    Idempotent. hypercorn calls ``TCPServer.protocol_send`` from the application's task
    for ``Closed`` (close the socket) and ``Updated`` (restart or stop the keep-alive
    timer); quart-trio has cancelled that task by then, so both were skipped: a
    ``Connection: close`` request or one whose body was left unread never got its EOF,
    and an idle keep-alive connection was never timed out. Each step is short (a shutdown,
    a close, a timer restart), so shielding it cannot hang.
    """
    from hypercorn.trio.tcp_server import TCPServer

    if getattr(TCPServer.protocol_send, "shielded_by_engine", False):
        return
    for name in ("protocol_send", "_close"):
        setattr(TCPServer, name, _shielded(getattr(TCPServer, name)))


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
