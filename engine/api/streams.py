"""A request's token stream in the embedded API: :class:`RequestStream` (what
:meth:`Engine.submit` returns) and the lazily submitting iterator behind
:meth:`Engine.generate`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import trio

from engine.actors.router import OutputMailbox
from engine.api.tracing import RequestTrace
from engine.errors import EngineDeadError, RequestFailedError
from engine.messages import RequestOutput

if TYPE_CHECKING:  # the engine owns its streams; a stream only names its engine's type
    from engine.api.engine import Engine

logger = logging.getLogger("engine")


class RequestStream:
    """The outputs of one submitted request: an async iterator of :class:`RequestOutput`.

    Use it as an async context manager (or call :meth:`aclose`): leaving before the last
    output aborts the request and frees its KV blocks. With ``n > 1`` every sample's
    outputs come through this one stream, tagged with ``.index``; the stream ends once all
    samples have finished. If the engine dies, iteration raises :class:`EngineDeadError`;
    if the request fails inside the engine (see ``StepResult.failed``), it raises
    :class:`RequestFailedError` and the engine goes on.
    """

    def __init__(self, engine: Engine, mailbox: OutputMailbox, trace: RequestTrace | None = None) -> None:
        self._engine = engine
        self._mailbox = mailbox
        self._trace = trace  # its span's times and counts (otlp_traces_endpoint)
        self._closed = False
        self.request_id = mailbox.request_id
        self.prompt_token_ids: tuple[int, ...] = mailbox.prompt_token_ids
        # enable_log_outputs: each sample's text pieces and ids until it finishes.
        self._outputs: dict[int, tuple[list[str], list[int]]] | None = (
            {} if engine.config.enable_log_outputs else None)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        try:
            out = await self._mailbox.receive()
        except (StopAsyncIteration, EngineDeadError, RequestFailedError):
            self._closed = True
            raise
        if self._outputs is not None:
            self._log_output(out, self._outputs)
        if self._trace is not None:
            self._trace.seen(out)
        return out

    def _log_output(self, out: RequestOutput, seen: dict[int, tuple[list[str], list[int]]]) -> None:
        """vLLM's output log line (``enable_log_outputs``), once a sample finishes."""
        text, ids = seen.setdefault(out.index, ([], []))
        text.append(out.text)
        ids.extend(out.token_ids)
        if not out.finished:
            return
        del seen[out.index]
        limit = self._engine.config.max_log_len
        whole = "".join(text)
        sample = f" (sample {out.index})" if out.index else ""
        logger.info("Generated response %s%s: output: %r, output_token_ids: %s, "
                    "finish_reason: %s", self.request_id, sample,
                    whole if limit is None else whole[:limit],
                    ids if limit is None else ids[:limit], out.finish_reason)

    async def aclose(self) -> None:
        """Stop reading; aborts the request if it has not finished."""
        self._release()
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._release()

    def _release(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine._drop(self._mailbox)

    def __del__(self) -> None:
        # A stream dropped mid-way (a consumer that broke out of its loop without closing)
        # must not keep its blocks: schedule the abort on the trio thread, which is safe
        # from whatever thread the garbage collector runs in.
        if not getattr(self, "_closed", True):
            self._closed = True
            self._engine._drop_soon(self._mailbox)


class _Generation:
    """``Engine.generate``'s iterator: submits on first iteration, then streams."""

    def __init__(self, engine: Engine, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._engine = engine
        self._args = args
        self._kwargs = kwargs
        self._stream: RequestStream | None = None

    def __aiter__(self) -> _Generation:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._stream is None:
            self._stream = await self._engine.submit(*self._args, **self._kwargs)
        return await self._stream.__anext__()

    async def aclose(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()

    async def __aenter__(self) -> _Generation:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
