"""Sampling parameters of one request, validated on construction."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from engine.errors import InvalidParamError
from engine.structured.spec import StructuredOutputs

# Any unseeded request draws from the engine's generator; seeds are 64-bit like OpenAI's.
_MAX_SEED = 2**63 - 1
# Stop strings are matched against each step's text: OpenAI allows 4; 32 strings of up to
# 512 characters cover every chat format we know of and keep a step's matching cheap.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 512
# Token ids are int32 on the device; the vocabulary check proper happens at admission.
_MAX_TOKEN_ID = 2**31 - 1
# Penalties outside these make logits overflow to inf or vanish (repetition_penalty=1e-320
# divided logits into +inf); vLLM's useful range is well inside.
REPETITION_PENALTY_RANGE = (0.01, 100.0)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How to sample one request's output, mirroring vLLM's ``SamplingParams``.

    Every field is checked in ``__post_init__``; a bad value raises
    :class:`engine.errors.InvalidParamError` (a ``ValueError``) whose ``param`` names the
    field. ``temperature == 0`` means greedy. ``top_k == 0`` (or ``-1``) disables top-k,
    ``top_p == 1`` disables top-p and ``min_p == 0`` disables min-p.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # top alternatives per token; -1: the whole vocabulary
    # Logprobs of each prompt token under the model (raw: no penalties or temperature) and
    # this many top alternatives per position; None: not computed. Such a request takes no
    # prefix-cache hit, since a cached token's logits are never computed.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # The output must match this JSON schema, regex, choice or grammar (engine.structured);
    # compiled at admission, enforced token by token by the model runner.
    structured_outputs: StructuredOutputs | None = None
    # OpenAI's Predicted Outputs: text the output is expected to repeat (a file edited in
    # place). Only a source of speculative proposals: the output is the model's either way.
    prediction: str | None = None
    # vLLM's thinking_token_budget: once the reasoning holds this many tokens, the end of
    # the reasoning (``think_end_token_ids``, "</think>") is forced, token by token. The
    # reasoning starts at the first output token, or after ``think_start_token_ids`` when
    # set ("<think>", for a model that may not think at all); None: no budget.
    thinking_token_budget: int | None = None
    think_start_token_ids: tuple[int, ...] = ()
    think_end_token_ids: tuple[int, ...] = ()
    # vLLM's SamplingParams names this engine has no field for (see VLLM_ONLY_FIELDS), so
    # that a script written for vLLM runs unchanged: accepted with a value that asks for
    # nothing beyond what the engine does, refused otherwise. Read once, never stored.
    best_of: dataclasses.InitVar[int | None] = None
    detokenize: dataclasses.InitVar[bool] = True
    spaces_between_special_tokens: dataclasses.InitVar[bool] = True
    output_kind: dataclasses.InitVar[Any] = None
    truncate_prompt_tokens: dataclasses.InitVar[int | None] = None
    bad_words: dataclasses.InitVar[Sequence[str] | None] = None
    allowed_token_ids: dataclasses.InitVar[Sequence[int] | None] = None
    logits_processors: dataclasses.InitVar[Sequence[Any] | None] = None
    extra_args: dataclasses.InitVar[dict[str, Any] | None] = None
    guided_decoding: dataclasses.InitVar[StructuredOutputs | None] = None

    def __post_init__(self, best_of: int | None, detokenize: bool,
                      spaces_between_special_tokens: bool, output_kind: Any,
                      truncate_prompt_tokens: int | None, bad_words: Sequence[str] | None,
                      allowed_token_ids: Sequence[int] | None,
                      logits_processors: Sequence[Any] | None,
                      extra_args: dict[str, Any] | None,
                      guided_decoding: StructuredOutputs | None) -> None:
        _vllm_only(self, best_of=best_of, detokenize=detokenize,
                   spaces_between_special_tokens=spaces_between_special_tokens,
                   output_kind=output_kind, truncate_prompt_tokens=truncate_prompt_tokens,
                   bad_words=bad_words, allowed_token_ids=allowed_token_ids,
                   logits_processors=logits_processors, extra_args=extra_args,
                   guided_decoding=guided_decoding)
        if self.thinking_token_budget == -1 and not isinstance(self.thinking_token_budget, bool):
            object.__setattr__(self, "thinking_token_budget", None)  # vLLM's -1: no budget
        # Accept lists and dicts from callers; store hashable tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(_seq(self.stop, "stop")))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(
                self, "stop_token_ids", tuple(_seq(self.stop_token_ids, "stop_token_ids"))
            )
        if not isinstance(self.logit_bias, tuple) or not all(
            isinstance(pair, tuple) for pair in self.logit_bias
        ):
            object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        self._check()

    def _check(self) -> None:
        _int(self.n, "n", lo=1, hi=128)
        if self.prediction is not None and not isinstance(self.prediction, str):
            raise InvalidParamError(f"prediction must be text, got {type(self.prediction).__name__}",
                                    param="prediction")
        if self.max_tokens is not None:
            _int(self.max_tokens, "max_tokens", lo=1)
        _int(self.min_tokens, "min_tokens", lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParamError(
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})",
                param="min_tokens",
            )
        _float(self.temperature, "temperature", lo=0.0, hi=100.0)
        _float(self.top_p, "top_p", lo=0.0, hi=1.0, lo_open=True)
        _int(self.top_k, "top_k", lo=-1)
        _float(self.min_p, "min_p", lo=0.0, hi=1.0)
        if self.seed is not None:
            _int(self.seed, "seed", lo=-_MAX_SEED - 1, hi=_MAX_SEED)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidParamError(
                f"stop holds {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed",
                param="stop",
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidParamError("stop must hold non-empty strings", param="stop")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidParamError(
                    f"a stop string is {len(s)} characters; at most {MAX_STOP_STRING_CHARS} "
                    "are allowed", param="stop",
                )
        for t in self.stop_token_ids:
            _int(t, "stop_token_ids", lo=0, hi=_MAX_TOKEN_ID)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParamError(f"{name} must be true or false, got {getattr(self, name)!r}", param=name)
        _float(self.presence_penalty, "presence_penalty", lo=-2.0, hi=2.0)
        _float(self.frequency_penalty, "frequency_penalty", lo=-2.0, hi=2.0)
        lo, hi = REPETITION_PENALTY_RANGE
        _float(self.repetition_penalty, "repetition_penalty", lo=lo, hi=hi)
        for tok, bias in self.logit_bias:
            _int(tok, "logit_bias", lo=0, hi=_MAX_TOKEN_ID)
            _float(bias, "logit_bias", lo=-100.0, hi=100.0)
        # -1 asks for the whole vocabulary. The cap (--max-logprobs, 20 by default as in
        # vLLM and OpenAI) and the vocabulary are the engine's to check, at admission.
        if self.logprobs is not None:
            _int(self.logprobs, "logprobs", lo=-1)
        if self.prompt_logprobs is not None:
            _int(self.prompt_logprobs, "prompt_logprobs", lo=-1)
        for name in ("think_start_token_ids", "think_end_token_ids"):
            ids = tuple(_seq(getattr(self, name), name))
            for t in ids:
                _int(t, name, lo=0)
            object.__setattr__(self, name, ids)
        if self.thinking_token_budget is not None:
            _int(self.thinking_token_budget, "thinking_token_budget", lo=0)
            if not self.think_end_token_ids:
                raise InvalidParamError("thinking_token_budget needs the end-of-reasoning "
                                        "marker's token ids", param="thinking_token_budget")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise InvalidParamError(
                    "structured_outputs must be an engine.structured.StructuredOutputs",
                    param="structured_outputs")
            if self.ignore_eos:
                # The grammar ends a sample by allowing only EOS; ignoring it would leave
                # the sample nothing valid to draw.
                raise InvalidParamError("ignore_eos cannot be combined with structured_outputs",
                                        param="ignore_eos")
            if self.stop:
                # A stop string is matched on the text, not the grammar: inside a
                # constrained output it ends the answer mid-document ('{"a": {"b": 100' for
                # stop "}"), or mid tool call, as if it had finished. The constraint is a
                # promise the answer keeps, so the combination is refused.
                raise InvalidParamError(
                    "stop strings cannot be combined with a constrained output (structured "
                    "outputs, response_format, guided_* fields or tool calls generated under "
                    "the tools' grammar): a stop string could end the output before it "
                    "matches; drop `stop`, or express the end in the constraint itself",
                    param="stop")

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)


# vLLM's SamplingParams fields without a field here, and the one value of each that asks
# for nothing more than this engine does (None: only None). ``best_of`` may also equal
# ``n`` (vLLM V1 itself samples no extra sequences); ``guided_decoding`` (vLLM's older
# name for ``structured_outputs``) is taken as the engine's StructuredOutputs.
VLLM_ONLY_FIELDS: dict[str, Any] = {
    "best_of": None,
    "detokenize": True,  # the text is always detokenized
    "spaces_between_special_tokens": True,  # fast tokenizers decode so; vLLM's default
    "output_kind": None,  # the embedded API streams deltas; engine.LLM returns final outputs
    "truncate_prompt_tokens": None,
    "bad_words": None,
    "allowed_token_ids": None,
    "logits_processors": None,
    "extra_args": None,
}


def _vllm_only(params: SamplingParams, *, guided_decoding: Any, **values: Any) -> None:
    """Check the vLLM-only arguments (:data:`VLLM_ONLY_FIELDS`); maps ``guided_decoding``."""
    for name, value in values.items():
        neutral = VLLM_ONLY_FIELDS[name]
        if value is None or value == neutral or (value in ([], (), {}) and neutral is None):
            continue
        if name == "best_of" and value == params.n:
            continue
        raise InvalidParamError(
            f"{name}={value!r} is a vLLM sampling parameter this engine does not implement "
            f"(only {neutral!r} is accepted)", param=name)
    if guided_decoding is not None:
        if params.structured_outputs is not None:
            raise InvalidParamError("guided_decoding is vLLM's older name for "
                                    "structured_outputs: give one of them", param="guided_decoding")
        object.__setattr__(params, "structured_outputs", guided_decoding)


def _bias_pairs(value: Any) -> tuple[tuple[Any, Any], ...]:
    """``{token_id: bias}`` or ``(token_id, bias)`` pairs as a tuple of pairs. Dict keys may
    be numeric strings (JSON objects have string keys); ranges are checked later."""
    if isinstance(value, dict):
        try:
            return tuple((int(k), float(v)) for k, v in value.items())
        except (TypeError, ValueError):
            raise InvalidParamError("logit_bias must map token ids to numbers", param="logit_bias") from None
    pairs = _seq(value, "logit_bias")
    if not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise InvalidParamError("logit_bias must hold (token id, bias) pairs", param="logit_bias")
    return tuple(tuple(p) for p in pairs)


def _seq(value: Any, name: str) -> Sequence[Any]:
    if isinstance(value, (list, tuple)):
        return value
    raise InvalidParamError(f"{name} must be a list", param=name)


def _int(value: Any, name: str, *, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParamError(f"{name} must be an integer, got {value!r}", param=name)
    if lo is not None and value < lo:
        raise InvalidParamError(f"{name} must be >= {lo}, got {value}", param=name)
    if hi is not None and value > hi:
        raise InvalidParamError(f"{name} must be <= {hi}, got {value}", param=name)


def _float(
    value: Any, name: str, *, lo: float, hi: float, lo_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParamError(f"{name} must be a number, got {value!r}", param=name)
    if value != value:  # NaN
        raise InvalidParamError(f"{name} must be a number, got NaN", param=name)
    if (value <= lo if lo_open else value < lo) or value > hi:
        left = "(" if lo_open else "["
        raise InvalidParamError(f"{name} must be in {left}{lo}, {hi}], got {value}", param=name)


# generation_config.json keys a model's authors set as its sampling defaults; the names
# are SamplingParams' too. As in vLLM, ``do_sample`` is not read: a model that ships a
# temperature wants it used.
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The sampling defaults in a model's ``generation_config.json``: the fields of
    :data:`GENERATION_DEFAULT_FIELDS` it sets to values SamplingParams accepts (an
    invalid one is left out, so a bad file cannot break every request)."""
    out: dict[str, Any] = {}
    for name in GENERATION_DEFAULT_FIELDS:
        value = generation_config.get(name)
        if value is None:
            continue
        try:
            SamplingParams(**{name: value})
        except InvalidParamError:
            continue
        out[name] = value
    return out


def thinking_forced_token(params: SamplingParams, outputs: Sequence[int]) -> int | None:
    """The token ``params.thinking_token_budget`` forces after ``outputs`` (the next token of
    the end-of-reasoning marker), or None: no budget, the reasoning not started or already
    ended, or still within its budget."""
    budget = params.thinking_token_budget
    if budget is None:
        return None
    start, end = params.think_start_token_ids, params.think_end_token_ids
    at = 0
    if start:
        if tuple(outputs[:len(start)]) != start:
            return None  # not (yet) reasoning: the model decides whether to think
        at = len(start)
    reasoning = list(outputs[at:])
    for i in range(len(reasoning) - len(end) + 1):
        if tuple(reasoning[i:i + len(end)]) == end:
            return None  # the reasoning ended
    # How much of the marker is already written at the tail (a partial marker continues).
    written = next((k for k in range(min(len(end) - 1, len(reasoning)), 0, -1)
                    if tuple(reasoning[-k:]) == end[:k]), 0)
    if len(reasoning) - written < budget:
        return None
    return end[written]
