"""The OpenAI wire protocol: request bodies in, response bodies and stream chunks out.

Everything here is pure (no I/O, no trio): a request body (already decoded JSON) becomes a
:class:`CompletionRequest` holding the engine prompts and one :class:`SamplingParams`; engine
outputs become OpenAI-shaped dicts. Bad input raises :class:`APIError` (or the engine's
:class:`InvalidParamError`, which :func:`error_from_exception` maps) naming the field.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from engine.errors import (
    EngineDeadError,
    InvalidParamError,
    PromptTooLongError,
    QueueFullError,
    RequestError,
)
from engine.params import SamplingParams

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
    }
)
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo"}
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
# "developer" is OpenAI's newer name for the system role; templates only know "system".
_CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


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
    if isinstance(exc, EngineDeadError):
        return APIError(
            503, f"The engine is not serving: {exc}", type="service_unavailable",
            code="engine_dead",
        )
    return APIError(500, "Internal server error.", type="internal_error", code="internal_error")


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


def parse_completion(body: Any) -> CompletionRequest:
    """Parse a /v1/completions body; raise :class:`APIError`/``InvalidParamError``."""
    body = _require_object(body)
    _log_unknown(body, COMPLETION_FIELDS)
    if "prompt" not in body:
        raise APIError(400, "prompt is required", param="prompt", code="missing_required_parameter")
    prompts = _completion_prompts(body["prompt"])
    logprobs = _opt_int(body, "logprobs")
    echo = _opt_bool(body, "echo", False)
    params = _sampling_params(body, COMPLETIONS_DEFAULT_MAX_TOKENS, logprobs)
    if echo and logprobs is not None:
        # The echoed prompt gets logprobs too, as OpenAI gives them (scoring a text this
        # way is what evaluation harnesses do).
        params = params.replace(prompt_logprobs=logprobs)
    stream, include_usage = _stream_flags(body)
    return CompletionRequest(
        chat=False, model=_model(body), prompts=prompts, params=params, stream=stream,
        include_usage=include_usage, echo=echo, top_logprobs=logprobs, **_queueing(body),
    )


def parse_chat(body: Any) -> CompletionRequest:
    """Parse a /v1/chat/completions body; raise :class:`APIError`/``InvalidParamError``."""
    body = _require_object(body)
    _log_unknown(body, CHAT_FIELDS)
    messages = _chat_messages(body.get("messages"))
    top = _opt_int(body, "top_logprobs")
    if top is not None and not 0 <= top <= 20:
        # Checked here so the error names the chat field, not SamplingParams.logprobs.
        raise APIError(400, f"top_logprobs must be in [0, 20], got {top}",
                       param="top_logprobs", code="invalid_value")
    logprobs: int | None = top if top is not None else 0
    if not _opt_bool(body, "logprobs", False):
        if top is not None:
            raise APIError(400, "top_logprobs requires logprobs to be true",
                           param="top_logprobs", code="invalid_value")
        logprobs = None
    # OpenAI's newer name wins; a null one (clients that serialise every field) falls back.
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    params = _sampling_params(body, None, logprobs, max_tokens=max_tokens)
    stream, include_usage = _stream_flags(body)
    return CompletionRequest(
        chat=True, model=_model(body), prompts=(messages,), params=params, stream=stream,
        include_usage=include_usage, echo=False, top_logprobs=logprobs, **_queueing(body),
    )


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


def _chat_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", param="messages",
                       code="invalid_type")
    return [_chat_message(m, i) for i, m in enumerate(messages)]


def _chat_message(message: Any, i: int) -> dict[str, str]:
    param = f"messages[{i}]"
    if not isinstance(message, dict):
        raise APIError(400, f"{param} must be an object", param=param, code="invalid_type")
    role = _CHAT_ROLES.get(message.get("role"))  # type: ignore[arg-type]
    if role is None:
        raise APIError(400, f"{param}.role must be one of {sorted(_CHAT_ROLES)}, got "
                       f"{message.get('role')!r}", param=f"{param}.role", code="invalid_value")
    return {"role": role, "content": _chat_content(message.get("content"), param)}


def _chat_content(content: Any, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise APIError(400, f"{param}.content parts must be text parts "
                               '({"type": "text", "text": ...})', param=f"{param}.content",
                               code="invalid_value")
            texts.append(part["text"])
        # Parts are joined by newlines, as vLLM does for multi-part text content.
        return "\n".join(texts)
    raise APIError(400, f"{param}.content must be a string or a list of text parts",
                   param=f"{param}.content", code="invalid_type")


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _opt_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", param="stream_options",
                       code="invalid_type")
    if not stream:
        raise APIError(400, "stream_options is only allowed when stream is true",
                       param="stream_options", code="invalid_value")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise APIError(400, "stream_options.include_usage must be a boolean",
                       param="stream_options.include_usage", code="invalid_type")
    return stream, include


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
    max_tokens: Any = ...,
) -> SamplingParams:
    kwargs: dict[str, Any] = {k: body[k] for k in _PASSTHROUGH if body.get(k) is not None}
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


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


TokenText = Callable[[int], str]


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


def completion_logprobs(
    logprobs: Sequence[Any], token_text: TokenText, text_offset: int
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object for a run of tokens; an entry whose
    ``logprob`` is None (an echoed prompt's first token) gets nulls, as OpenAI's does."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for lp in logprobs:
        text = token_text(lp.token_id)
        tokens.append(text)
        token_logprobs.append(lp.logprob)
        tops.append(None if lp.top is None else {token_text(t): v for t, v in lp.top})
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(logprobs: Sequence[Any], token_text: TokenText) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for lp in logprobs:
        item = entry(lp.token_id, lp.logprob)
        item["top_logprobs"] = [entry(t, v) for t, v in lp.top]
        content.append(item)
    return {"content": content}


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
    logprobs: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "index": index, "message": {"role": "assistant", "content": text},
        "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason,
    }


def response_body(
    chat: bool, request_id: str, created: int, model: str, choices: list[dict[str, Any]],
    usage: dict[str, int],
) -> dict[str, Any]:
    return {
        "id": request_id, "object": "chat.completion" if chat else "text_completion",
        "created": created, "model": model, "choices": choices, "usage": usage,
    }


def chunk_body(
    chat: bool, request_id: str, created: int, model: str, choices: list[dict[str, Any]],
    include_usage: bool, usage: dict[str, int] | None = None,
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
) -> dict[str, Any]:
    if not chat:
        return completion_choice(index, text or "", finish_reason, stop_reason, logprobs)
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if text is not None:
        delta["content"] = text
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return choice
