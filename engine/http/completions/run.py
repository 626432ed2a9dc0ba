"""One OpenAI completions or chat request in flight: :class:`Run`.

A run owns the request's engine streams (an ``AsyncExitStack``: closing it aborts what has
not finished) and pumps their outputs into its answer (:class:`Completion`). Its writers
say the answer as one JSON body (:meth:`Run.collect`) or as SSE chunks
(:meth:`Run.write_sse`); the Anthropic Messages and Responses routes reuse a run with
writers of their own, over :meth:`Run.pump_all`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import trio
from quart import request

from engine.api.metrics import RequestTimer
from engine.api.tracing import trace_headers
from engine.errors import InvalidParamError
from engine.http import sse
from engine.http.completions.answer import AnswerOptions, Completion
from engine.http.completions.protocol import CompletionRequest
from engine.http.errors import LOGGED_ELSEWHERE, APIError, error_from_exception
from engine.messages import RequestOutput

if TYPE_CHECKING:
    from engine.api import EngineLike, StreamLike

logger = logging.getLogger("engine.http")


class Run:
    """One OpenAI request in flight: the one owner of its engine streams (an
    ``AsyncExitStack``: closing it aborts what has not finished), and the two writers of
    its answer (one JSON body, or SSE chunks). What the answer says is
    :class:`Completion`'s."""

    def __init__(self, engine: EngineLike, req: CompletionRequest, timer: RequestTimer,
                 options: AnswerOptions,
                 on_close: Callable[[], None] = lambda: None, lora: str | None = None) -> None:
        self.engine = engine
        self.lora = lora  # the LoRA adapter the body's model names; None: the base model
        self.req = req
        self.options = options
        self.timer = timer
        self._on_close = on_close
        self.streams: list[StreamLike] = []
        self.error: APIError | None = None
        self._exit = AsyncExitStack()
        self._answer: Completion | None = None

    @property
    def answer(self) -> Completion:
        assert self._answer is not None  # set by submit_all
        return self._answer

    async def submit_all(self, base_id: str | None) -> None:
        """Submit every prompt before answering, so validation errors are a proper 4xx.
        ``base_id`` is the client's request id: the engine's id for its one prompt, or
        ``{base_id}-{i}`` for prompt ``i`` of several."""
        extra: dict[str, Any] = {}
        if self.lora is not None:
            extra["lora"] = self.lora
        if self.req.chat_fields is not None:
            extra["chat_options"] = self.req.chat_fields.template
        if self.req.mm_processor_kwargs is not None:
            extra["mm_processor_kwargs"] = self.req.mm_processor_kwargs
        if self.engine.config.otlp_traces_endpoint:  # the caller's trace, for the spans
            extra["trace_headers"] = trace_headers(request.headers)
        try:
            for i, prompt in enumerate(self.req.prompts):
                if base_id is not None:
                    extra["request_id"] = base_id if len(self.req.prompts) == 1 else f"{base_id}-{i}"
                extra.pop("prompt_embeds", None)
                if i < self.req.prompt_embeds:
                    prompt, extra["prompt_embeds"] = None, prompt
                stream = await self.engine.submit(
                    prompt, self.req.params, priority=self.req.priority,
                    cache_salt=self.req.cache_salt, **extra,
                )
                self._exit.push_async_exit(stream)  # sync: no checkpoint between
                self.streams.append(stream)
                self.timer.prompt(len(stream.prompt_token_ids))
                max_tokens = self.req.params.max_tokens
                if max_tokens is None:  # up to the context
                    max_tokens = self.engine.max_model_len - len(stream.prompt_token_ids)
                self.timer.params(self.req.params.n, max_tokens)
        except BaseException as exc:
            if (isinstance(exc, InvalidParamError) and exc.param == "structured_outputs"
                    and self.req.structured_param is not None):
                # The engine compiled the constraint; name the body field that carried it.
                exc.param = self.req.structured_param
            elif isinstance(exc, InvalidParamError) and exc.param == "extra_args":
                exc.param = "vllm_xargs"  # the body's name for the engine's extra_args
            with trio.CancelScope(shield=True):  # cleanup that must finish
                await self.close()
            raise
        tok = self.engine.tokenizer
        self._answer = Completion(
            self.req, self.lora or self.engine.model_name, [s.prompt_token_ids for s in self.streams],
            lambda token_id: tok.decode([token_id], skip_special_tokens=False),
            # An echoed token-id prompt shows its special tokens, as the model read them.
            lambda ids: tok.decode(ids, skip_special_tokens=False), base_id, self.options,
        )

    async def close(self) -> None:
        """Leave every stream (aborting those not finished); idempotent."""
        try:
            await self._exit.aclose()
        finally:
            self._on_close()

    async def collect(self) -> dict[str, Any]:
        self.answer.begin_collected()

        async def on_output(prompt_index: int, out: RequestOutput) -> None:
            self.answer.record(prompt_index, out)

        await self.pump_all(on_output)
        if self.error is not None:
            raise self.error
        return self.answer.response()

    async def write_sse(self, send: trio.MemorySendChannel[bytes]) -> None:
        """The SSE body: opening chunks, token chunks, then usage or an error, ``[DONE]``."""
        async with send:
            for chunk in self.answer.opening_chunks():
                await send.send(sse.event(chunk))

            # Token chunks hold floats only as logprobs.
            floats = self.req.top_logprobs is not None or self.req.prompt_logprobs is not None

            async def on_output(prompt_index: int, out: RequestOutput) -> None:
                for chunk in self.answer.stream_output(prompt_index, out):
                    await send.send(sse.event(chunk, floats))

            await self.pump_all(on_output)
            if self.error is not None:
                await send.send(sse.event(self.error.body()))
            elif self.answer.include_usage:
                await send.send(sse.event(self.answer.usage_chunk()))
            await send.send(sse.DONE)

    async def pump_all(self, on_output: Callable[[int, RequestOutput], Awaitable[None]]) -> None:
        """Feed every stream's outputs to ``on_output``; the first failure stops them all."""
        try:
            async with trio.open_nursery() as nursery:
                for i, stream in enumerate(self.streams):
                    nursery.start_soon(self._pump, i, stream, on_output, nursery.cancel_scope)
        finally:
            with trio.CancelScope(shield=True):  # cleanup that must finish
                await self.close()
            if self.error is None:
                # Cut short (the client went away): count the unfinished samples as vLLM
                # does, under finished_reason="abort".
                for index in self.answer.unfinished():
                    self.timer.output(index, 0, "abort")
        self.timer.done()

    async def _pump(self, prompt_index: int, stream: StreamLike,
                    on_output: Callable[[int, RequestOutput], Awaitable[None]],
                    cancel: trio.CancelScope) -> None:
        try:
            async for out in stream:
                if self.req.echo_only:
                    out = _prompt_only(out)
                self.timer.output(prompt_index * self.req.params.n + out.index,
                                  len(out.token_ids), out.finish_reason,
                                  out.scheduled_time)
                await on_output(prompt_index, out)
        except Exception as exc:
            if self.error is None:
                self.error = error_from_exception(exc)
                if self.error.status >= 500 and self.error.code not in LOGGED_ELSEWHERE:
                    logger.error("request %s failed", stream.request_id, exc_info=exc)
            cancel.cancel()


def _prompt_only(out: RequestOutput) -> RequestOutput:
    """An output of an echo-only request (``max_tokens`` 0) as the answer says it: the
    token the engine ran to score the prompt left out, the sample ended by its length."""
    usage = out.usage
    if usage is not None:
        usage = dataclasses.replace(usage, completion_tokens=0)
    return dataclasses.replace(
        out, text="", token_ids=(), logprobs=() if out.logprobs is not None else None,
        finish_reason="length" if out.finished else None, stop_reason=None, usage=usage)

