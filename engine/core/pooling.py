"""Pooling requests (embed, score, rerank) before and after the engine: pure, no I/O.

A pooling request is one prompt that ends once its prompt is computed: the model runner
pools its hidden states in the step of its last chunk (see ``ModelRunner._run_pooling``),
and the scheduler frees its blocks then. Here: turning a caller's inputs into token ids
(with ``truncate_prompt_tokens``), the admission checks, and what is done to the pooled
vector afterwards (Matryoshka ``dimensions`` and normalisation, cosine similarity, a
classifier's probabilities).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from engine.core.admission import AdmissionLimits, _check_vocab, _unicode
from engine.errors import InputTooLongError, InvalidParamError, QueueFullError
from engine.messages import AdmittedRequest, DetokenizerRequest, LoraAdapter, SchedulerRequest
from engine.params import SamplingParams

# What a pooling request carries through the engine's sampling-shaped path: one "sample"
# step (the pooled output), nothing drawn.
POOLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, skip_special_tokens=False)


@dataclasses.dataclass(frozen=True, slots=True)
class Pooled:
    """One input's pooled output: ``data`` is the vector as little-endian float32 bytes
    (an embedding, or a classifier's logits); ``prompt_tokens`` its input's length."""

    data: bytes
    prompt_tokens: int

    def vector(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype="<f4")

    def tolist(self) -> list[float]:
        return self.vector().astype(np.float64).tolist()

    def matrix(self) -> np.ndarray:
        """Per-token output (``token_embed``): one row a prompt token."""
        return self.vector().reshape(self.prompt_tokens, -1)


def input_ids(
    tokenizer: Any, item: str | Sequence[int], *, truncate: int | None, max_model_len: int,
    param: str = "input", add_special_tokens: bool = True,
) -> tuple[int, ...]:
    """Token ids of one input (text with the tokenizer's special tokens unless
    ``add_special_tokens`` is false, or ids as given).

    ``truncate`` is vLLM's ``truncate_prompt_tokens``: keep only the last ``k`` tokens
    (``-1``: the model's ``max_model_len``); text keeps its special tokens ([CLS] ...
    [SEP]) and loses content tokens from the left, as vLLM's left-truncating tokenizer."""
    return input_ids_many(tokenizer, [item], truncate=truncate, max_model_len=max_model_len,
                          param=param, add_special_tokens=add_special_tokens)[0]


def input_ids_many(
    tokenizer: Any, items: Sequence[str | Sequence[int]], *,
    truncate: int | None | Sequence[int | None], max_model_len: int, param: str = "input",
    add_special_tokens: bool = True,
) -> list[tuple[int, ...]]:
    """:func:`input_ids` of each of ``items``, in order, the texts tokenized in one call of
    the tokenizer (30-34 against 48-51 us a 25-token sentence one call each, 16 or 512
    sentences: the per-call cost is most of a short text's). ``truncate``: one for all, or
    one per item. The first bad text or limit raises, before any is tokenized."""
    limits = ([_truncation(t, max_model_len) for t in truncate] if isinstance(truncate, Sequence)
              else [_truncation(truncate, max_model_len)] * len(items))
    out: list[tuple[int, ...] | None] = [None] * len(items)
    whole: list[int] = []  # texts kept whole, and texts with a limit
    cut: list[int] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            _unicode(item, param)
            (whole if limits[i] is None else cut).append(i)
        else:
            ids, limit = tuple(item), limits[i]
            out[i] = ids[-limit:] if limit is not None and len(ids) > limit else ids
    backend = tokenizer.backend_tokenizer
    # encode_batch_fast: the same ids without the character offsets, which nothing here
    # reads (35 against 43 us a 25-token sentence).
    if whole:
        encodings = backend.encode_batch_fast([items[i] for i in whole],
                                              add_special_tokens=add_special_tokens)
        for i, encoding in zip(whole, encodings, strict=True):
            out[i] = tuple(encoding.ids)
    if cut:
        specials = backend.num_special_tokens_to_add(False) if add_special_tokens else 0
        encodings = backend.encode_batch_fast([items[i] for i in cut], add_special_tokens=False)
        for i, encoding in zip(cut, encodings, strict=True):
            room = max(limits[i] - specials, 0)
            if len(encoding.ids) > room:
                encoding.truncate(room, direction="left")
            out[i] = tuple(backend.post_process(encoding).ids if add_special_tokens else encoding.ids)
    return out  # type: ignore[return-value]  # every slot filled above


def pair_ids(
    tokenizer: Any, first: str, second: str, *, truncate: int | None, max_model_len: int
) -> tuple[int, ...]:
    """A cross-encoder's input: ``[CLS] first [SEP] second [SEP]`` (the tokenizer's pair
    template); truncation takes tokens from the longer text first (the tokenizers
    library's ``longest_first``, sentence-transformers' CrossEncoder default)."""
    backend = tokenizer.backend_tokenizer
    a = backend.encode(_unicode(first, "query"), add_special_tokens=False)
    b = backend.encode(_unicode(second, "documents"), add_special_tokens=False)
    limit = _truncation(truncate, max_model_len)
    if limit is not None:
        room = max(limit - backend.num_special_tokens_to_add(True), 0)
        while len(a.ids) + len(b.ids) > room:
            longer = a if len(a.ids) >= len(b.ids) else b
            longer.truncate(len(longer.ids) - 1)
    return tuple(backend.post_process(a, b).ids)


def _truncation(truncate: int | None, max_model_len: int) -> int | None:
    if truncate is None:
        return None
    if isinstance(truncate, bool) or not isinstance(truncate, int) or (truncate < 1 and truncate != -1):
        raise InvalidParamError("truncate_prompt_tokens must be -1 or a positive integer",
                                param="truncate_prompt_tokens")
    if truncate > max_model_len:
        raise InvalidParamError(
            f"truncate_prompt_tokens ({truncate}) exceeds the model's maximum input length "
            f"({max_model_len})", param="truncate_prompt_tokens")
    return max_model_len if truncate == -1 else truncate


def admit(
    request_id: str, ids: tuple[int, ...], limits: AdmissionLimits, *, waiting: int,
    priority: int, arrival_time: float, param: str = "input", tokens: bool = False,
    lora: LoraAdapter | None = None,
) -> AdmittedRequest:
    """One pooling input past admission: queue room, a non-empty prompt inside the
    vocabulary and no longer than the model takes (an :class:`InputTooLongError` naming
    the limit). ``tokens``: its output is every prompt token's hidden state; ``lora``:
    the adapter it runs with (a decoder embedder's)."""
    if waiting >= limits.max_queued_requests:
        raise QueueFullError(
            f"{limits.max_queued_requests} requests are already waiting; try again later")
    if not ids:
        raise InvalidParamError("an input is empty", param=param)
    _check_vocab(ids, limits.vocab_size, param, "token id")
    if len(ids) > limits.max_model_len:
        raise InputTooLongError(prompt_tokens=len(ids), max_model_len=limits.max_model_len,
                                param=param)
    params = POOLING_PARAMS
    sample = SchedulerRequest(
        sample_id=request_id, prompt_token_ids=ids, params=params, eos_token_ids=(),
        max_tokens=1, priority=priority, arrival_time=arrival_time, cache_salt=None,
        wait_for=None, pool_tokens=tokens, lora=lora,
    )
    return AdmittedRequest(request_id, (sample,),
                           (DetokenizerRequest(request_id, request_id, 0, ids, params),))


# The most bytes one per-token output (token_embed, token_classify: float32 rows of the
# model's width, a token each) may take: it crosses an engine core's wire as one message,
# whose frame is bounded (engine.process.wire, 64 MiB), and comes back as JSON.
MAX_TOKEN_OUTPUT_BYTES = 32 * 2**20


def check_token_output(tokens: int, width: int) -> None:
    """Refuse a per-token request whose output would exceed :data:`MAX_TOKEN_OUTPUT_BYTES`."""
    size = tokens * width * 4
    if size > MAX_TOKEN_OUTPUT_BYTES:
        raise InvalidParamError(
            f"an input of {tokens} tokens gives {size} bytes of per-token output ({width} "
            f"values a token); at most {MAX_TOKEN_OUTPUT_BYTES} bytes are returned: send a "
            f"shorter input (at most {MAX_TOKEN_OUTPUT_BYTES // (4 * width)} tokens) or set "
            "truncate_prompt_tokens", param="input")


def check_dimensions(dimensions: int | None, matryoshka: tuple[int, ...] | None, size: int) -> None:
    """``dimensions`` is honoured only where the model was trained to be cut there."""
    if dimensions is None:
        return
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
        raise InvalidParamError("dimensions must be a positive integer", param="dimensions")
    if matryoshka is None:
        raise InvalidParamError(
            "this model does not support dimensions: its embeddings cannot be shortened "
            "(it is not a Matryoshka model)", param="dimensions")
    if dimensions not in matryoshka:
        shown = (f"1 to {size}" if len(matryoshka) == size and matryoshka[-1] == size
                 else ", ".join(map(str, matryoshka)))
        raise InvalidParamError(f"dimensions {dimensions} is not supported; this model "
                                f"supports {shown}", param="dimensions")


def embedding(pooled: Pooled, dimensions: int | None, normalize: bool) -> Pooled:
    """What a request gets from the runner's pooled vector (which is never normalised):
    its first ``dimensions`` values (all of them for None), L2-normalised in float64 when
    ``normalize`` (the model's own choice, or the request's ``normalize``)."""
    if dimensions is None and not normalize:
        return pooled
    vector = pooled.vector()[:dimensions]
    if normalize:  # 3 us a 384-value vector
        wide = vector.astype(np.float64)
        vector = wide * (1.0 / max(math.sqrt(wide @ wide), 1e-12))  # torch's F.normalize eps
    return Pooled(vector.astype("<f4").tobytes(), pooled.prompt_tokens)


def token_embeddings(pooled: Pooled, normalize: bool) -> Pooled:
    """A per-token output with each row L2-normalised in float64 when ``normalize``, as
    :func:`embedding` normalises one vector."""
    if not normalize:
        return pooled
    rows = pooled.matrix().astype(np.float64)
    norms = np.maximum(np.sqrt((rows * rows).sum(1, keepdims=True)), 1e-12)
    return Pooled((rows / norms).astype("<f4").tobytes(), pooled.prompt_tokens)


def token_class_probs(pooled: Pooled, activation: bool = True) -> Pooled:
    """A token classifier's answer: each token's row of :func:`class_probs` (float32),
    or with ``activation`` false its logits."""
    if not activation:
        return pooled
    logits = pooled.matrix().astype(np.float64)
    if logits.shape[1] == 1:
        probs = 1.0 / (1.0 + np.exp(-logits))
    else:
        shifted = np.exp(logits - logits.max(1, keepdims=True))
        probs = shifted / shifted.sum(1, keepdims=True)
    return Pooled(probs.astype("<f4").tobytes(), pooled.prompt_tokens)


def cosine(a: Pooled, b: Pooled) -> float:
    """Cosine similarity of two embeddings, in float64."""
    x, y = a.vector().astype(np.float64), b.vector().astype(np.float64)
    denom = max(float(np.linalg.norm(x)) * float(np.linalg.norm(y)), 1e-12)
    return float(np.dot(x, y) / denom)


def class_probs(pooled: Pooled, activation: bool = True) -> list[float]:
    """A classifier's answer: the probability of each label (the sigmoid of a one-label
    model's logit, else the softmax of the logits, as vLLM's classify), or with
    ``activation`` false the logits themselves (vLLM's ``use_activation``)."""
    logits = pooled.vector().astype(np.float64)
    if not activation:
        return logits.tolist()
    if len(logits) == 1:
        return [classifier_score(pooled)]
    shifted = np.exp(logits - logits.max())
    return (shifted / shifted.sum()).tolist()


def classifier_score(pooled: Pooled) -> float:
    """A one-label cross-encoder's score: the sigmoid of its logit (sentence-transformers'
    CrossEncoder default, and vLLM's)."""
    logit = float(pooled.vector()[0])
    return 1.0 / (1.0 + math.exp(-logit)) if logit >= 0 else math.exp(logit) / (1.0 + math.exp(logit))
