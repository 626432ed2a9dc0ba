"""What :class:`engine.LLM` returns, in the shape of vLLM's offline outputs, so a script
that reads ``output.outputs[0].text`` runs unchanged.

A generation request gives a :class:`GenerationRequestOutput` (vLLM's ``RequestOutput``:
``prompt``, ``prompt_token_ids``, ``prompt_logprobs``, ``outputs``) holding one
:class:`CompletionOutput` per sample (``index``, ``text``, ``token_ids``,
``cumulative_logprob``, ``logprobs``, ``finish_reason``, ``stop_reason``). Logprobs are
vLLM's: one ``{token_id: Logprob}`` dict per position, the chosen token first, then the
top alternatives. A pooling request gives an :class:`EmbeddingRequestOutput`,
:class:`ClassificationRequestOutput` or :class:`ScoringRequestOutput`, whose ``outputs``
is one value (``embedding``, ``probs``, ``score``).

:class:`GenerationAccumulator` builds a generation output from the embedded API's
per-step deltas (:class:`engine.messages.RequestOutput`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from engine.messages import RequestOutput, TokenLogprob


@dataclasses.dataclass(slots=True)
class Logprob:
    """One token's log probability at one position: ``rank`` is its place by probability
    (1: the most likely) where known, ``decoded_token`` its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's logprobs: the token there and the top alternatives, by token id.
PositionLogprobs = dict[int, Logprob]


@dataclasses.dataclass(slots=True)
class CompletionOutput:
    """One sample of a generation request (vLLM's ``CompletionOutput``).

    ``cumulative_logprob`` is the sum of the sampled tokens' logprobs, set where the
    request asked for ``logprobs`` (None otherwise, as vLLM) and for a beam search's
    hypotheses (with ``beam_score``, the score they are ranked by). ``finish_reason`` is
    ``"stop"`` (EOS, a stop string or stop token: ``stop_reason`` says which, None for EOS),
    ``"length"`` or ``"abort"``."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    beam_score: float | None = None  # a beam search hypothesis's length-penalised score

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(slots=True)
class GenerationRequestOutput:
    """One prompt's result (vLLM's ``RequestOutput``). ``prompt`` is the prompt's text
    (the rendered chat template for :meth:`engine.LLM.chat`; None for token ids);
    ``prompt_token_ids`` None for a prompt given as embeddings, as vLLM's;
    ``prompt_logprobs`` one entry per prompt token (None for the first) where asked for;
    ``outputs`` the samples in index order; ``num_cached_tokens`` the prompt tokens
    served from the prefix cache."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int | None = None


@dataclasses.dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass(slots=True)
class ClassificationOutput:
    """The class probabilities: the softmax of the logits, or the sigmoid of a one-label
    classifier's logit (as vLLM's classify and sentence-transformers' CrossEncoder)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclasses.dataclass(slots=True)
class ScoringOutput:
    score: float


@dataclasses.dataclass(slots=True)
class PoolingOutput:
    """vLLM's generic pooled output (``LLM.encode``): ``data`` a float32 tensor, the
    embedding (task ``embed``) or the class probabilities (``classify``)."""

    data: Any


@dataclasses.dataclass(slots=True)
class PoolingRequestOutput:
    """One input's pooled result; as in vLLM, the embedding, classification and score
    outputs below are pooling outputs whose ``outputs`` is of their own kind."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True


@dataclasses.dataclass(slots=True)
class EmbeddingRequestOutput(PoolingRequestOutput):
    outputs: EmbeddingOutput


@dataclasses.dataclass(slots=True)
class ClassificationRequestOutput(PoolingRequestOutput):
    outputs: ClassificationOutput


@dataclasses.dataclass(slots=True)
class ScoringRequestOutput(PoolingRequestOutput):
    """One pair's score. ``prompt_token_ids`` is the pair as the model read it: both
    texts together for a cross-encoder, the first's tokens then the second's for an
    embedding model (which embeds each on its own)."""

    outputs: ScoringOutput


@dataclasses.dataclass(slots=True)
class BeamSearchSequence:
    """One hypothesis of :meth:`engine.LLM.beam_search` (vLLM's ``BeamSearchSequence``):
    ``tokens`` the prompt's and the hypothesis's, ``cum_logprob`` the sum of its tokens'
    logprobs, ``text`` the hypothesis's text (the prompt's left out), ``score`` the
    length-penalised score it was ranked by."""

    tokens: list[int]
    cum_logprob: float
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    score: float | None = None


