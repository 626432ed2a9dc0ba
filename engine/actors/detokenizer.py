"""The detokenizer actor: token ids to text, stop strings, logprobs, per-request outputs."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import trio

from engine.core.detokenizer import IncrementalDetokenizer
from engine.messages import (
    CORE_ANSWERS,
    DetokenizerRequest,
    OutputBatch,
    RequestOutput,
    SamplesAborted,
    StepOutputs,
    StopStringHit,
    TokenDelta,
    TokenLogprob,
    Usage,
)


@dataclasses.dataclass(slots=True)
class _Sample:
    spec: DetokenizerRequest
    detokenizer: IncrementalDetokenizer | None  # None: detokenize=False, token ids only
    completion_tokens: int = 0
    # prompt_logprobs requests: the prompt tokens' logprobs gathered so far (they arrive
    # chunk by chunk, all before or with the first token), until the first output takes them.
    prompt_logprobs: list[TokenLogprob] | None = None
    scheduled_time: float | None = None  # until the first output carries it
    # stream_interval above 1: the completion tokens handed on so far, and the output held
    # back since (merged with the next until the interval's tokens have come).
    sent_tokens: int = 0
    held: RequestOutput | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class DetokenizerStatistics:
    active: int  # samples being detokenized
    outputs: int  # outputs sent to the router
    stop_string_hits: int


class Detokenizer:
    """Actor: keeps one :class:`IncrementalDetokenizer` per sample.

    Its inbox (from the scheduler only) carries :class:`DetokenizerRequest` (passed on
    before the sample is scheduled, so before its first token can exist),
    :class:`StepOutputs` and :class:`SamplesAborted`. Each becomes at most one
    :class:`OutputBatch` for the router. When a stop string matches, the sample's final
    output goes out at once and :class:`StopStringHit` tells the scheduler to finish it, so
    its blocks are freed; tokens the scheduler still reports for it are ignored.

    ``stream_interval`` (vLLM's ``--stream-interval``): above 1, a sample's outputs are
    merged and handed on once that many completion tokens have come since the last, so a
    streamed answer is written in fewer, larger chunks; its first output and its last go
    at once.
    """

    def __init__(
        self,
        tokenizer: object,
        *,
        inbox: trio.MemoryReceiveChannel[DetokenizerRequest | StepOutputs | SamplesAborted],
        to_router: trio.MemorySendChannel[OutputBatch],
        to_scheduler: trio.MemorySendChannel[StopStringHit],
        stream_interval: int = 1,
    ) -> None:
        self._tokenizer = tokenizer
        self._interval = stream_interval
        self._inbox = inbox
        self._to_router = to_router
        self._to_scheduler = to_scheduler
        self._samples: dict[str, _Sample] = {}
        self._outputs = 0
        self._stop_hits = 0

    def statistics(self) -> DetokenizerStatistics:
        return DetokenizerStatistics(len(self._samples), self._outputs, self._stop_hits)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self._inbox, self._to_router, self._to_scheduler:
            task_status.started()
            async for message in self._inbox:
                if isinstance(message, DetokenizerRequest):
                    self._add(message)
                    continue
                if isinstance(message, CORE_ANSWERS):
                    await self._to_router.send(message)  # the caller's answer, in order
                    continue
                if isinstance(message, SamplesAborted):
                    # A stop string may already have ended a sample: it is gone from here.
                    aborted = (TokenDelta(s, (), (), "abort", None) for s in message.sample_ids)
                    outputs, hits = self._apply(aborted)
                else:
                    outputs, hits = self.process(message)
                for hit in hits:
                    await self._to_scheduler.send(hit)
                if outputs:
                    self._outputs += len(outputs)
                    await self._to_router.send(
                        OutputBatch(tuple(o for _, o in outputs), tuple(s for s, _ in outputs)))

    def _add(self, spec: DetokenizerRequest) -> None:
        params = spec.params
        detokenizer = None if not params.detokenize else IncrementalDetokenizer(
            self._tokenizer,  # type: ignore[arg-type]
            spec.prompt_token_ids if spec.prompt_is_text else (),
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )
        prompt_logprobs: list[TokenLogprob] | None = [] if params.prompt_logprobs is not None else None
        self._samples[spec.sample_id] = _Sample(spec, detokenizer, prompt_logprobs=prompt_logprobs)

    def process(
        self, step: StepOutputs
    ) -> tuple[tuple[tuple[str, RequestOutput], ...], list[StopStringHit]]:
        """One step's deltas to (sample id, output) pairs (pure apart from the per-sample
        state)."""
        for sample_id, when in step.scheduled:
            sample = self._samples.get(sample_id)
            if sample is not None:
                sample.scheduled_time = when
        for scored in step.prompt_logprobs:
            sample = self._samples.get(scored.sample_id)
            if sample is not None and sample.prompt_logprobs is not None:
                sample.prompt_logprobs.extend(scored.logprobs)
        return self._apply(step.deltas)

    def _apply(
        self, deltas: Iterable[TokenDelta]
    ) -> tuple[tuple[tuple[str, RequestOutput], ...], list[StopStringHit]]:
        outputs: list[tuple[str, RequestOutput]] = []
        hits: list[StopStringHit] = []
        for delta in deltas:
            sample = self._samples.get(delta.sample_id)
            if sample is None:
                continue  # finished by a stop string, or aborted
            if delta.finish_reason == "error":
                # Text held back stays unsent: the router turns this into the caller's
                # RequestFailedError.
                del self._samples[delta.sample_id]
                outputs.append((delta.sample_id, _failed_output(sample, delta)))
                continue
            output, hit = self._output(sample, delta)
            if output.finished:
                del self._samples[delta.sample_id]
            if hit is not None:
                hits.append(hit)
                self._stop_hits += 1
            if output.finished or output.token_ids or output.text:
                if sample.scheduled_time is not None:
                    output = dataclasses.replace(output, scheduled_time=sample.scheduled_time)
                    sample.scheduled_time = None
                if sample.prompt_logprobs is not None:
                    # The first output a caller sees carries them; None scores token 0.
                    output = dataclasses.replace(output, prompt_logprobs=(None, *sample.prompt_logprobs))
                    sample.prompt_logprobs = None
                if self._interval > 1:
                    output = self._paced(sample, output)
                if output is not None:
                    outputs.append((delta.sample_id, output))
        return tuple(outputs), hits

    def _paced(self, sample: _Sample, output: RequestOutput) -> RequestOutput | None:
        """``output`` merged after what the sample holds; handed on (returned) when it is
        the sample's first or last, or the interval's tokens have come since the last one
        handed on; else held (None)."""
        if sample.held is not None:
            output, sample.held = _merged(sample.held, output), None
        due = sample.sent_tokens == 0 or sample.completion_tokens - sample.sent_tokens >= self._interval
        if output.finished or due:
            sample.sent_tokens = sample.completion_tokens
            return output
        sample.held = output
        return None

    def _output(
        self, sample: _Sample, delta: TokenDelta
    ) -> tuple[RequestOutput, StopStringHit | None]:
        sample.completion_tokens += len(delta.token_ids)
        ids = delta.token_ids
        if delta.finish_reason == "stop" and ids and not sample.spec.params.include_stop_str_in_output:
            # The scheduler stops on a token (EOS or one of stop_token_ids). As in vLLM, that
            # token's text is left out like a stop string's, unless asked for; its id stays.
            ids = ids[:-1]
        text = ""
        finish_reason = delta.finish_reason
        stop_reason: str | int | None = delta.stop_reason
        hit = None
        if sample.detokenizer is not None:
            update = sample.detokenizer.push(ids)
            text = update.text
            if update.stopped:
                finish_reason, stop_reason = "stop", update.stop_reason
                if delta.finish_reason is None:
                    hit = StopStringHit(delta.sample_id, update.stop_reason or "")
            elif finish_reason is not None:
                final = sample.detokenizer.finish()
                text += final.text
                if final.stopped:
                    finish_reason, stop_reason = "stop", final.stop_reason
        spec = sample.spec
        finished = finish_reason is not None
        return (
            RequestOutput(
                request_id=spec.request_id,
                index=spec.index,
                text=text,
                token_ids=delta.token_ids,
                finished=finished,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
                logprobs=_logprobs(delta) if spec.params.logprobs is not None else None,
                usage=Usage(len(spec.prompt_token_ids), sample.completion_tokens,
                            delta.num_cached_tokens, delta.prediction_tokens) if finished else None,
                pooled=delta.pooled,
                cumulative_logprob=delta.cumulative_logprob,
                beam_score=delta.beam_score,
            ),
            hit,
        )


def _merged(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one sample as one: the text, ids and logprobs of both,
    the rest the later one's (what only a first output carries, the earlier one's)."""
    logprobs = (None if first.logprobs is None and then.logprobs is None
                else (*(first.logprobs or ()), *(then.logprobs or ())))
    return dataclasses.replace(
        then, text=first.text + then.text, token_ids=first.token_ids + then.token_ids,
        logprobs=logprobs,
        prompt_logprobs=then.prompt_logprobs if first.prompt_logprobs is None else first.prompt_logprobs,
        scheduled_time=then.scheduled_time if first.scheduled_time is None else first.scheduled_time)


def _failed_output(sample: _Sample, delta: TokenDelta) -> RequestOutput:
    spec = sample.spec
    return RequestOutput(
        request_id=spec.request_id, index=spec.index, text="", token_ids=(), finished=True,
        finish_reason="error", stop_reason=delta.stop_reason, logprobs=None,
        usage=Usage(len(spec.prompt_token_ids), sample.completion_tokens),
    )


def _logprobs(delta: TokenDelta) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(s.token_id, s.logprob, s.top_logprobs) for s in delta.logprobs)
