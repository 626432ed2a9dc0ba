"""Sampling parameters of one request, validated on construction."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping, Sequence
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
# bad_words: each word is banned token by token in every step of its request, so the
# count and length are bounded like stop strings' (a word is a few tokens in practice).
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 512
# extra_args (vLLM's, HTTP's vllm_xargs) travel to every rank with the request: a few
# keys for a logits processor, bounded so one request cannot make every step's message large.
MAX_EXTRA_ARGS_CHARS = 16_384
# Beam search: the width is bounded like n (every beam is a sequence of the batch); a
# length penalty this large already makes the score any power of the length one wants.
_MAX_BEAM_WIDTH = 128
_MAX_LENGTH_PENALTY = 100.0

# extra_args keys the engine's own processors read: a Whisper transcription's opt-in to
# its timestamp rules and to its checkpoint's suppressed tokens
# (engine.runner.whisper_timestamps). Only a Whisper model takes them.
WHISPER_TIMESTAMPS = "whisper_timestamps"
WHISPER_SUPPRESS = "whisper_suppress"
ENGINE_EXTRA_ARGS = frozenset({WHISPER_TIMESTAMPS, WHISPER_SUPPRESS})


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
    # Only these token ids may be sampled (vLLM's allowed_token_ids); None: any.
    allowed_token_ids: tuple[int, ...] | None = None
    # Words never to write (vLLM's bad_words): a word of one token is never sampled; a
    # longer one loses its last token wherever the output already ends with the rest.
    # The engine tokenizes them at admission into ``bad_words_token_ids`` (each word as
    # it starts the text and after a space, as vLLM does); ids may also be given directly.
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # Keep only the last N prompt tokens (-1: max_model_len); a text prompt keeps the
    # special tokens its tokenizer adds (BOS), as vLLM's left truncation does.
    truncate_prompt_tokens: int | None = None
    # Which end truncate_prompt_tokens cuts (vLLM's request field truncation_side): "left"
    # keeps the last N tokens, "right" the first N (a text keeps its special tokens either way).
    truncation_side: str = "left"
    # With skip_special_tokens false: false writes two adjacent special (added) tokens
    # with nothing between them, whatever the tokenizer's decoder would put there.
    spaces_between_special_tokens: bool = True
    # Per-request arguments of the server's logits processors (--logits-processors), as
    # vLLM's SamplingParams.extra_args (HTTP: vllm_xargs): JSON values under string keys;
    # also the engine's own (ENGINE_EXTRA_ARGS: Whisper's timestamp rules).
    extra_args: dict[str, Any] | None = None
    # vLLM's detokenize: False returns token ids only (the text and logprobs' decoded tokens
    # stay empty, the detokenizer does no work for the request); stop strings need text.
    detokenize: bool = True
    # Beam search (transformers' num_beams, length_penalty, early_stopping): 0 samples;
    # W > 0 keeps W beams and returns the n best finished hypotheses (n <= W).
    beam_width: int = 0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # vLLM's SamplingParams names this engine has no field for (see VLLM_ONLY_FIELDS), so
    # that a script written for vLLM runs unchanged: accepted with a value that asks for
    # nothing beyond what the engine does, refused otherwise. Read once, never stored.
    best_of: dataclasses.InitVar[int | None] = None
    output_kind: dataclasses.InitVar[Any] = None
    logits_processors: dataclasses.InitVar[Sequence[Any] | None] = None
    guided_decoding: dataclasses.InitVar[StructuredOutputs | None] = None

    def __post_init__(self, best_of: int | None, output_kind: Any,
                      logits_processors: Sequence[Any] | None,
                      guided_decoding: StructuredOutputs | None) -> None:
        _vllm_only(self, best_of=best_of, output_kind=output_kind,
                   logits_processors=logits_processors, guided_decoding=guided_decoding)
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
        if self.extra_args == {}:  # nothing for a processor to read: as if not given
            object.__setattr__(self, "extra_args", None)
        if self.bad_words is None:  # vLLM's default
            object.__setattr__(self, "bad_words", ())
        elif isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        elif not isinstance(self.bad_words, tuple):
            object.__setattr__(self, "bad_words", tuple(_seq(self.bad_words, "bad_words")))
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, tuple):
            object.__setattr__(self, "allowed_token_ids",
                               tuple(_seq(self.allowed_token_ids, "allowed_token_ids")))
        words = self.bad_words_token_ids
        if not (isinstance(words, tuple) and all(isinstance(w, tuple) for w in words)):
            object.__setattr__(self, "bad_words_token_ids", tuple(
                tuple(_seq(w, "bad_words_token_ids")) for w in _seq(words, "bad_words_token_ids")))
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
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens"):
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
        self._check_vocabulary_fields()
        self._check_beam()
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

    def _check_beam(self) -> None:
        """Beam search's fields, and the sampling fields it cannot honour refused by name:
        a beam's candidates are ranked on the raw log-softmax (transformers' beam search
        without sampling), so logits adjustments would silently change nothing or
        everything. temperature, top_p, top_k, min_p and seed do not enter a search that
        draws nothing (transformers ignores them without do_sample too)."""
        _int(self.beam_width, "beam_width", lo=0, hi=_MAX_BEAM_WIDTH)
        _float(self.length_penalty, "length_penalty", lo=-_MAX_LENGTH_PENALTY, hi=_MAX_LENGTH_PENALTY)
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise InvalidParamError('early_stopping must be true, false or "never", got '
                                    f"{self.early_stopping!r}", param="early_stopping")
        if not self.beam_width:
            if self.length_penalty != 1.0 or self.early_stopping is not False:
                name = "length_penalty" if self.length_penalty != 1.0 else "early_stopping"
                raise InvalidParamError(f"{name} applies to beam search only "
                                        "(use_beam_search / beam_width)", param=name)
            return
        if self.n > self.beam_width:
            raise InvalidParamError(f"n ({self.n}) must be at most the beam width "
                                    f"({self.beam_width})", param="n")
        refused = {
            "logprobs": self.logprobs is not None, "prompt_logprobs": self.prompt_logprobs is not None,
            "presence_penalty": self.presence_penalty != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "repetition_penalty": self.repetition_penalty != 1.0, "logit_bias": bool(self.logit_bias),
            "allowed_token_ids": self.allowed_token_ids is not None,
            "bad_words": bool(self.bad_words or self.bad_words_token_ids),
            "structured_outputs": self.structured_outputs is not None,
            "prediction": self.prediction is not None,
            "thinking_token_budget": self.thinking_token_budget is not None,
            "extra_args": self.extra_args is not None,
        }
        for name, set_ in refused.items():
            if set_:
                raise InvalidParamError(f"{name} cannot be combined with beam search", param=name)

    def _check_vocabulary_fields(self) -> None:
        """allowed_token_ids, bad_words, truncate_prompt_tokens and extra_args (their ids
        against the vocabulary are admission's to check)."""
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                # vLLM refuses it too: an empty list would leave nothing to sample.
                raise InvalidParamError("allowed_token_ids must not be empty",
                                        param="allowed_token_ids")
            for t in self.allowed_token_ids:
                _int(t, "allowed_token_ids", lo=0, hi=_MAX_TOKEN_ID)
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise InvalidParamError(f"bad_words holds {len(self.bad_words)} words; at most "
                                    f"{MAX_BAD_WORDS} are allowed", param="bad_words")
        for word in self.bad_words:
            if not isinstance(word, str) or not word.strip():
                raise InvalidParamError("bad_words must hold non-blank strings", param="bad_words")
            if len(word) > MAX_BAD_WORD_CHARS:
                raise InvalidParamError(f"a bad word is {len(word)} characters; at most "
                                        f"{MAX_BAD_WORD_CHARS} are allowed", param="bad_words")
        for ids in self.bad_words_token_ids:
            if not ids:
                raise InvalidParamError("bad_words_token_ids must hold non-empty lists",
                                        param="bad_words_token_ids")
            for t in ids:
                _int(t, "bad_words_token_ids", lo=0, hi=_MAX_TOKEN_ID)
        if not isinstance(self.detokenize, bool):
            raise InvalidParamError("detokenize must be true or false", param="detokenize")
        if not self.detokenize and self.stop:
            raise InvalidParamError("stop strings need detokenize=True (without text there "
                                    "is nothing to match them in); use stop_token_ids",
                                    param="stop")
        if self.truncation_side not in ("left", "right"):
            raise InvalidParamError('truncation_side must be "left" or "right"',
                                    param="truncation_side")
        if self.truncate_prompt_tokens is not None:
            _int(self.truncate_prompt_tokens, "truncate_prompt_tokens", lo=-1)
            if self.truncate_prompt_tokens == 0:
                raise InvalidParamError("truncate_prompt_tokens must be -1 (the model's "
                                        "context) or a positive integer",
                                        param="truncate_prompt_tokens")
        if self.extra_args is not None:
            _check_extra_args(self.extra_args)

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    def clone(self) -> SamplingParams:
        """A copy (vLLM's ``clone``): setting a field of one leaves the other as it was."""
        return copy.copy(self)


def _checked_setattr(self: SamplingParams, name: str, value: Any) -> None:
    """``params.max_tokens = 64``, as vLLM's mutable SamplingParams takes it: the change is
    checked as the constructor checks every field (a bad value raises
    :class:`InvalidParamError` and changes nothing), then the params take the checked
    values. The class is otherwise a frozen dataclass, whose ``__init__`` writes its slots
    directly, so construction pays nothing for this. The engine copies a request's params
    when it is submitted (:meth:`engine.api.Engine.prepare`): a change after that reaches
    only later requests."""
    if name not in _SAMPLING_FIELDS:
        raise AttributeError(f"SamplingParams has no field {name!r}")
    checked = dataclasses.replace(self, **{name: value})
    for field in _SAMPLING_FIELDS:
        object.__setattr__(self, field, getattr(checked, field))


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
SamplingParams.__setattr__ = _checked_setattr  # type: ignore[method-assign,assignment]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams`` (``LLM.beam_search``): ``beam_width`` beams, every one
    returned, best score first; plus transformers' ``early_stopping``. ``temperature``
    is accepted and, as in a search that draws nothing, changes nothing (the candidates
    are ranked on the raw log-softmax)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        self.sampling_params()  # every field checked where SamplingParams checks it

    def sampling_params(self) -> SamplingParams:
        """The same search as :class:`SamplingParams` (``n`` = ``beam_width``)."""
        return SamplingParams(
            n=self.beam_width, beam_width=self.beam_width, max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos, temperature=self.temperature,
            length_penalty=self.length_penalty, early_stopping=self.early_stopping,
            include_stop_str_in_output=self.include_stop_str_in_output)



@dataclasses.dataclass(frozen=True, slots=True)
class LoRARequest:
    """vLLM's ``LoRARequest`` (``vllm.lora.request``), for ``engine.LLM``'s
    ``lora_request``: an adapter's name, vLLM's integer id (unused here: the name is the
    key), and its folder (peft's ``save_pretrained`` layout) or Hub id. Any object with
    ``lora_name`` and ``lora_path`` is taken the same way."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PoolingParams:
    """vLLM's ``PoolingParams`` (``LLM.embed`` and ``LLM.classify``): what a pooling
    model's answer to one input holds. ``dimensions`` keeps the first N values of a
    Matryoshka model's embedding; ``normalize`` L2-normalises the embedding (None: as the
    model's sentence-transformers pipeline does); ``use_activation`` false gives a
    classifier's logits instead of its probabilities; ``truncate_prompt_tokens`` keeps the
    last k tokens of the input (-1: the model's limit)."""

    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
                type(self.dimensions) is not int or self.dimensions < 1):
            raise InvalidParamError("dimensions must be a positive integer", param="dimensions")
        for name in ("normalize", "use_activation"):
            if getattr(self, name) not in (None, True, False):
                raise InvalidParamError(f"{name} must be a bool or None", param=name)
        t = self.truncate_prompt_tokens
        if t is not None and (type(t) is not int or (t < 1 and t != -1)):
            raise InvalidParamError("truncate_prompt_tokens must be -1 or a positive integer",
                                    param="truncate_prompt_tokens")

# vLLM's SamplingParams fields without a field here, and the one value of each that asks
# for nothing more than this engine does (None: only None). ``best_of`` may also equal
# ``n`` (vLLM V1 itself samples no extra sequences); ``guided_decoding`` (vLLM's older
# name for ``structured_outputs``) is taken as the engine's StructuredOutputs.
VLLM_ONLY_FIELDS: dict[str, Any] = {
    "best_of": None,  # OpenAI's best_of is the completions route's (engine.http.completions)
    "output_kind": None,  # the embedded API streams deltas; engine.LLM returns final outputs
    # Code in a request: the server's own processors are --logits-processors.
    "logits_processors": None,
}


def _vllm_only(params: SamplingParams, *, guided_decoding: Any, **values: Any) -> None:
    """Check the vLLM-only arguments (:data:`VLLM_ONLY_FIELDS`); maps ``guided_decoding``."""
    for name, value in values.items():
        neutral = VLLM_ONLY_FIELDS[name]
        if value is None or value == neutral or (value in ([], (), {}) and neutral is None):
            continue
        if name == "best_of" and value == params.n:
            continue
        accepted = f"{neutral!r}, or n ({params.n})" if name == "best_of" else repr(neutral)
        raise InvalidParamError(
            f"{name}={value!r} is a vLLM sampling parameter this engine does not implement "
            f"(only {accepted} is accepted)", param=name)
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


def _check_extra_args(value: Any) -> None:
    """``extra_args``: an object of JSON values (what crosses to every rank in msgpack)."""
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise InvalidParamError("extra_args must be an object with string keys",
                                param="extra_args")
    try:
        size = len(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError):
        raise InvalidParamError("extra_args must hold JSON values (strings, numbers, "
                                "booleans, null, lists and objects)", param="extra_args") from None
    if size > MAX_EXTRA_ARGS_CHARS:
        raise InvalidParamError(f"extra_args is {size} characters as JSON; at most "
                                f"{MAX_EXTRA_ARGS_CHARS} are allowed", param="extra_args")
    if _has_key(value, _MESSAGE_TAG):
        # The engine's msgpack frames mark a message by this key (engine.messages): a
        # client's object holding it would be read back as a message in an engine core.
        raise InvalidParamError(f"extra_args may not hold the key {_MESSAGE_TAG!r}",
                                param="extra_args")


# engine.messages' tag for a packed message (a lower floor cannot import it).
_MESSAGE_TAG = "__msg__"


def _has_key(value: Any, key: str) -> bool:
    if isinstance(value, dict):
        return key in value or any(_has_key(v, key) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_key(v, key) for v in value)
    return False


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


def generation_max_tokens(generation_config: Mapping[str, Any]) -> int | None:
    """``max_new_tokens`` of a ``generation_config.json`` (transformers' name for
    ``max_tokens``) when it is a positive integer: vLLM's default ``max_tokens`` for a chat
    request that sets none. Anything else is left out, as :func:`generation_defaults` does."""
    value = generation_config.get("max_new_tokens")
    return value if type(value) is int and value >= 1 else None


# The keys vLLM's --override-generation-config takes (the rest of a generation config is
# not sampling): the defaults above, and max_new_tokens.
GENERATION_OVERRIDE_FIELDS = (*GENERATION_DEFAULT_FIELDS, "max_new_tokens")


def generation_override(value: str | Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``--override-generation-config`` (a JSON object, or a dict) checked: only
    :data:`GENERATION_OVERRIDE_FIELDS`, each at a value SamplingParams accepts
    (``max_new_tokens`` a positive integer). Raises :class:`InvalidParamError` naming the
    key, never drops one: a default the server would silently not apply is worse than
    refusing to start."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise InvalidParamError(f"not JSON: {exc}", param="override_generation_config") from None
    if not isinstance(value, Mapping):
        raise InvalidParamError("must be a JSON object", param="override_generation_config")
    out: dict[str, Any] = {}
    for key, item in value.items():
        if key not in GENERATION_OVERRIDE_FIELDS:
            raise InvalidParamError(f"{key!r} is not one of {', '.join(GENERATION_OVERRIDE_FIELDS)}",
                                    param=f"override_generation_config.{key}")
        if key == "max_new_tokens":
            if type(item) is not int or item < 1:
                raise InvalidParamError(f"max_new_tokens must be a positive integer, got {item!r}",
                                        param="override_generation_config.max_new_tokens")
        else:
            try:
                SamplingParams(**{key: item})
            except InvalidParamError as exc:
                raise InvalidParamError(str(exc), param=f"override_generation_config.{key}") from None
        out[key] = item
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
