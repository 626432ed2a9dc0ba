"""The OpenAI completions and chat requests: a body in, a :class:`CompletionRequest` out.

Everything here is pure (no I/O, no trio): a ``/v1/completions`` or ``/v1/chat/completions``
body (already decoded JSON) becomes a :class:`CompletionRequest` holding the engine prompts
and one :class:`SamplingParams`. Bad input raises :class:`APIError` (or the engine's
:class:`InvalidParamError`, which :func:`engine.http.errors.error_from_exception` maps)
naming the field. The answers are :mod:`engine.http.completions.answer`'s.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from engine.api import prompt_embeds
from engine.chat.request import (
    ChatFields,
    ChatSettings,
    chat_sampling_params,
    constraint_param,
    lax_bool,
    parse_chat_fields,
)
from engine.chat.template import normalize_messages
from engine.errors import InvalidParamError
from engine.http.completions.legacy import legacy_body, legacy_param
from engine.http.errors import APIError, rename_param
from engine.params import SamplingParams
from engine.structured import StructuredOutputs
from engine.structured.openai import FIELDS as STRUCTURED_FIELDS
from engine.structured.openai import structured_from_body

logger = logging.getLogger("engine.http")

# OpenAI's documented default for /v1/completions; chat defaults to "up to the context".
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

_COMMON_FIELDS = frozenset(
    {
        "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop",
        "stop_token_ids", "seed", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "logprobs", "ignore_eos", "min_tokens", "logit_bias", "stream",
        "stream_options", "user", "include_stop_str_in_output", "skip_special_tokens",
        # vLLM's extras: the queue priority (with --scheduling-policy priority, smaller
        # first) and a salt that keeps this request's prefix-cache entries private.
        "priority", "cache_salt", "request_id",
        # vLLM's per-request image processor options (Qwen-VL's pixel budget).
        "mm_processor_kwargs",
        # OpenAI's bookkeeping fields: they change nothing in the answer.
        "service_tier", "store", "metadata", "safety_identifier", "prompt_cache_key",
        "prompt_cache_retention",
        # vLLM's answer-shape extras: the prompt's logprobs, the token ids of the prompt
        # and the output, and logprob tokens written as "token_id:N".
        "prompt_logprobs", "return_token_ids", "return_tokens_as_token_ids",
        # vLLM's sampling extras (SamplingParams fields of the same names; vllm_xargs are
        # its extra_args, for the server's logits processors).
        "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "truncation_side",
        "spaces_between_special_tokens", "vllm_xargs",
        # vLLM's beam search (transformers' length_penalty and early_stopping).
        "use_beam_search", "length_penalty", "early_stopping",
    }
) | frozenset(STRUCTURED_FIELDS)
# Fields that change what the answer means and are not implemented: each is a 400 when
# set to anything but its no-op value (so a client never takes a plain answer for the one
# it asked for). Any other unknown field is ignored with a log line.
NOT_IMPLEMENTED: dict[str, Callable[[Any], bool]] = {
    "guided_whitespace_pattern": lambda v: v is not None,
    "logits_processors": lambda v: v not in (None, []),
    # OpenAI's chat fields for what this server cannot do: speech out, a web search, a
    # verbosity other than the default for models trained to follow it.
    "audio": lambda v: v is not None,
    "modalities": lambda v: v not in (None, ["text"]),
    "web_search_options": lambda v: v is not None,
    "verbosity": lambda v: v not in (None, "medium"),
    # Left truncation (keep the last tokens) is the one built.
    "kv_transfer_params": lambda v: v is not None,
}
# Why each refused field is refused, for the 400's message.
_NOT_IMPLEMENTED_WHY = {
    "audio": "audio output is not supported; this server writes text only",
    "modalities": 'only ["text"] output is supported',
    "web_search_options": "this server has no web search",
    "verbosity": "only the default verbosity (medium) is supported",
    "kv_transfer_params": "per-request KV transfer (a remote prefill or decode, as NIXL's) is "
                          "not built; --kv-transfer-config's folder shares prompt blocks "
                          "without it",
}
# Fields of one API only, refused by the other when they would change its answer.
_CHAT_REFUSES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "best_of": (lambda v: v not in (None, 1), "best_of is a /v1/completions field"),
    "suffix": (lambda v: v not in (None, ""), "suffix is a /v1/completions field"),
    "prompt_embeds": (lambda v: v is not None, "prompt_embeds is a /v1/completions field"),
}
_COMPLETIONS_REFUSE: dict[str, tuple[Callable[[Any], bool], str]] = {
    "functions": (lambda v: v not in (None, []), "functions are a /v1/chat/completions field"),
    "function_call": (lambda v: v not in (None, "none"),
                      "function_call is a /v1/chat/completions field"),
    "documents": (lambda v: v is not None, "documents go to a chat template "
                  "(/v1/chat/completions)"),
    "include_reasoning": (lambda v: v not in (None, True),
                          "include_reasoning applies to /v1/chat/completions (with "
                          "--reasoning-parser)"),
}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix", "prompt_embeds"}
CHAT_FIELDS = _COMMON_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "echo",
    "tools", "tool_choice", "parallel_tool_calls",
    "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "documents",
    "reasoning_effort", "prediction", "thinking_token_budget", "include_reasoning",
}
# The most samples best_of may draw: SamplingParams' own bound on n.
MAX_BEST_OF = 128


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CompletionRequest:
    """A parsed /v1/completions or /v1/chat/completions body.

    ``prompts`` holds one engine prompt per OpenAI prompt (a string, token ids or chat
    messages); each is submitted as its own engine request with ``params``.
    """

    chat: bool
    model: str | None
    prompts: tuple[Any, ...]
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool
    top_logprobs: int | None  # how many alternatives to print per token; None: no logprobs
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None  # vLLM's body field; the X-Request-Id header wins
    # Chat only: template options, how outputs are read (tools, reasoning), echo.
    chat_fields: ChatFields | None = None
    # The body field that carried params.structured_outputs (response_format.json_schema.schema,
    # guided_regex, ...): an error found when the engine compiles it names this field.
    structured_param: str | None = None
    # vLLM's extras: the prompt's logprobs with this many alternatives (-1: the whole
    # vocabulary; None: not asked, the answer's key is null); the prompt's and the
    # output's token ids; logprob tokens as "token_id:N" (None: the server's default);
    # usage on every chunk of a stream (stream_options.continuous_usage_stats).
    prompt_logprobs: int | None = None
    return_token_ids: bool = False
    tokens_as_ids: bool | None = None
    continuous_usage: bool = False
    # echo with max_tokens 0 (completions): the answer is the prompt alone, its one
    # generated token dropped, finish_reason "length", no completion tokens.
    echo_only: bool = False
    # best_of above n (completions): params.n is best_of, every sample is drawn, and the
    # answer returns this many per prompt, those of the highest cumulative logprob.
    returned_n: int | None = None
    # Fill-in-the-middle (completions): the text after the gap; the prompt is the text
    # before it. The route lays the prompt out with the tokenizer's FIM tokens.
    suffix: str | None = None
    # OpenAI's deprecated functions (chat): the answer's call as function_call (legacy.py).
    legacy_functions: bool = False
    # vLLM's prompt_embeds (completions): the first ``prompt_embeds`` of ``prompts`` are
    # [tokens, hidden] tensors; text prompts sent beside them follow (vLLM answers the
    # embeddings first).
    prompt_embeds: int = 0
    # vLLM's mm_processor_kwargs: this request's image processor options (checked by the
    # engine's image preprocessor).
    mm_processor_kwargs: dict[str, Any] | None = None


def parse_completion(body: Any, defaults: Mapping[str, Any] | None = None) -> CompletionRequest:
    """Parse a /v1/completions body; raise :class:`APIError`/``InvalidParamError``.
    ``defaults`` are the sampling defaults for fields the body leaves out."""
    body = _require_object(body)
    _refuse_not_implemented(body, _COMPLETIONS_REFUSE)
    _log_unknown(body, COMPLETION_FIELDS)
    embeds: tuple[Any, ...] = ()
    if body.get("prompt_embeds") is not None:
        embeds = _embeds_prompts(body)
    elif body.get("prompt") is None:
        raise APIError(400, "prompt is required", param="prompt", code="missing_required_parameter")
    prompts = embeds + (() if body.get("prompt") is None else _completion_prompts(body["prompt"]))
    logprobs = _opt_int(body, "logprobs")
    echo = _opt_bool(body, "echo", False)
    # echo with max_tokens 0 (OpenAI's and vLLM's way to score a text, as evaluation
    # harnesses do): the prompt and its logprobs, nothing generated. The engine runs one
    # token, which the answer leaves out (Run drops it).
    echo_only = echo and type(body.get("max_tokens")) is int and body["max_tokens"] == 0
    structured, structured_param = structured_from_body(body)
    params = _sampling_params(body, COMPLETIONS_DEFAULT_MAX_TOKENS, logprobs, defaults=defaults,
                              structured=structured, max_tokens=1 if echo_only else ...)
    stream, include_usage, continuous = _stream_flags(body)
    prompt_logprobs = _prompt_logprobs(body, stream)
    # The echoed prompt gets logprobs too, as OpenAI gives them (scoring a text this way is
    # what evaluation harnesses do); the engine scores it once for both uses.
    params = params.replace(prompt_logprobs=_most(
        prompt_logprobs, logprobs if echo else None))
    suffix = _suffix(body, prompts, echo, params)
    beam = _beam_search(body, params, stream, best_of=_opt_int(body, "best_of"))
    params, returned_n = (beam, None) if beam is not None else _best_of(body, params, stream)
    return CompletionRequest(
        chat=False, model=_model(body), prompts=prompts, params=params, stream=stream,
        include_usage=include_usage, echo=echo, top_logprobs=logprobs, **_queueing(body),
        structured_param=structured_param, **_shape_fields(body, prompt_logprobs, continuous),
        returned_n=returned_n, suffix=suffix, echo_only=echo_only, prompt_embeds=len(embeds),
    )


def _embeds_prompts(body: dict[str, Any]) -> tuple[Any, ...]:
    """vLLM's ``prompt_embeds``: one tensor per base64 string (decoded with torch's
    weights-only loader); with a field that reads the prompts' text or ids (``echo``,
    ``suffix``), a 400 naming it."""
    for name, value in (("echo", body.get("echo") not in (None, False)),
                        ("suffix", body.get("suffix") not in (None, ""))):
        if value:
            raise APIError(400, f"{name} cannot be combined with prompt_embeds (the prompt has "
                           "no text)", param=name, code="invalid_value")
    embeds = body["prompt_embeds"]
    return tuple(prompt_embeds.decode_base64(e) for e in (embeds if isinstance(embeds, list) else [embeds]))


def _best_of(body: dict[str, Any], params: SamplingParams,
             stream: bool) -> tuple[SamplingParams, int | None]:
    """OpenAI's ``best_of``: ``best_of`` samples per prompt (sample ``i`` seeded ``seed +
    i``, as for ``n``), the ``n`` of highest cumulative logprob returned. Returns the
    params that draw them (their sampled tokens' logprobs kept to rank them by) and the
    ``n`` to return, or ``None`` when best_of changes nothing (absent, or equal to n)."""
    best_of = _opt_int(body, "best_of")
    if best_of is None or best_of == params.n:
        return params, None
    if not 1 <= best_of <= MAX_BEST_OF:
        raise APIError(400, f"best_of must be in [1, {MAX_BEST_OF}], got {best_of}",
                       param="best_of", code="invalid_value")
    if best_of < params.n:
        raise APIError(400, f"best_of must be greater than or equal to n, got n={params.n}, "
                       f"best_of={best_of}", param="best_of", code="invalid_value")
    if stream:
        # Which samples are returned is known only once all of them have finished (as
        # OpenAI and vLLM, a stream cannot carry it).
        raise APIError(400, "best_of cannot be streamed: the best samples are known only "
                       "when all have finished; send stream: false, or best_of equal to n",
                       param="best_of", code="invalid_value")
    logprobs = 0 if params.logprobs is None else params.logprobs
    return params.replace(n=best_of, logprobs=logprobs), params.n


def _beam_search(body: dict[str, Any], params: SamplingParams, stream: bool, *,
                 best_of: int | None) -> SamplingParams | None:
    """vLLM's ``use_beam_search``: a beam search of width ``best_of`` (completions) or
    ``n``, returning the ``n`` best hypotheses, with transformers' ``length_penalty`` and
    ``early_stopping``; None when not asked (those two then must keep their defaults)."""
    if not lax_bool(body.get("use_beam_search"), "use_beam_search"):
        for name, default in (("length_penalty", 1.0), ("early_stopping", False)):
            if body.get(name) is not None and body[name] != default:
                raise APIError(400, f"{name} applies to beam search only (use_beam_search: true)",
                               param=name, code="invalid_value")
        return None
    width = params.n if best_of is None else best_of
    changes: dict[str, Any] = {"beam_width": width}
    if body.get("length_penalty") is not None:
        changes["length_penalty"] = body["length_penalty"]
    if body.get("early_stopping") is not None:
        early = body["early_stopping"]
        changes["early_stopping"] = early if early == "never" else lax_bool(early, "early_stopping")
    if width < params.n:
        raise APIError(400, f"best_of must be greater than or equal to n, got n={params.n}, "
                       f"best_of={width}", param="best_of", code="invalid_value")
    beam = params.replace(**changes)  # a field beam search cannot honour is refused here
    if stream:
        # The beams are ranked until the search ends: no token is final before that.
        raise APIError(400, "use_beam_search cannot be streamed: the best hypotheses are "
                       "known only when the search ends; send stream: false",
                       param="use_beam_search", code="invalid_value")
    return beam


def _suffix(body: dict[str, Any], prompts: tuple[Any, ...], echo: bool,
            params: SamplingParams) -> str | None:
    """OpenAI's ``suffix``: the text after the gap a fill-in-the-middle completion fills
    (laid out with the model's FIM tokens by the route, which has the tokenizer)."""
    suffix = body.get("suffix")
    if suffix is None or suffix == "":
        return None
    if not isinstance(suffix, str):
        raise APIError(400, "suffix must be a string", param="suffix", code="invalid_type")
    if not all(isinstance(p, str) for p in prompts):
        raise APIError(400, "suffix needs a text prompt (the text before the gap)",
                       param="suffix", code="invalid_value")
    if echo:
        raise APIError(400, "echo cannot be combined with suffix (the prompt the model reads "
                       "holds the suffix and the FIM tokens)", param="suffix",
                       code="invalid_value")
    if params.truncate_prompt_tokens is not None:
        raise APIError(400, "truncate_prompt_tokens cannot be combined with suffix (it would "
                       "cut the fill-in-the-middle layout apart)", param="suffix",
                       code="invalid_value")
    return suffix


def parse_chat(body: Any, settings: ChatSettings | None = None,
               model_template: str | None = None,
               defaults: Mapping[str, Any] | None = None) -> CompletionRequest:
    """Parse a /v1/chat/completions body; raise :class:`APIError`/``InvalidParamError``.

    ``settings`` are the server's chat flags, ``model_template`` the model's chat
    template source, ``defaults`` the sampling defaults for fields the body leaves out.
    """
    body, legacy = legacy_body(_require_object(body))
    if not legacy:
        return _parse_chat(body, settings, model_template, defaults, legacy=False)
    try:
        return _parse_chat(body, settings, model_template, defaults, legacy=True)
    except (APIError, InvalidParamError) as exc:
        if exc.param is not None:  # named as the legacy field it came from
            rename_param(exc, legacy_param(exc.param))
        raise


def _parse_chat(body: dict[str, Any], settings: ChatSettings | None, model_template: str | None,
                defaults: Mapping[str, Any] | None, *, legacy: bool) -> CompletionRequest:
    _refuse_not_implemented(body, _CHAT_REFUSES)
    _log_unknown(body, CHAT_FIELDS)
    messages = normalize_messages(body.get("messages"), images=True)
    fields = parse_chat_fields(body, settings or ChatSettings(), model_template)
    top = _opt_int(body, "top_logprobs")
    if top is not None and top < -1:
        # Checked here so the error names the chat field, not SamplingParams.logprobs.
        raise APIError(400, f"top_logprobs must be -1 (the whole vocabulary) or >= 0, got "
                       f"{top}", param="top_logprobs", code="invalid_value")
    logprobs: int | None = top if top is not None else 0
    if not _opt_bool(body, "logprobs", False):
        if top:
            raise APIError(400, "top_logprobs requires logprobs to be true",
                           param="top_logprobs", code="invalid_value")
        logprobs = None
    # OpenAI's newer name wins; a null one (clients that serialise every field) falls back.
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    structured, structured_param = structured_from_body(body)
    if fields.forced and structured_param is not None and structured_param.startswith(
            "response_format"):
        # As vLLM: a forced call's schema replaces the response_format (the answer is the
        # call, not a message in that format). An explicit structured_outputs/guided_*
        # constraint beside a forced call stays a 400 (chat_sampling_params).
        logger.info("tool_choice forces a call: response_format does not apply")
        structured, structured_param = None, None
    params = _sampling_params(body, None, logprobs, max_tokens=max_tokens, defaults=defaults,
                              structured=structured)
    params = _chat_output_params(body, params, fields)
    stream = _opt_bool(body, "stream", False)
    params = _beam_search(body, params, stream, best_of=None) or params
    prediction = _prediction(body.get("prediction"))
    if prediction is not None:
        params = params.replace(prediction=prediction)
    stream, include_usage, continuous = _stream_flags(body)
    prompt_logprobs = _prompt_logprobs(body, stream)
    params = params.replace(prompt_logprobs=prompt_logprobs)
    return CompletionRequest(
        chat=True, model=_model(body), prompts=(messages,), params=params, stream=stream,
        include_usage=include_usage, echo=fields.echo, top_logprobs=logprobs,
        chat_fields=fields, legacy_functions=legacy, **_queueing(body),
        structured_param=structured_param or constraint_param(fields, params),
        **_shape_fields(body, prompt_logprobs, continuous),
    )


def _prompt_logprobs(body: dict[str, Any], stream: bool) -> int | None:
    """The ``prompt_logprobs`` field: alternatives per prompt token, -1 for all of them."""
    value = _opt_int(body, "prompt_logprobs")
    if value is None:
        return None
    if value < -1:
        raise APIError(400, f"prompt_logprobs must be -1 (the whole vocabulary) or >= 0, "
                       f"got {value}", param="prompt_logprobs", code="invalid_value")
    if stream:
        # As vLLM: a stream has no place for them (its chunks carry the output).
        raise APIError(400, "prompt_logprobs are not available when stream is true",
                       param="prompt_logprobs", code="invalid_value")
    return value


def _most(a: int | None, b: int | None) -> int | None:
    """The larger of two logprob counts, where -1 (the whole vocabulary) is the largest."""
    if a is None or b is None:
        return b if a is None else a
    return -1 if -1 in (a, b) else max(a, b)


def _shape_fields(body: dict[str, Any], prompt_logprobs: int | None,
                  continuous: bool) -> dict[str, Any]:
    as_ids = body.get("return_tokens_as_token_ids")
    if as_ids is not None:
        as_ids = lax_bool(as_ids, "return_tokens_as_token_ids")
    return {"prompt_logprobs": prompt_logprobs,
            "return_token_ids": _opt_bool(body, "return_token_ids", False),
            "tokens_as_ids": as_ids, "continuous_usage": continuous}


def _chat_output_params(body: dict[str, Any], params: SamplingParams,
                        fields: ChatFields) -> SamplingParams:
    return chat_sampling_params(params, fields,
                                keep_skip_special_tokens=body.get("skip_special_tokens") is not None)


def _queueing(body: dict[str, Any]) -> dict[str, Any]:
    """``priority``, ``cache_salt``, ``request_id`` and ``mm_processor_kwargs``,
    type-checked; absent ones keep their defaults."""
    out: dict[str, Any] = {}
    options = body.get("mm_processor_kwargs")
    if options not in (None, {}):
        if not isinstance(options, dict):
            raise APIError(400, "mm_processor_kwargs must be an object", param="mm_processor_kwargs",
                           code="invalid_type")
        out["mm_processor_kwargs"] = options
    request_id = body.get("request_id")
    if request_id is not None:
        # The X-Request-Id header's rule: ids show up in logs, printable ASCII only.
        if not isinstance(request_id, str) or not 0 < len(request_id) <= 256 \
                or not request_id.isascii() or not request_id.isprintable():
            raise APIError(400, "request_id must be 1-256 printable ASCII characters",
                           param="request_id", code="invalid_value")
        out["request_id"] = request_id
    priority = _opt_int(body, "priority")
    if priority is not None:
        out["priority"] = priority
    salt = body.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str) or not salt:
            raise APIError(400, "cache_salt must be a non-empty string", param="cache_salt",
                           code="invalid_type")
        out["cache_salt"] = salt
    return out


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object", code="invalid_json")
    return body


def _refuse_not_implemented(body: dict[str, Any],
                            other_api: dict[str, tuple[Callable[[Any], bool], str]]) -> None:
    for name, is_set in NOT_IMPLEMENTED.items():
        if is_set(body.get(name)):
            why = _NOT_IMPLEMENTED_WHY.get(name)
            raise APIError(400, f"{name} is not supported by this server"
                           + (f": {why}" if why else ""), param=name,
                           code="unsupported_parameter")
    for name, (is_set, why) in other_api.items():
        if is_set(body.get(name)):
            raise APIError(400, f"{name} is not supported here: {why}", param=name,
                           code="unsupported_parameter")


def _log_unknown(body: dict[str, Any], known: frozenset[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        logger.info("ignoring unknown request fields: %s", ", ".join(unknown))


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, "model must be a string", param="model", code="invalid_type")
    return model


def _completion_prompts(prompt: Any) -> tuple[Any, ...]:
    """OpenAI's four prompt shapes: str, [str], [int], [[int]]."""
    if isinstance(prompt, str):
        return (prompt,)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return tuple(prompt)
        if all(is_token_id(t) for t in prompt):
            return (list(prompt),)
        if all(isinstance(p, list) and p and all(is_token_id(t) for t in p) for p in prompt):
            return tuple(list(p) for p in prompt)
    raise APIError(
        400, "prompt must be a string, a list of strings, a list of token ids or a list of "
        "token-id lists, and not empty", param="prompt", code="invalid_type",
    )


def is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    """``stream``, ``stream_options.include_usage`` and ``.continuous_usage_stats``."""
    stream = _opt_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False, False
    if not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", param="stream_options",
                       code="invalid_type")
    if not stream:
        raise APIError(400, "stream_options is only allowed when stream is true",
                       param="stream_options", code="invalid_value")
    flags = [lax_bool(options.get(name), f"stream_options.{name}")
             for name in ("include_usage", "continuous_usage_stats")]
    return stream, flags[0], flags[1]


def _opt_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    # As vLLM's pydantic models read booleans: "true" and 1 are true (lax_bool).
    return lax_bool(body.get(name), name, default)


def _opt_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise APIError(400, f"{name} must be an integer", param=name, code="invalid_type")
    return value


# Body field -> SamplingParams field, for those passed through unchanged when present
# (the booleans read as vLLM reads them, lax_bool).
_PASSTHROUGH = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_tokens", "allowed_token_ids", "bad_words",
    "truncate_prompt_tokens", "truncation_side",
)
_PASSTHROUGH_BOOLS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                      "spaces_between_special_tokens")


