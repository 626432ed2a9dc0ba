"""The OpenAI wire protocol: request bodies in, response bodies and stream chunks out.

Everything here is pure (no I/O, no trio): a request body (already decoded JSON) becomes a
:class:`CompletionRequest` holding the engine prompts and one :class:`SamplingParams`; engine
outputs become OpenAI-shaped dicts. Bad input raises :class:`APIError` (or the engine's
:class:`InvalidParamError`, which :func:`error_from_exception` maps) naming the field.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine.chat.output import ChatDelta, ChatOutputParser
from engine.chat.request import (
    ChatFields,
    ChatSettings,
    calls_constrained,
    chat_sampling_params,
    constraint_param,
    parse_chat_fields,
)
from engine.chat.template import normalize_messages
from engine.errors import (
    EngineDeadError,
    InvalidParamError,
    PromptTooLongError,
    QueueFullError,
    RequestError,
    RequestFailedError,
)
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
        "priority", "cache_salt",
        # OpenAI's bookkeeping fields: they change nothing in the answer.
        "service_tier", "store", "metadata", "safety_identifier", "prompt_cache_key",
        "prompt_cache_retention",
        # vLLM's answer-shape extras: the prompt's logprobs, the token ids of the prompt
        # and the output, and logprob tokens written as "token_id:N".
        "prompt_logprobs", "return_token_ids", "return_tokens_as_token_ids",
    }
) | frozenset(STRUCTURED_FIELDS)
# Fields that change what the answer means and are not implemented: each is a 400 when
# set to anything but its no-op value (so a client never takes a plain answer for the one
# it asked for). Any other unknown field is ignored with a log line.
NOT_IMPLEMENTED: dict[str, Callable[[Any], bool]] = {
    "best_of": lambda v: v not in (None, 1),
    "use_beam_search": lambda v: v not in (None, False),
    "suffix": lambda v: v not in (None, ""),
    "functions": lambda v: v not in (None, []),
    "function_call": lambda v: v not in (None, "none"),
    "guided_whitespace_pattern": lambda v: v is not None,
    "prompt_embeds": lambda v: v is not None,
    "logits_processors": lambda v: v not in (None, []),
    # OpenAI's chat fields for what this server cannot do: speech out, a web search, a
    # verbosity other than the default for models trained to follow it.
    "audio": lambda v: v is not None,
    "modalities": lambda v: v not in (None, ["text"]),
    "web_search_options": lambda v: v is not None,
    "verbosity": lambda v: v not in (None, "medium"),
    # vLLM's sampling extras that change the answer and are not built.
    "truncate_prompt_tokens": lambda v: v is not None,
    "allowed_token_ids": lambda v: v is not None,
    "bad_words": lambda v: v not in (None, []),
    "length_penalty": lambda v: v not in (None, 1, 1.0),
    "spaces_between_special_tokens": lambda v: v not in (None, True),
    "include_reasoning": lambda v: v not in (None, True),
    "documents": lambda v: v is not None,
    "vllm_xargs": lambda v: v is not None,
    "kv_transfer_params": lambda v: v is not None,
    # vLLM's per-request image processor options: they change an image's token count, and
    # only the server's --mm-processor-kwargs is taken.
    "mm_processor_kwargs": lambda v: v not in (None, {}),
}
# Why each refused field is refused, for the 400's message.
_NOT_IMPLEMENTED_WHY = {
    "audio": "audio output is not supported; this server writes text only",
    "modalities": 'only ["text"] output is supported',
    "web_search_options": "this server has no web search",
    "verbosity": "only the default verbosity (medium) is supported",
    "documents": "documents for retrieval-augmented chat templates are not supported",
    "include_reasoning": "false is not supported; leave out --reasoning-parser instead",
    "mm_processor_kwargs": "per-request image processor options are not supported; "
                           "the server's --mm-processor-kwargs applies to every request",
}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo"}
CHAT_FIELDS = _COMMON_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "echo",
    "tools", "tool_choice", "parallel_tool_calls",
    "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "reasoning_effort", "prediction", "thinking_token_budget",
}
class APIError(Exception):
    """An error answered as OpenAI's ``{"error": {...}}`` body with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def error_from_exception(exc: BaseException) -> APIError:
    """Map an engine error to its HTTP status and OpenAI error body.

    A request's own failure is a 4xx; the engine being dead is a 503. Anything else is a
    500 whose message hides internals (they go to the log instead).
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return APIError(400, exc.message, param=exc.param, code="context_length_exceeded")
    if isinstance(exc, RequestError):
        return APIError(400, exc.message, param=exc.param, code="invalid_value")
    if isinstance(exc, QueueFullError):
        return APIError(
            429, str(exc) or "The server is at capacity; retry later.",
            type="rate_limit_error", code="queue_full",
        )
    if isinstance(exc, RequestFailedError):
        # The message is the engine's own reason (e.g. NaN logits), never internal text.
        return APIError(500, f"The request failed inside the engine: {exc}",
                        type="internal_error", code="request_failed")
    if isinstance(exc, EngineDeadError):
        # The cause (an internal exception) goes to the log, not to the client.
        return APIError(
            503, "The engine is not serving right now (it is restarting or has stopped); "
            "retry later.", type="service_unavailable", code="engine_dead",
        )
    return APIError(500, "Internal server error.", type="internal_error", code="internal_error")


# The deepest JSON a request may hold: chat messages with tool calls nest about 8 levels,
# a JSON schema for structured output a few dozen; a thousand levels crashed the parser
# and the chat template with RecursionError (a 500).
MAX_JSON_DEPTH = 64
# The most values (array items and object members, counted by their commas) a request may
# hold, checked before it is parsed: a 128k-token context as token ids is 131,072 values,
# and eight of them in one batch about a million. Parsed, a value costs 30 to 60 bytes, so
# this bounds a body's parsed size to tens of MB whatever --max-request-bytes allows (a
# 3.7 MiB body held 1.9 M ids).
MAX_JSON_VALUES = 1 << 20
# The most arrays and objects a request may hold: parsing allocates each one under the
# GIL, and past about 100,000 the garbage collector's passes make it superlinear (a
# million one-item lists took 1.3 s, every other thread stopped). A chat of 10,000
# messages with 128 tools holds about 20,000.
MAX_JSON_CONTAINERS = 1 << 16
# A \uD800-\uDFFF escape: the only way a lone surrogate gets into a body that decoded as
# UTF-8, so the only case that needs the full check.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")
# A JSON string, written as runs of plain characters between escapes: one
# "(?:[^"\\]|\\.)*" alternation per character held the GIL 1.3 s over a 4 MB prompt.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_JSON_BRACKETS = re.compile(r"[\[\]{}]")
_BRACKET_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def loads_body(data: bytes, max_values: int = MAX_JSON_VALUES) -> Any:
    """Decode a request body as strict JSON, or raise a 400 :class:`APIError`.

    Refused: invalid UTF-8 or JSON, ``NaN``/``Infinity`` and numbers that overflow to
    them, nesting deeper than :data:`MAX_JSON_DEPTH`, more than ``max_values`` values
    (before anything is parsed), and lone surrogates (``"\\ud800"``) in any string, key or
    value; the error names the field where it can. Runs in C but for a sum over the
    brackets; a worker thread is still the place for a large body.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, "The request body is not valid UTF-8.", code="invalid_json") from None
    # Strings hold no structure: blank them; what is left counts the values (by their
    # commas) and the brackets, whose deepest nesting is a running sum.
    structure = _JSON_STRING.sub('""', text)
    values = structure.count(",") + 1
    if values > max_values:
        raise APIError(400, f"The request JSON holds about {values} values (array items "
                       f"and object members); at most {max_values} are accepted. A prompt "
                       "of token ids holds at most the model's context length.",
                       code="too_many_values")
    containers = structure.count("[") + structure.count("{")
    if containers > MAX_JSON_CONTAINERS:
        raise APIError(400, f"The request JSON holds {containers} arrays and objects; at "
                       f"most {MAX_JSON_CONTAINERS} are accepted.", code="too_many_values")
    brackets = _JSON_BRACKETS.findall(structure)
    depth = max(itertools.accumulate(_BRACKET_STEP[b] for b in brackets), default=0)
    if depth > MAX_JSON_DEPTH:
        raise APIError(400, f"The request JSON nests {depth} levels deep; at most "
                       f"{MAX_JSON_DEPTH} are allowed.", code="invalid_json")
    try:
        body = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    if not _SURROGATE_ESCAPE.search(text):
        return body
    try:
        # Escapes like \ud800 become lone surrogates only once parsed; one C-speed
        # encode of the parsed body finds them.
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        param = _surrogate_path(body, "")
        raise APIError(400, f"{param or 'A string'} holds a lone surrogate (invalid Unicode).",
                       param=param or None, code="invalid_value") from None
    return body


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _surrogate_path(value: Any, path: str) -> str | None:
    """The path (``messages[0].content``) of the first string holding a lone surrogate."""
    if isinstance(value, str):
        return path if _has_surrogate(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            if _has_surrogate(key):
                return path or key
            found = _surrogate_path(item, f"{path}.{key}" if path else key)
            if found is not None:
                return found
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _surrogate_path(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


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


def parse_completion(body: Any, defaults: Mapping[str, Any] | None = None) -> CompletionRequest:
    """Parse a /v1/completions body; raise :class:`APIError`/``InvalidParamError``.
    ``defaults`` are the sampling defaults for fields the body leaves out."""
    body = _require_object(body)
    _refuse_not_implemented(body)
    _log_unknown(body, COMPLETION_FIELDS)
    if "prompt" not in body:
        raise APIError(400, "prompt is required", param="prompt", code="missing_required_parameter")
    prompts = _completion_prompts(body["prompt"])
    logprobs = _opt_int(body, "logprobs")
    echo = _opt_bool(body, "echo", False)
    structured, structured_param = structured_from_body(body)
    params = _sampling_params(body, COMPLETIONS_DEFAULT_MAX_TOKENS, logprobs, defaults=defaults,
                              structured=structured)
    stream, include_usage, continuous = _stream_flags(body)
    prompt_logprobs = _prompt_logprobs(body, stream)
    # The echoed prompt gets logprobs too, as OpenAI gives them (scoring a text this way is
    # what evaluation harnesses do); the engine scores it once for both uses.
    params = params.replace(prompt_logprobs=_most(
        prompt_logprobs, logprobs if echo else None))
    return CompletionRequest(
        chat=False, model=_model(body), prompts=prompts, params=params, stream=stream,
        include_usage=include_usage, echo=echo, top_logprobs=logprobs, **_queueing(body),
        structured_param=structured_param, **_shape_fields(body, prompt_logprobs, continuous),
    )


def parse_chat(body: Any, settings: ChatSettings | None = None,
               model_template: str | None = None,
               defaults: Mapping[str, Any] | None = None) -> CompletionRequest:
    """Parse a /v1/chat/completions body; raise :class:`APIError`/``InvalidParamError``.

    ``settings`` are the server's chat flags, ``model_template`` the model's chat
    template source, ``defaults`` the sampling defaults for fields the body leaves out.
    """
    body = _require_object(body)
    _refuse_not_implemented(body)
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
    prediction = _prediction(body.get("prediction"))
    if prediction is not None:
        params = params.replace(prediction=prediction)
    stream, include_usage, continuous = _stream_flags(body)
    prompt_logprobs = _prompt_logprobs(body, stream)
    params = params.replace(prompt_logprobs=prompt_logprobs)
    return CompletionRequest(
        chat=True, model=_model(body), prompts=(messages,), params=params, stream=stream,
        include_usage=include_usage, echo=fields.echo, top_logprobs=logprobs,
        chat_fields=fields, **_queueing(body),
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
    if as_ids is not None and not isinstance(as_ids, bool):
        raise APIError(400, "return_tokens_as_token_ids must be a boolean",
                       param="return_tokens_as_token_ids", code="invalid_type")
    return {"prompt_logprobs": prompt_logprobs,
            "return_token_ids": _opt_bool(body, "return_token_ids", False),
            "tokens_as_ids": as_ids, "continuous_usage": continuous}


def _chat_output_params(body: dict[str, Any], params: SamplingParams,
                        fields: ChatFields) -> SamplingParams:
    return chat_sampling_params(params, fields,
                                keep_skip_special_tokens=body.get("skip_special_tokens") is not None)


def _queueing(body: dict[str, Any]) -> dict[str, Any]:
    """``priority`` and ``cache_salt``, type-checked; absent ones keep their defaults."""
    out: dict[str, Any] = {}
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


def _refuse_not_implemented(body: dict[str, Any]) -> None:
    for name, is_set in NOT_IMPLEMENTED.items():
        if is_set(body.get(name)):
            why = _NOT_IMPLEMENTED_WHY.get(name)
            raise APIError(400, f"{name} is not supported by this server"
                           + (f": {why}" if why else ""), param=name,
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
        if all(_is_token_id(t) for t in prompt):
            return (list(prompt),)
        if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
            return tuple(list(p) for p in prompt)
    raise APIError(
        400, "prompt must be a string, a list of strings, a list of token ids or a list of "
        "token-id lists, and not empty", param="prompt", code="invalid_type",
    )


def _is_token_id(value: Any) -> bool:
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
    flags = []
    for name in ("include_usage", "continuous_usage_stats"):
        value = options.get(name)
        if value is not None and not isinstance(value, bool):
            raise APIError(400, f"stream_options.{name} must be a boolean",
                           param=f"stream_options.{name}", code="invalid_type")
        flags.append(bool(value))
    return stream, flags[0], flags[1]


def _opt_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"{name} must be a boolean", param=name, code="invalid_type")
    return value


def _opt_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise APIError(400, f"{name} must be an integer", param=name, code="invalid_type")
    return value


# Body field -> SamplingParams field, for those passed through unchanged when present.
_PASSTHROUGH = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens",
    "include_stop_str_in_output", "skip_special_tokens",
)


def _sampling_params(
    body: dict[str, Any], default_max: int | None, logprobs: int | None, *,
    max_tokens: Any = ..., defaults: Mapping[str, Any] | None = None,
    structured: StructuredOutputs | None = None,
) -> SamplingParams:
    # The model's generation defaults (--generation-config) fill only what the body omits.
    kwargs: dict[str, Any] = dict(defaults or {})
    kwargs.update({k: body[k] for k in _PASSTHROUGH if body.get(k) is not None})
    kwargs["max_tokens"] = body.get("max_tokens") if max_tokens is ... else max_tokens
    if kwargs["max_tokens"] is None:
        kwargs["max_tokens"] = default_max
    if body.get("stop") is not None:
        kwargs["stop"] = _stop(body["stop"])
    if body.get("stop_token_ids") is not None:
        kwargs["stop_token_ids"] = body["stop_token_ids"]
    if body.get("logit_bias") is not None:
        kwargs["logit_bias"] = _logit_bias(body["logit_bias"])
    kwargs["logprobs"] = logprobs
    kwargs["structured_outputs"] = structured
    return SamplingParams(**kwargs)


def _stop(stop: Any) -> tuple[str, ...]:
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise InvalidParamError("stop must be a string or a list of strings", param="stop")


def _logit_bias(bias: Any) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise InvalidParamError("logit_bias must map token ids to biases", param="logit_bias")
    try:
        return {int(k): v for k, v in bias.items()}
    except ValueError:
        raise InvalidParamError("logit_bias keys must be token ids", param="logit_bias") from None


# ---------------------------------------------------------------------------------------
# Responses


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def now() -> int:
    return int(time.time())


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AnswerOptions:
    """The server's flags that shape answers, named as vLLM's ``serve`` flags."""

    # usage.prompt_tokens_details ({"cached_tokens": N}, the prefix cache's hit) on every
    # answer (--enable-prompt-tokens-details); vLLM leaves it out by default.
    prompt_tokens_details: bool = False
    # Every stream ends with a usage chunk, as if it asked stream_options.include_usage
    # (--enable-force-include-usage).
    force_include_usage: bool = False
    # Logprob tokens as "token_id:N" for requests that do not say
    # (--return-tokens-as-token-ids; the request's return_tokens_as_token_ids wins).
    tokens_as_token_ids: bool = False


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


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
               prediction: tuple[int, int] | None = None) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        # OpenAI's field for the prompt-cache hit; here, the prefix cache's.
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if prediction is not None:
        # OpenAI's Predicted Outputs counts: proposal tokens the output kept, and those
        # it did not (which OpenAI bills as completion tokens; here they cost compute only).
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": prediction[0], "rejected_prediction_tokens": prediction[1]}
    return usage


TokenText = Callable[[int], str]


def token_id_text(token_id: int) -> str:
    """A logprob token written as its id (return_tokens_as_token_ids), as vLLM writes it:
    every token can be named, even one that is not whole UTF-8 on its own."""
    return f"token_id:{token_id}"


@dataclasses.dataclass(frozen=True, slots=True)
class Unscored:
    """A token with no logprob: an echoed prompt's first, which nothing precedes."""

    token_id: int
    logprob: None = None
    top: None = None


def prompt_logprob_entries(
    prompt_token_ids: Sequence[int], prompt_logprobs: Sequence[Any]
) -> list[Any]:
    """An echoed prompt's tokens as :func:`completion_logprobs` entries (first unscored)."""
    return [Unscored(prompt_token_ids[0]), *prompt_logprobs[1:]]


def top_entries(lp: Any, limit: int | None) -> list[tuple[int, float]]:
    """One token's alternatives as vLLM lists them: the chosen token first, then the most
    likely others, best first (the chosen one not twice); at most ``limit`` (None: all).
    So the chosen token is always there, and ``logprobs: 0`` still names it."""
    entries = [(lp.token_id, lp.logprob), *((t, v) for t, v in lp.top if t != lp.token_id)]
    return entries if limit is None else entries[:limit]


def completion_logprobs(
    logprobs: Sequence[Any], token_text: TokenText, text_offset: int, top: int | None = None,
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object for a run of tokens.

    Each ``top_logprobs`` dict holds the chosen token and ``top`` alternatives (-1 or
    None: all the entries have), so ``top + 1`` keys at most, as OpenAI documents and vLLM
    sends. An entry whose ``logprob`` is None (an echoed prompt's first token) gets nulls.
    ``text_offset`` counts the tokens' texts on from ``text_offset`` (an echoed prompt's
    tokens, then the output's: one running count, as vLLM's).
    """
    limit = None if top is None or top < 0 else top + 1
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for lp in logprobs:
        text = token_text(lp.token_id)
        tokens.append(text)
        token_logprobs.append(lp.logprob)
        tops.append(None if lp.logprob is None else
                    {token_text(t): v for t, v in top_entries(lp, limit)})
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(logprobs: Sequence[Any], token_text: TokenText, top: int = 0
                  ) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``;
    ``top_logprobs`` lists ``top`` entries (-1: all), the chosen token first (vLLM's)."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    limit = None if top < 0 else top
    content = []
    for lp in logprobs:
        item = entry(lp.token_id, lp.logprob)
        item["top_logprobs"] = [entry(t, v) for t, v in top_entries(lp, limit)]
        content.append(item)
    return {"content": content}


def prompt_logprobs_list(scores: Sequence[Any], top: int, token_text: TokenText
                         ) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, null for the first (nothing scores
    it), else ``{token id: {logprob, rank, decoded_token}}`` for the token and its ``top``
    most likely alternatives (-1: all the entries have); ``rank`` 1 is the most likely."""
    limit = None if top < 0 else top
    out: list[dict[str, Any] | None] = []
    for lp in scores:
        if lp is None:
            out.append(None)
            continue
        entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                    "decoded_token": token_text(lp.token_id)}}
        alternatives = lp.top if limit is None else lp.top[:limit]
        for rank, (t, v) in enumerate(alternatives, 1):
            entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": token_text(t)})
        out.append(entry)
    return out


