"""The embedded trio API: open an engine in your own program and stream tokens from it.

::

    import engine

    async with engine.open_engine(dtype="float32") as eng:
        async for out in eng.generate("The capital of France is", engine.SamplingParams(max_tokens=8)):
            print(out.text, end="")

The contract is written down in ``docs/architecture.md`` ("Actors and the embedded API").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from engine.actors.router import OutputMailbox, sample_ids
from engine.actors.system import (
    ActorHandles,
    EngineParts,
    EngineStatistics,
    build_parts,
    run_actors,
)
from engine.config import EngineConfig
from engine.errors import EngineDeadError, InvalidParamError
from engine.messages import (
    ChatPrompt,
    RequestOutput,
    SubmitRequest,
    TextPrompt,
    TokensPrompt,
)
from engine.params import SamplingParams

logger = logging.getLogger("engine")


class RequestStream:
    """The outputs of one submitted request: an async iterator of :class:`RequestOutput`.

    Use it as an async context manager (or call :meth:`aclose`): leaving before the last
    output aborts the request and frees its KV blocks. With ``n > 1`` every sample's
    outputs come through this one stream, tagged with ``.index``; the stream ends once all
    samples have finished. If the engine dies, iteration raises :class:`EngineDeadError`.
    """

    def __init__(self, engine: Engine, mailbox: OutputMailbox) -> None:
        self._engine = engine
        self._mailbox = mailbox
        self._closed = False
        self.request_id = mailbox.request_id
        self.prompt_token_ids: tuple[int, ...] = mailbox.prompt_token_ids

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        try:
            return await self._mailbox.receive()
        except (StopAsyncIteration, EngineDeadError):
            self._closed = True
            raise

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


class Engine:
    """A running engine: submit requests, read statistics, abort. Made by :func:`open_engine`.

    Attributes: ``config`` (resolved), ``model_name``, ``tokenizer``, ``max_model_len``,
    ``dead`` and ``dead_reason`` (the exception that killed it, or the closing error).
    """

    def __init__(self, parts: EngineParts) -> None:
        self.config: EngineConfig = parts.config
        self.model_name: str = parts.model_name
        self.tokenizer = parts.tokenizer
        self.max_model_len: int = parts.limits.max_model_len
        self.dead = False
        self.dead_reason: BaseException | None = None
        self._parts = parts
        self._handles: ActorHandles | None = None
        self._token = trio.lowlevel.current_trio_token()

    # -- requests ---------------------------------------------------------------------------

    async def submit(
        self,
        prompt: str | Sequence[int] | Sequence[dict[str, Any]],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Validate, tokenize and queue a request; returns its stream once admitted.

        ``prompt`` is a string (tokenized with special tokens), a list of token ids, or a
        list of chat messages (``{"role", "content"}`` dicts; the chat template applies).
        Raises :class:`InvalidParamError`, :class:`PromptTooLongError`,
        :class:`QueueFullError` (the request is not queued) or :class:`EngineDeadError`.
        """
        handles = self._alive()
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidParamError("params must be an engine.SamplingParams", param="params")
        message = SubmitRequest(
            request_id=request_id if request_id is not None else uuid.uuid4().hex,
            prompt=_prompt_message(prompt),
            params=params,
            priority=_int_param(priority, "priority"),
            cache_salt=_salt(cache_salt),
            arrival_time=time.monotonic(),
        )
        mailbox = handles.router.open(message.request_id, params.n)
        sent = admitted = False
        try:
            try:
                await handles.submit.send(message)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise self._dead_error() from self.dead_reason
            sent = True
            await mailbox.wait_admitted()
            admitted = True
        finally:
            if not sent:  # a send that raised (even Cancelled) delivered nothing
                handles.router.forget(message.request_id)
            elif not admitted:  # rejected, cancelled, or the engine died: forget it
                self._drop(mailbox)
        return RequestStream(self, mailbox)

    def generate(
        self,
        prompt: str | Sequence[int] | Sequence[dict[str, Any]],
        params: SamplingParams | None = None,
        **kwargs: Any,
    ) -> _Generation:
        """``submit`` then iterate, as one async iterator (submits on first iteration).

        Leaving the loop early aborts the request; use ``async with eng.generate(...) as
        gen:`` to make the abort happen exactly when the block is left.
        """
        return _Generation(self, (prompt, params), kwargs)

    def abort(self, request_id: str) -> None:
        """Abort a request from outside its stream (idempotent). Its stream gets a last
        output with ``finish_reason == "abort"`` for each unfinished sample."""
        if self._handles is None:
            return
        mailbox = self._handles.router.get(request_id)
        if mailbox is None or mailbox.abort_requested:
            return
        mailbox.abort_requested = True
        if mailbox.admitted:
            self._handles.abort(mailbox.sample_ids)

    def statistics(self) -> EngineStatistics:
        """A frozen snapshot of the scheduler's and the KV pool's counters."""
        if self._handles is None:
            raise self._dead_error()
        return self._handles.statistics()

    # -- internals --------------------------------------------------------------------------

    def _alive(self) -> ActorHandles:
        if self.dead or self._handles is None:
            raise self._dead_error() from self.dead_reason
        return self._handles

    def _dead_error(self) -> EngineDeadError:
        if isinstance(self.dead_reason, EngineDeadError):
            return EngineDeadError(str(self.dead_reason))
        return EngineDeadError(f"the engine died: {self.dead_reason!r}")

    def _drop(self, mailbox: OutputMailbox) -> None:
        """The caller no longer reads this request: forget its outputs, abort it."""
        if self._handles is None:
            return
        self._handles.router.close(mailbox.request_id)
        if mailbox.admitted and not mailbox.done:
            self._handles.abort(mailbox.sample_ids)

    def _drop_soon(self, mailbox: OutputMailbox) -> None:
        try:
            self._token.run_sync_soon(self._drop, mailbox)
        except trio.RunFinishedError:
            pass  # the trio run is over; so is the engine

    def _die(self, reason: BaseException) -> None:
        if self.dead:
            return
        self.dead = True
        self.dead_reason = reason
        if self._handles is not None:
            error = self._dead_error()
            error.__cause__ = reason
            self._handles.router.fail_all(error)

    async def _run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the actors until cancelled; a crash marks the engine dead instead of
        propagating, so the caller's ``async with`` block goes on (an HTTP server keeps
        answering /health with 503)."""
        started = False

        def ready(handles: ActorHandles) -> None:
            nonlocal started
            self._handles = handles
            started = True
            task_status.started()

        try:
            await run_actors(self._parts, ready=ready)
        except* Exception as group:
            if not started:
                raise
            crash = _single(group)
            logger.error("engine actor crashed: %r", crash, exc_info=crash)
            self._die(crash)
        else:
            self._die(EngineDeadError("the engine's actors stopped"))


# An actor that crashes closes its channel ends on the way out, so a neighbour blocked on
# one of them fails too; those failures are consequences, not the cause.
_CONSEQUENCES = (trio.BrokenResourceError, trio.ClosedResourceError, trio.EndOfChannel)


def _single(group: BaseExceptionGroup[Exception]) -> BaseException:
    """The crash inside nested groups, or the group when several actors failed on their own."""
    leaves = list(_leaves(group))
    causes = [e for e in leaves if not isinstance(e, _CONSEQUENCES)] or leaves
    return causes[0] if len(causes) == 1 else group


def _leaves(exc: BaseException) -> Any:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def _prompt_message(prompt: Any) -> TextPrompt | TokensPrompt | ChatPrompt:
    if isinstance(prompt, str):
        return TextPrompt(prompt)
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        try:
            return ChatPrompt(json.dumps(list(prompt)))
        except (TypeError, ValueError) as exc:
            raise InvalidParamError(f"chat messages must be JSON values: {exc}", param="messages") from exc
    if isinstance(prompt, (list, tuple)) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return TokensPrompt(tuple(prompt))
    raise InvalidParamError(
        "prompt must be a string, a list of token ids or a list of chat messages", param="prompt"
    )


def _int_param(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParamError(f"{name} must be an integer, got {value!r}", param=name)
    return value


def _salt(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise InvalidParamError("cache_salt must be a string", param="cache_salt")
    return value


def _config(model: str | None, config: EngineConfig | None, options: dict[str, Any]) -> EngineConfig:
    if config is not None:
        if options:
            config = dataclasses.replace(config, **options)
        if model is not None:
            config = dataclasses.replace(config, model=model)
        return config
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise InvalidParamError(f"unknown engine option(s): {', '.join(unknown)}", param=unknown[0])
    return EngineConfig(model=model, **options)


@asynccontextmanager
async def open_engine(
    model: str | Path | None = None, *, config: EngineConfig | None = None, **options: Any
) -> AsyncIterator[Engine]:
    """Load a model, start the engine's actors, and yield the :class:`Engine`.

    ``model`` is a Hugging Face folder or a ``.gguf`` file (None: the default SmolLM2);
    ``options`` are :class:`EngineConfig` fields (``dtype="float32"``, ``max_num_seqs=8``,
    ``kv_cache_memory=...``). Loading runs in a worker thread. Leaving the block stops every
    actor; streams still open then raise ``EngineDeadError("engine closed")``.
    """
    resolved = _config(str(model) if model is not None else None, config, options)
    parts = await trio.to_thread.run_sync(build_parts, resolved)
    engine = Engine(parts)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(engine._run)
            try:
                yield engine
            finally:
                engine._die(EngineDeadError("engine closed"))
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The actors never raise into this nursery (a crash marks the engine dead), so a
        # group of one holds what the caller's own block raised (or a startup failure):
        # give it back unwrapped, as if no nursery were there.
        if len(group.exceptions) == 1:
            only = group.exceptions[0]
            raise only from only.__cause__
        raise


__all__ = [
    "Engine",
    "EngineStatistics",
    "RequestOutput",
    "RequestStream",
    "open_engine",
    "sample_ids",
]