def _sampling_params(
    body: dict[str, Any], default_max: int | None, logprobs: int | None, *,
    max_tokens: Any = ..., defaults: Mapping[str, Any] | None = None,
    structured: StructuredOutputs | None = None,
) -> SamplingParams:
    # The model's generation defaults (--generation-config) fill only what the body omits;
    # their max_tokens is a chat's default (a completion's is OpenAI's 16), and
    # max_tokens_cap (--override-generation-config's max_new_tokens) caps every request,
    # as vLLM's get_max_tokens takes the smallest of the limits.
    kwargs: dict[str, Any] = dict(defaults or {})
    model_max = kwargs.pop("max_tokens", None)
    cap = kwargs.pop("max_tokens_cap", None)
    kwargs.update({k: body[k] for k in _PASSTHROUGH if body.get(k) is not None})
    kwargs.update({k: lax_bool(body[k], k) for k in _PASSTHROUGH_BOOLS
                   if body.get(k) is not None})
    kwargs["max_tokens"] = body.get("max_tokens") if max_tokens is ... else max_tokens
    if kwargs["max_tokens"] is None:
        kwargs["max_tokens"] = default_max if default_max is not None else model_max
    asked = kwargs["max_tokens"]
    if cap is not None and (asked is None or type(asked) is int and asked > cap):
        kwargs["max_tokens"] = cap
    if body.get("stop") is not None:
        kwargs["stop"] = parse_stop(body["stop"])
    if body.get("stop_token_ids") is not None:
        kwargs["stop_token_ids"] = body["stop_token_ids"]
    if body.get("logit_bias") is not None:
        kwargs["logit_bias"] = parse_logit_bias(body["logit_bias"])
    kwargs["logprobs"] = logprobs
    kwargs["structured_outputs"] = structured
    xargs = body.get("vllm_xargs")
    if xargs is not None:
        if not isinstance(xargs, dict):
            raise APIError(400, "vllm_xargs must be an object", param="vllm_xargs",
                           code="invalid_type")
        kwargs["extra_args"] = xargs
    try:
        return SamplingParams(**kwargs)
    except InvalidParamError as exc:
        if exc.param == "extra_args":
            exc.param = "vllm_xargs"  # the body's name for it
        raise


def parse_stop(stop: Any) -> tuple[str, ...]:
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise InvalidParamError("stop must be a string or a list of strings", param="stop")


def parse_logit_bias(bias: Any) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise InvalidParamError("logit_bias must map token ids to biases", param="logit_bias")
    try:
        return {int(k): v for k, v in bias.items()}
    except ValueError:
        raise InvalidParamError("logit_bias keys must be token ids", param="logit_bias") from None



def _prediction(value: Any) -> str | None:
    """OpenAI's Predicted Outputs: ``{"type": "content", "content": text or text parts}``;
    the text becomes the request's speculative proposals (the answer is unchanged)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "content" or set(value) - {"type", "content"}:
        raise APIError(400, 'prediction must be {"type": "content", "content": ...}',
                       param="prediction", code="invalid_value")
    content = value.get("content")
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise APIError(400, "prediction.content must be a string or an array of text parts",
                       param="prediction.content", code="invalid_type")
    return content
