"""A small fake of the embedded engine API (``engine.api.EngineLike``) for HTTP tests that need
exact control. It speaks the real message types (``RequestOutput``, ``EngineStatistics``).

It uses the real tokenizer of a tiny model and "generates" a fixed token cycle with one
``trio.sleep`` per step, so queue limits (429), crashes (503) and slow streams are
deterministic. KV blocks are accounted like the real engine's: a running request holds
``ceil(tokens / block_size)`` blocks until it finishes or is aborted.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import AsyncIterator
from typing import Any

import trio

from engine.actors.system import EngineStatistics
from engine.api.lora import LoraRegistry
from engine.chat.template import apply_chat_template
from engine.config import EngineConfig
from engine.errors import EngineDeadError, InvalidParamError, PromptTooLongError, QueueFullError
from engine.messages import RequestOutput, TokenLogprob, Usage
from engine.params import SamplingParams


class RequestStream:
    def __init__(self, engine: FakeEngine, request_id: str, prompt_ids: list[int],
                 receive: trio.MemoryReceiveChannel[Any]) -> None:
        self._engine = engine
        self.request_id = request_id
        self.prompt_token_ids = tuple(prompt_ids)
        self._receive = receive

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            item = await self._receive.receive()
        except trio.EndOfChannel:
            if self._engine.dead:
                raise EngineDeadError("engine actor crashed") from self._engine.dead_reason
            raise StopAsyncIteration from None
        return item

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._engine.abort(self.request_id)
        self._receive.close()


class FakeEngine:
    """An ``engine.api.EngineLike``; ``crash(exc)`` plays an actor crash."""

    def __init__(self, nursery: trio.Nursery, tokenizer: Any, config: EngineConfig,
                 step_delay: float, kv_blocks: int) -> None:
        self._nursery = nursery
        self.tokenizer = tokenizer
        self.config = config
        self.model_name = (config.served_model_names or ("fake-model",))[0]
        self.max_model_len = config.max_model_len or 512
        self.dead = False
        self.dead_reason: BaseException | None = None
        # The fake never restarts: crash() leaves it dead, as past the real one's limit.
        self.restarting = False
        self.restarts = 0
        self._step_delay = step_delay
        self._slots = trio.Semaphore(config.max_num_seqs)
        self._kv_total = kv_blocks
        self._held: dict[str, int] = {}
        self._scopes: dict[str, trio.CancelScope] = {}
        self._running = 0
        self._waiting = 0
        self._steps = 0  # generation steps of all requests: shows whether one was cut short
        self._ids = itertools.count()
        # The text every request generates, as token ids.
        self._cycle = tokenizer.encode("The quick brown fox jumps over the lazy dog. ",
                                       add_special_tokens=False)
        self.script: str | None = None
        """When set, every request generates exactly this text, then stops ("stop"): a
        test sets it to play a model's output (tool calls, reasoning)."""
        self.sampling_defaults: dict[str, Any] = {}
        self.default_max_tokens: int | None = None
        self.max_tokens_cap: int | None = None
        self.pooler = None  # it generates: the pooling routes answer 400, as a real one's
        self.loras = LoraRegistry(config, None, self.model_name)  # none served

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(running=self._running, waiting=self._waiting,
                                kv_blocks_total=self._kv_total,
                                kv_blocks_free=self._kv_total - sum(self._held.values()),
                                prefix_cache_hits=0, prefix_cache_queries=0, preemptions=0,
                                steps=self._steps, requests_finished=0)

    async def embed(self, input: Any, **options: Any) -> Any:
        await trio.lowlevel.checkpoint()
        raise InvalidParamError(f"the model {self.model_name} is a generation model: it does "
                                "not embed", param="model")

    async def classify(self, input: Any, **options: Any) -> Any:
        await trio.lowlevel.checkpoint()
        raise InvalidParamError(f"the model {self.model_name} is a generation model: it does "
                                "not classify", param="model")

    async def score(self, first: Any, second: Any, **options: Any) -> Any:
        await trio.lowlevel.checkpoint()
        raise InvalidParamError(f"the model {self.model_name} is a generation model: it does "
                                "not score", param="model")


    def core_statistics(self) -> list[tuple[int, EngineStatistics]]:
        return [(0, self.statistics())]
    def structured_statistics(self) -> None:
        """No grammar backend (the metrics report zeros)."""
        return None

    def abort(self, request_id: str) -> None:
        scope = self._scopes.get(request_id)
        if scope is not None:
            scope.cancel()

    def crash(self, exc: BaseException) -> None:
        self.dead, self.dead_reason = True, exc
        # Each stream sees its channel end while the engine is dead and raises.
        for scope in list(self._scopes.values()):
            scope.cancel()

    async def submit(self, prompt: Any, params: SamplingParams | None = None, *,
                     request_id: str | None = None, priority: int = 0,
                     cache_salt: str | None = None, chat_options: Any = None,
                     lora: str | None = None, prompt_embeds: Any = None,
                     mm_processor_kwargs: Any = None) -> RequestStream:
        await trio.lowlevel.checkpoint()
        self.loras.resolve(lora)  # the fake serves no adapter: a name is refused
        if prompt_embeds is not None:  # as an engine without --enable-prompt-embeds
            raise InvalidParamError("prompt_embeds needs --enable-prompt-embeds",
                                    param="prompt_embeds")
        # mm_processor_kwargs: a text-only model has no images for them to shape.
        if self.dead:
            raise EngineDeadError("engine is dead") from self.dead_reason
        params = params or SamplingParams()
        ids = self._prompt_ids(prompt, chat_options)
        max_tokens = params.max_tokens or self.max_model_len - len(ids)
        if len(ids) + max_tokens > self.max_model_len:
            raise PromptTooLongError(prompt_tokens=len(ids), max_tokens=max_tokens,
                                     max_model_len=self.max_model_len)
        if self._waiting >= self.config.max_queued_requests:
            raise QueueFullError("the waiting queue is full")
        rid = request_id or f"fake-{next(self._ids)}"
        # Bounded per-request output channel, as the real engine's.
        send, receive = trio.open_memory_channel[Any](16)
        self._scopes[rid] = trio.CancelScope()
        self._waiting += 1
        self._nursery.start_soon(self._run, rid, ids, params, max_tokens, send)
        return RequestStream(self, rid, ids, receive)

    async def tokenize_chat(self, messages: Any, chat_options: Any = None,
                            mm_processor_kwargs: Any = None) -> tuple[int, ...]:
        """A text-only model's: image parts refused as the real engine refuses them."""
        from engine import multimodal

        await trio.lowlevel.checkpoint()
        messages, _ = multimodal.split_images(messages, (), multimodal.MediaLimits(),
                                              model=self.model_name)
        return tuple(self._prompt_ids(messages, chat_options))

    def _prompt_ids(self, prompt: Any, chat_options: Any) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            import json

            options = json.loads(chat_options.to_json()) if chat_options is not None else {}
            text = apply_chat_template(self.tokenizer, prompt, **options)
            return self.tokenizer.encode(text, add_special_tokens=False)
        for t in prompt:
            if t >= self.tokenizer.vocab_size:
                raise InvalidParamError(f"token id {t} out of vocabulary", param="prompt")
        return list(prompt)

    async def _run(self, rid: str, ids: list[int], params: SamplingParams, max_tokens: int,
                   send: trio.MemorySendChannel[Any]) -> None:
        waiting = True
        try:
            with self._scopes[rid], send:
                async with self._slots:
                    self._waiting -= 1
                    waiting = False
                    self._running += 1
                    try:
                        await self._generate(rid, ids, params, max_tokens, send)
                    finally:
                        self._running -= 1
                        self._held.pop(rid, None)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the caller closed its stream
        finally:
            if waiting:
                self._waiting -= 1
            self._scopes.pop(rid, None)

    async def _generate(self, rid: str, ids: list[int], params: SamplingParams,
                        max_tokens: int, send: trio.MemorySendChannel[Any]) -> None:
        texts = [""] * params.n
        live = set(range(params.n))
        cycle = self._cycle
        if self.script is not None:
            cycle = self.tokenizer.encode(self.script, add_special_tokens=False)
            max_tokens = min(max_tokens, len(cycle))
        for step in range(max_tokens):
            self._held[rid] = math.ceil((len(ids) + step + 1) / self.config.block_size)
            await trio.sleep(self._step_delay)
            self._steps += 1
            for index in sorted(live):
                token = cycle[(step + index) % len(cycle)] if self.script is None else cycle[step]
                text = self.tokenizer.decode([token], skip_special_tokens=False)
                texts[index] += text
                reason = "length" if step + 1 == max_tokens else None
                if self.script is not None and step + 1 == len(cycle):
                    reason = "stop"
                stop = next((s for s in params.stop if s in texts[index]), None)
                if stop is not None:
                    reason = "stop"
                lp = None
                if params.logprobs is not None:
                    top = ((token, -0.25), (self._cycle[0], -1.5))[: params.logprobs]
                    lp = (TokenLogprob(token, -0.25, top),)
                await send.send(RequestOutput(
                    rid, index, text, (token,), reason is not None, reason, stop, lp,
                    Usage(len(ids), step + 1) if reason else None))
                if reason:
                    live.discard(index)
            if not live:
                return


@contextlib.asynccontextmanager
async def open_fake_engine(tokenizer: Any, *, step_delay: float = 0.002, kv_blocks: int = 64,
                           **options: Any) -> AsyncIterator[FakeEngine]:
    config = EngineConfig(**options)
    async with trio.open_nursery() as nursery:
        yield FakeEngine(nursery, tokenizer, config, step_delay, kv_blocks)
        nursery.cancel_scope.cancel()
