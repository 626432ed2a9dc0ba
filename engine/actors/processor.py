"""The processor actor: validation, chat template, tokenization and admission control."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import trio

from engine.actors.router import sample_ids
from engine.errors import (
    InvalidParamError,
    PromptTooLongError,
    QueueFullError,
    RequestError,
)
from engine.messages import (
    ChatPrompt,
    DetokenizerRequest,
    RequestAdmitted,
    RequestRejected,
    SchedulerRequest,
    SubmitRequest,
    TextPrompt,
)
from engine.params import SamplingParams


class PromptTokenizer(Protocol):
    """What the processor needs of :class:`engine.models.tokenizer.Tokenizer`."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(
        self, messages: Sequence[Any], add_generation_prompt: bool = True
    ) -> str: ...


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessorLimits:
    max_model_len: int
    vocab_size: int
    max_queued_requests: int
    eos_token_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessorStatistics:
    admitted: int
    rejected: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Admission:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    sample_params: tuple[SamplingParams, ...]  # one per sample (n = 1, own seed)


class Processor:
    """Actor: turns each :class:`SubmitRequest` into one scheduler request per sample.

    For an admitted request it tells the detokenizer first, then the scheduler, and answers
    the router last: the detokenizer must know a sample before its first token arrives, and
    a caller who left before the answer is aborted by the router after the scheduler has the
    samples. ``queue_depth`` reports the requests waiting to be scheduled (admission control).
    """

    def __init__(
        self,
        tokenizer: PromptTokenizer,
        limits: ProcessorLimits,
        *,
        inbox: trio.MemoryReceiveChannel[SubmitRequest],
        to_detokenizer: trio.MemorySendChannel[DetokenizerRequest],
        to_scheduler: trio.MemorySendChannel[SchedulerRequest],
        to_router: trio.MemorySendChannel[RequestAdmitted | RequestRejected],
        queue_depth: Callable[[], int],
    ) -> None:
        self._tokenizer = tokenizer
        self._limits = limits
        self._inbox = inbox
        self._to_detokenizer = to_detokenizer
        self._to_scheduler = to_scheduler
        self._to_router = to_router
        self._queue_depth = queue_depth
        self._admitted = 0
        self._rejected = 0

    def statistics(self) -> ProcessorStatistics:
        return ProcessorStatistics(self._admitted, self._rejected)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self._inbox, self._to_detokenizer, self._to_scheduler, self._to_router:
            task_status.started()
            async for submit in self._inbox:
                try:
                    admission = self.admit(submit)
                except (RequestError, QueueFullError) as exc:
                    self._rejected += 1
                    await self._to_router.send(_rejected(submit.request_id, exc))
                    continue
                await self._forward(submit, admission)
                self._admitted += 1

    def admit(self, submit: SubmitRequest) -> _Admission:
        """Validate and tokenize; raises the per-request error the caller will see."""
        limits = self._limits
        if self._queue_depth() >= limits.max_queued_requests:
            raise QueueFullError(
                f"{limits.max_queued_requests} requests are already waiting; try again later"
            )
        ids = self._tokenize(submit)
        if not ids:
            raise InvalidParamError("the prompt is empty", param="prompt")
        bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise InvalidParamError(
                f"prompt token id {bad} is outside the vocabulary [0, {limits.vocab_size})",
                param="prompt",
            )
        # Checked here, per request: the sampler's own check would fail the whole step and
        # with it the engine.
        bad = next((t for t, _ in submit.params.logit_bias if t >= limits.vocab_size), None)
        if bad is not None:
            raise InvalidParamError(
                f"logit_bias token id {bad} is outside the vocabulary [0, {limits.vocab_size})",
                param="logit_bias",
            )
        max_tokens = submit.params.max_tokens
        room = limits.max_model_len - len(ids)
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise PromptTooLongError(
                prompt_tokens=len(ids),
                max_tokens=max_tokens if max_tokens is not None else 1,
                max_model_len=limits.max_model_len,
            )
        samples = tuple(_sample_params(submit.params, i) for i in range(submit.params.n))
        return _Admission(ids, max_tokens if max_tokens is not None else room, samples)

    def _tokenize(self, submit: SubmitRequest) -> tuple[int, ...]:
        prompt = submit.prompt
        if isinstance(prompt, TextPrompt):
            text = _unicode(prompt.text, "prompt")
            return tuple(self._tokenizer.encode(text, add_special_tokens=True))
        if isinstance(prompt, ChatPrompt):
            messages = json.loads(prompt.messages_json)
            text = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            text = _unicode(text, "messages")
            return tuple(self._tokenizer.encode(text, add_special_tokens=False))
        return tuple(prompt.token_ids)

    async def _forward(self, submit: SubmitRequest, admission: _Admission) -> None:
        ids = sample_ids(submit.request_id, submit.params.n)
        for index, sample_id in enumerate(ids):
            await self._to_detokenizer.send(
                DetokenizerRequest(
                    sample_id, submit.request_id, index, admission.prompt_token_ids,
                    admission.sample_params[index],
                )
            )
        for index, sample_id in enumerate(ids):
            await self._to_scheduler.send(
                SchedulerRequest(
                    request_id=sample_id,
                    prompt_token_ids=admission.prompt_token_ids,
                    params=admission.sample_params[index],
                    eos_token_ids=self._limits.eos_token_ids,
                    max_tokens=admission.max_tokens,
                    priority=submit.priority,
                    arrival_time=submit.arrival_time,
                    cache_salt=submit.cache_salt,
                    # Samples after the first wait until the first has computed (and cached)
                    # the prompt's full blocks, then take them from the prefix cache; with
                    # prompt_logprobs each computes (and scores) the prompt itself.
                    wait_for=ids[0] if index > 0 and submit.params.prompt_logprobs is None else None,
                )
            )
        await self._to_router.send(RequestAdmitted(submit.request_id, admission.prompt_token_ids))


def _unicode(text: str, param: str) -> str:
    """``text`` if it is valid Unicode. A lone surrogate (JSON's ``"\\ud800"`` decodes to
    one) makes the tokenizer raise TypeError, which would crash this actor and with it the
    engine: it is this request's error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidParamError(
            f"{param} is not valid Unicode: {exc.reason} at character {exc.start}", param=param
        ) from None
    return text


def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample ``index`` of a request: n = 1 and, when seeded, its own seed (seed + index,
    wrapped into the signed 64-bit range so the largest seeds stay valid)."""
    if params.n == 1:
        return params
    seed = None
    if params.seed is not None:
        seed = (params.seed + index + 2**63) % 2**64 - 2**63
    return params.replace(n=1, seed=seed)


def _rejected(request_id: str, exc: RequestError | QueueFullError) -> RequestRejected:
    if isinstance(exc, PromptTooLongError):
        return RequestRejected(
            request_id, "PromptTooLongError", exc.message, exc.param,
            exc.prompt_tokens, exc.max_tokens, exc.max_model_len,
        )
    param = exc.param if isinstance(exc, RequestError) else None
    return RequestRejected(request_id, type(exc).__name__, str(exc), param)