def completion_choice(
    index: int, text: str, finish_reason: str | None, stop_reason: Any,
    logprobs: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def chat_choice(
    index: int, text: str, finish_reason: str | None, stop_reason: Any,
    logprobs: dict[str, Any] | None, message: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A chat choice; ``message`` (from a chat output parser: reasoning, tool calls)
    replaces the plain ``{"role": "assistant", "content": text}``."""
    return {
        "index": index,
        "message": message or {"role": "assistant", "content": text, "reasoning": None},
        "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason,
    }


def response_body(
    chat: bool, request_id: str, created: int, model: str, choices: list[dict[str, Any]],
    usage: dict[str, Any],
) -> dict[str, Any]:
    return {
        "id": request_id, "object": "chat.completion" if chat else "text_completion",
        "created": created, "model": model, "choices": choices, "usage": usage,
    }


def chunk_body(
    chat: bool, request_id: str, created: int, model: str, choices: list[dict[str, Any]],
    include_usage: bool, usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created, "model": model, "choices": choices,
    }
    if include_usage:
        # OpenAI sends "usage": null on every chunk but the last when usage is requested.
        body["usage"] = usage
    return body


def chunk_choice(
    chat: bool, index: int, text: str | None, finish_reason: str | None, stop_reason: Any,
    logprobs: dict[str, Any] | None, role: bool = False,
    delta_fields: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One choice of a stream chunk; ``delta_fields`` (reasoning, tool_calls, content
    from a chat output parser) replace the plain text delta."""
    if not chat:
        return completion_choice(index, text or "", finish_reason, stop_reason, logprobs)
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if delta_fields is not None:
        delta.update(delta_fields)
    elif text is not None:
        delta["content"] = text
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return choice


# One request's choices as engine outputs arrive


@dataclasses.dataclass(slots=True)
class _Choice:
    """What one choice (one sample of one prompt) has produced so far."""

    index: int
    # Reads reasoning and tool calls out of the text, when the request asks for them.
    parser: ChatOutputParser | None = None
    text: str = ""
    logprobs: list[Any] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    # The prompt's scores (prompt_logprobs, or echo + logprobs): None for the first token,
    # then one TokenLogprob per token; from the choice's first output.
    prompt_scores: Sequence[Any] | None = None
    finish_reason: str | None = None
    stop_reason: Any = None
    tokens: int = 0
    cached: int = 0  # prompt tokens the prefix cache served this sample
    prediction: tuple[int, int] | None = None  # Predicted Outputs: (accepted, rejected)
    # Streamed: logprobs and ids of tokens that are not yet text (half a UTF-8 character),
    # held for the chunk that completes the text.
    held: list[Any] = dataclasses.field(default_factory=list)
    held_ids: list[int] = dataclasses.field(default_factory=list)
    offset: int = 0  # the next logprob token's text_offset
    echoed: bool = False  # streamed: the echo chunk went out
    ids_sent: bool = False  # streamed: prompt_token_ids went out (return_token_ids)


class Completion:
    """The choices of one OpenAI request as engine outputs arrive, and the bodies that say
    them: echo, logprob alignment, usage. Pure: the HTTP app feeds it outputs and writes
    the dicts it returns (one response body, or SSE chunks).

    ``prompt_token_ids`` holds each prompt's ids (one engine request per prompt, ``n``
    choices each); ``token_text`` is one token's text and ``decode`` a token-id prompt's
    (its special tokens kept, so an echo shows what the model read); ``base_id`` is the
    client's request id, if it sent one; ``options`` the server's answer flags. A chat
    choice whose request asks for tools or reasoning reads them out of its text with a
    :class:`ChatOutputParser`.
    """

    def __init__(
        self, req: CompletionRequest, model: str, prompt_token_ids: Sequence[Sequence[int]],
        token_text: TokenText, decode: Callable[[list[int]], str], base_id: str | None = None,
        options: AnswerOptions | None = None,
    ) -> None:
        self.req = req
        options = options or AnswerOptions()
        prefix = "chatcmpl-" if req.chat else "cmpl-"
        self.id = prefix + base_id if base_id else new_id(req.chat)
        self.created = now()
        self.model = model
        self._prompt_ids = prompt_token_ids
        self._decoded_token = token_text
        as_ids = req.tokens_as_ids if req.tokens_as_ids is not None else options.tokens_as_token_ids
        self._token_text = token_id_text if as_ids else token_text
        self._decode = decode
        self._details = options.prompt_tokens_details
        self._n = req.params.n
        # A stream ends with usage when asked, or always with --enable-force-include-usage;
        # continuous_usage_stats puts usage on every chunk too (only with the final one).
        self.include_usage = req.stream and (req.include_usage or options.force_include_usage)
        self._continuous = self.include_usage and req.continuous_usage
        fields = req.chat_fields
        output = fields.output if fields is not None and fields.output.parses else None
        self._forced = fields is not None and fields.forced
        constrained = fields is not None and calls_constrained(fields, req.params)
        self.choices = [_Choice(i, ChatOutputParser(output, constrained=constrained)
                                if output is not None else None)
                        for i in range(len(prompt_token_ids) * self._n)]
        # With logprobs, a streamed echo waits for the prompt's logprobs, which come with
        # the choice's first output; without, it goes out at once.
        self._echo_later = req.echo and req.top_logprobs is not None

    def echo_text(self, choice: _Choice) -> str:
        prompt = self.req.prompts[choice.index // self._n]
        if self.req.chat:
            # Chat echo (vLLM's): the last message's content, when it is the assistant's
            # (a prefill the model continues).
            last = prompt[-1]
            content = last.get("content") if last.get("role") == "assistant" else None
            return content if isinstance(content, str) else ""
        return prompt if isinstance(prompt, str) else self._decode(list(prompt))

    def unfinished(self) -> list[int]:
        return [c.index for c in self.choices if c.finish_reason is None]

    def _prompt_of(self, choice: _Choice) -> Sequence[int]:
        return self._prompt_ids[choice.index // self._n]

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(ids) for ids in self._prompt_ids)
        # One prompt's cached tokens: its samples share the prompt, so the most any of them
        # found (samples after the first find what the first cached).
        n = self._n
        cached = sum(max(c.cached for c in self.choices[i * n:(i + 1) * n])
                     for i in range(len(self._prompt_ids)))
        predicted = [c.prediction for c in self.choices if c.prediction is not None]
        prediction = (sum(a for a, _ in predicted), sum(r for _, r in predicted)) if predicted else None
        return usage_dict(prompt, sum(c.tokens for c in self.choices),
                          cached if self._details else None, prediction)

    def record(self, prompt_index: int, out: Any) -> _Choice:
        """Add one engine output of prompt ``prompt_index`` to its choice."""
        choice = self.choices[prompt_index * self._n + out.index]
        if choice.prompt_scores is None and out.prompt_logprobs is not None:
            choice.prompt_scores = out.prompt_logprobs
        choice.text += out.text
        choice.tokens += len(out.token_ids)
        choice.token_ids.extend(out.token_ids)
        if out.logprobs:
            choice.logprobs.extend(out.logprobs)
        if out.finished:
            choice.finish_reason = out.finish_reason
            choice.stop_reason = out.stop_reason
            if out.usage is not None:
                choice.cached = out.usage.cached_tokens
                choice.prediction = out.usage.prediction_tokens
        return choice

    def _echo_entries(self, choice: _Choice, scores: Sequence[Any] | None) -> list[Any]:
        """The echoed prompt's logprob entries (first unscored), from its scores."""
        if scores is None:
            return []
        return prompt_logprob_entries(self._prompt_of(choice), scores)

    def _completion_logprobs(self, entries: Sequence[Any], choice: _Choice) -> dict[str, Any]:
        """:func:`completion_logprobs` of a choice's next tokens, offsets running on."""
        body = completion_logprobs(entries, self._token_text, choice.offset, self.req.top_logprobs)
        if body["tokens"]:
            choice.offset = body["text_offset"][-1] + len(body["tokens"][-1])
        return body

    def _prompt_logprobs(self, choice: _Choice) -> list[dict[str, Any] | None] | None:
        if self.req.prompt_logprobs is None or choice.prompt_scores is None:
            return None
        return prompt_logprobs_list(choice.prompt_scores, self.req.prompt_logprobs,
                                    self._decoded_token)

    # -- collected ----------------------------------------------------------------------

    def begin_collected(self) -> None:
        if self.req.echo:
            for choice in self.choices:
                choice.text = self.echo_text(choice)

    def response(self) -> dict[str, Any]:
        """The whole (non-streamed) response body."""
        ids = self.req.return_token_ids
        if self.req.chat:
            choices = [{**self._chat_choice(c), "token_ids": c.token_ids if ids else None}
                       for c in self.choices]
        else:
            # vLLM's extra keys are there, null, when not asked for.
            choices = [{**completion_choice(c.index, c.text, c.finish_reason, c.stop_reason,
                                            self._all_logprobs(c)),
                        "prompt_logprobs": self._prompt_logprobs(c),
                        "prompt_token_ids": list(self._prompt_of(c)) if ids else None,
                        "token_ids": c.token_ids if ids else None}
                       for c in self.choices]
        body = response_body(self.req.chat, self.id, self.created, self.model, choices,
                             self.usage())
        if self.req.chat:
            # One prompt: its scores and ids belong to the response (vLLM's keys).
            body["prompt_logprobs"] = self._prompt_logprobs(self.choices[0])
            body["prompt_token_ids"] = list(self._prompt_ids[0]) if ids else None
        return body

    def _chat_choice(self, choice: _Choice) -> dict[str, Any]:
        logprobs = self._all_logprobs(choice)
        parser = choice.parser
        if parser is None:
            return chat_choice(choice.index, choice.text, choice.finish_reason,
                               choice.stop_reason, logprobs)
        echo = self.echo_text(choice) if self.req.echo else ""
        parser.feed(choice.text[len(echo):])
        parser.finish()
        message = parser.message(cut_short=choice.finish_reason == "length").to_openai()
        if self._forced:
            # A forced call's answer has empty content and a list of calls (empty when
            # max_tokens cut the only call short), as vLLM sends it.
            message["content"] = message["content"] or ""
            message.setdefault("tool_calls", [])
        if echo:
            message["content"] = echo + (message["content"] or "")
        message.setdefault("reasoning", None)  # vLLM's key, null without reasoning
        return chat_choice(choice.index, choice.text, parser.finish_reason(choice.finish_reason),
                           choice.stop_reason, logprobs, message=message)

    def _all_logprobs(self, choice: _Choice) -> dict[str, Any] | None:
        if self.req.top_logprobs is None:
            return None
        if self.req.chat:
            return chat_logprobs(choice.logprobs, self._token_text, self.req.top_logprobs)
        choice.offset = 0
        if not self.req.echo:
            return self._completion_logprobs(choice.logprobs, choice)
        # The prompt's tokens first, then the completion's, one running text_offset.
        scored = self._completion_logprobs(self._echo_entries(choice, choice.prompt_scores),
                                           choice)
        generated = self._completion_logprobs(choice.logprobs, choice)
        return {key: scored[key] + generated[key] for key in generated}

    # -- streamed -----------------------------------------------------------------------

    def opening_chunks(self) -> list[dict[str, Any]]:
        """What a stream starts with: each chat choice's role, or each echo (no logprobs)."""
        if self.req.chat:
            top = ({"prompt_token_ids": list(self._prompt_ids[0])}
                   if self.req.return_token_ids else {})
            return [self._chunk(chunk_choice(
                True, c.index, self.echo_text(c) if self.req.echo else "", None, None, None,
                role=True), c, top) for c in self.choices]
        if self.req.echo and not self._echo_later:
            return [self._echo_chunk(c, None) for c in self.choices]
        return []

    def stream_output(self, prompt_index: int, out: Any) -> list[dict[str, Any]]:
        """Record one engine output; the chunks to send for it (none while its tokens are
        not yet text)."""
        choice = self.choices[prompt_index * self._n + out.index]
        chunks = []
        if self._echo_later and not choice.echoed:
            entries = self._echo_entries(choice, out.prompt_logprobs)
            choice.offset = 0
            chunks.append(self._echo_chunk(choice, self._completion_logprobs(entries, choice)))
        choice.held.extend(out.logprobs or ())
        choice.held_ids.extend(out.token_ids)
        if not out.text and not out.finished:
            self.record(prompt_index, out)
            return chunks
        logprobs = None
        if self.req.top_logprobs is not None and out.logprobs is not None:
            logprobs = (chat_logprobs(choice.held, self._token_text, self.req.top_logprobs)
                        if self.req.chat else self._completion_logprobs(choice.held, choice))
        choice.held = []
        self.record(prompt_index, out)
        finish = out.finish_reason if out.finished else None
        stop_reason = out.stop_reason if out.finished else None
        if choice.parser is None:
            chunks.append(self._chunk(chunk_choice(
                self.req.chat, choice.index, out.text, finish, stop_reason, logprobs), choice))
            return chunks
        delta = choice.parser.feed(out.text)
        if out.finished:
            end = choice.parser.finish()
            delta = ChatDelta(delta.reasoning + end.reasoning, delta.content + end.content,
                              delta.tool_calls + end.tool_calls)
            finish = choice.parser.finish_reason(finish)
        if (not delta and not out.finished and logprobs is None
                and not self.req.return_token_ids):
            return chunks  # held back (a possible call marker): nothing to send yet
        parts = delta.to_openai_chunks()
        for k, fields in enumerate(parts):
            last = k == len(parts) - 1
            chunks.append(self._chunk(chunk_choice(
                True, choice.index, None, finish if last else None,
                stop_reason if last else None, logprobs if k == 0 else None,
                delta_fields=fields), choice))
        return chunks

    def usage_chunk(self) -> dict[str, Any]:
        return chunk_body(self.req.chat, self.id, self.created, self.model, [], True, self.usage())

    def _echo_chunk(self, choice: _Choice, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        choice.text = self.echo_text(choice)
        choice.echoed = True
        return self._chunk(chunk_choice(False, choice.index, choice.text, None, None, logprobs),
                           choice)

    def _chunk(self, body_choice: dict[str, Any], choice: _Choice,
               top: dict[str, Any] | None = None) -> dict[str, Any]:
        """A chunk of one choice; with return_token_ids its held ids go with it (and, the
        first time, a completion choice's prompt ids); ``top``: chunk-level fields."""
        if self.req.return_token_ids:
            if not self.req.chat and not choice.ids_sent:
                body_choice["prompt_token_ids"] = list(self._prompt_of(choice))
                choice.ids_sent = True
            body_choice["token_ids"], choice.held_ids = choice.held_ids, []
        body = chunk_body(self.req.chat, self.id, self.created, self.model, [body_choice],
                          self.include_usage)
        if top:
            body.update(top)
        if self._continuous:
            body["usage"] = usage_dict(len(self._prompt_of(choice)), choice.tokens)
        return body
