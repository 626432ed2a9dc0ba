"""Response bodies: a JSON answer, and an SSE stream written by a producer task.

:class:`TaskBody` is how every streamed route answers. The route submits its engine
requests in the handler (so bad input is still a 4xx) and returns a body whose producer
runs in the task that sends the response, so a disconnect cancels it (the request
lifetime is told in :mod:`engine.http.app`). The server runs it with
:meth:`TaskBody.write_into`, its frames going straight to the connection; entered as
quart's async iterable instead (any other ASGI path), it runs in a nursery and feeds
quart's send loop through a channel.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio
from quart import Response
from quart.wrappers.response import ResponseBody

from engine.http import sse

Produce = Callable[[trio.MemorySendChannel[bytes]], Awaitable[None]]


class TaskBody(ResponseBody):
    """A response body written by a task that runs while quart sends it.

    Entering the body opens a nursery in the sending task (so the producer is cancelled
    with the connection) and starts ``produce(send_channel)``; the body yields what the
    producer sends until it closes the channel. ``on_unsent`` runs if the body is never
    entered.
    """

    def __init__(self, produce: Produce, on_unsent: Callable[[], Awaitable[None]]) -> None:
        self._produce = produce
        self._on_unsent = on_unsent
        self._entered = False
        self._manager: Any = None
        self._nursery: trio.Nursery | None = None
        self._receive: trio.MemoryReceiveChannel[bytes] | None = None

    async def __aenter__(self) -> TaskBody:
        self._entered = True
        # Unbuffered: back-pressure from a slow client reaches the engine's bounded
        # per-request channel instead of piling up here.
        send, self._receive = trio.open_memory_channel[bytes](0)
        self._manager = trio.open_nursery()
        self._nursery = await self._manager.__aenter__()
        self._nursery.start_soon(self._produce, send)
        return self

    # quart types this as returning None; the nursery's answer (whether it handled the
    # exception) has to be passed on, so this returns it.
    async def __aexit__(self, *exc_info: Any) -> bool:  # type: ignore[override]
        assert self._nursery is not None and self._receive is not None  # set by __aenter__
        # Leaving before the producer finished (send failed, cancelled): stop it.
        self._nursery.cancel_scope.cancel()
        self._receive.close()
        return bool(await self._manager.__aexit__(*exc_info))

    def __aiter__(self) -> trio.MemoryReceiveChannel[bytes]:
        assert self._receive is not None
        return self._receive

    async def close_unsent(self) -> None:
        if not self._entered:
            await self._on_unsent()

    async def write_into(self, write: Callable[[bytes], Awaitable[None]]) -> None:
        """Run the producer in this task, each of its sends going straight to ``write``
        (the connection), instead of through a channel to quart's sending loop: one task
        hand-off fewer per streamed frame. A failed write stops the producer (cancelled,
        as a disconnect would) and is raised here."""
        self._entered = True
        channel = _DirectChannel(write)
        with trio.CancelScope() as channel.scope:
            await self._produce(channel)  # type: ignore[arg-type]
        if channel.failure is not None:
            raise channel.failure


class _DirectChannel:
    """A send channel's face (``send``, ``aclose``, ``async with``) over a write function;
    writes from the producer's tasks (one per prompt of a request) go one at a time."""

    def __init__(self, write: Callable[[bytes], Awaitable[None]]) -> None:
        self._write = write
        self._lock = trio.StrictFIFOLock()
        self.scope: trio.CancelScope | None = None
        self.failure: BaseException | None = None

    async def send(self, data: bytes) -> None:
        lock = self._lock
        if lock.locked():
            await lock.acquire()
        else:
            lock.acquire_nowait()  # the usual case, without a checkpoint
        try:
            await self._write(data)
        except Exception as exc:
            # The producer's tasks treat their exceptions as the request's failure (a
            # logged 500); a connection that failed is a cancellation to them, as when
            # quart's loop stopped reading the channel.
            self.failure = exc
            assert self.scope is not None
            self.scope.cancel()
            await trio.lowlevel.checkpoint()  # raises Cancelled
            raise
        finally:
            lock.release()

    async def aclose(self) -> None:
        pass

    async def __aenter__(self) -> _DirectChannel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        pass


def json_response(obj: Any, status: int) -> Response:
    """``obj`` as a JSON body (:func:`engine.http.sse.dumps`: compact, always valid JSON)."""
    return Response(sse.dumps(obj), status, content_type="application/json")


def sse_response(produce: Produce, on_unsent: Callable[[], Awaitable[None]]) -> Response:
    """A 200 event stream whose body ``produce`` writes (a :class:`TaskBody`)."""
    body = TaskBody(produce, on_unsent)
    return Response(body, 200, headers=sse.HEADERS, content_type=sse.CONTENT_TYPE)