@dataclasses.dataclass(slots=True)
class BeamSearchOutput:
    """One prompt's beam search: its hypotheses, best score first."""

    sequences: list[BeamSearchSequence]


def beam_search_output(result: GenerationRequestOutput) -> BeamSearchOutput:
    """A beam search request's :class:`GenerationRequestOutput` in vLLM's beam shape."""
    return BeamSearchOutput([
        BeamSearchSequence(result.prompt_token_ids + o.token_ids, o.cumulative_logprob or 0.0,
                           o.text, o.finish_reason, o.stop_reason, o.beam_score)
        for o in result.outputs])


class _Sample:
    __slots__ = ("beam_score", "cumulative_logprob", "finish_reason", "logprobs",
                 "stop_reason", "text", "token_ids")

    def __init__(self) -> None:
        self.cumulative_logprob: float | None = None  # a beam search hypothesis's
        self.beam_score: float | None = None
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None


class GenerationAccumulator:
    """Collects one request's streamed outputs into a :class:`GenerationRequestOutput`.

    ``decode`` turns one token id into its text (for logprobs' ``decoded_token``); it is
    called only where the request asked for logprobs."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: Sequence[int] | None,
                 *, logprobs: bool, decode: Callable[[int], str | None]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = None if prompt_token_ids is None else list(prompt_token_ids)
        self._want_logprobs = logprobs
        self._decode = decode
        self._samples: dict[int, _Sample] = {}
        self._prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
        self.cached_tokens: int | None = None
        self.output_tokens = 0

    def add(self, out: RequestOutput) -> None:
        sample = self._samples.get(out.index)
        if sample is None:
            sample = self._samples[out.index] = _Sample()
        sample.text.append(out.text)
        sample.token_ids.extend(out.token_ids)
        self.output_tokens += len(out.token_ids)
        if out.logprobs:
            sample.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None and self._prompt_logprobs is None:
            self._prompt_logprobs = out.prompt_logprobs
        if out.cumulative_logprob is not None:
            sample.cumulative_logprob, sample.beam_score = out.cumulative_logprob, out.beam_score
        if out.finished:
            sample.finish_reason = out.finish_reason
            sample.stop_reason = out.stop_reason
            if out.usage is not None:
                self.cached_tokens = out.usage.cached_tokens

    def result(self) -> GenerationRequestOutput:
        outputs = []
        for index in sorted(self._samples):
            sample = self._samples[index]
            logprobs = ([self._position(lp) for lp in sample.logprobs]
                        if self._want_logprobs else None)
            outputs.append(CompletionOutput(
                index=index, text="".join(sample.text), token_ids=sample.token_ids,
                cumulative_logprob=(sum(lp.logprob for lp in sample.logprobs)
                                    if self._want_logprobs else sample.cumulative_logprob),
                logprobs=logprobs, finish_reason=sample.finish_reason,
                stop_reason=sample.stop_reason, beam_score=sample.beam_score))
        prompt_logprobs = (None if self._prompt_logprobs is None else
                           [None if lp is None else self._position(lp)
                            for lp in self._prompt_logprobs])
        return GenerationRequestOutput(
            request_id=self.request_id, prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids, prompt_logprobs=prompt_logprobs,
            outputs=outputs, finished=all(s.finish_reason is not None for s in
                                          self._samples.values()),
            num_cached_tokens=self.cached_tokens)

    def _position(self, lp: TokenLogprob) -> PositionLogprobs:
        """vLLM's dict for one position: the token there first (its rank: given for a
        prompt token, else its place in the top list, None when outside it), then the
        top alternatives ranked by their order."""
        ranks = {token: rank for rank, (token, _) in enumerate(lp.top, start=1)}
        rank = lp.rank if lp.rank is not None else ranks.get(lp.token_id)
        out = {lp.token_id: Logprob(lp.logprob, rank, self._decode(lp.token_id))}
        for token, value in lp.top:
            if token not in out:
                out[token] = Logprob(value, ranks[token], self._decode(token))
        return out
