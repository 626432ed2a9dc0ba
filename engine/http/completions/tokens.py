"""vLLM's token-in/token-out route, ``POST /inference/v1/generate``, and the render routes
that produce its requests: pure parsing and shaping.

The body is ``{"token_ids": [int], "sampling_params": {...}, "model", "request_id",
"priority", "cache_salt", "stream"}``; ``sampling_params`` uses the names of vLLM's (and the
engine's) ``SamplingParams``. The answer is ``{"request_id", "choices": [{"index",
"logprobs", "finish_reason", "token_ids"}], "prompt_logprobs", "kv_transfer_params"}``:
token ids only, no text, no chat template, as vLLM's disaggregated front ends expect.

``POST /v1/chat/completions/render`` and ``/v1/completions/render`` answer with the
request(s) of that shape a chat or completions body would run (:func:`render_body`): the
prompt's token ids after the chat template, and the sampling parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from engine.http.completions.answer import TokenText, chat_logprobs
from engine.http.completions.protocol import is_token_id, parse_logit_bias, parse_stop
from engine.http.errors import APIError
from engine.params import SamplingParams

# sampling_params keys taken as they are (the engine's SamplingParams has each).
_SAMPLING_KEYS = (
    "n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
    "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
    "include_stop_str_in_output", "skip_special_tokens",
)
# Keys of vLLM's SamplingParams this route takes at their no-op values only (a client that
# serialises a whole SamplingParams sends them); any other value changes the answer and
# is refused.
_NO_OP_KEYS: dict[str, tuple[Any, ...]] = {
    "detokenize": (True, False),  # token ids come back either way; the text is not sent
    "output_kind": (0, 1, 2),  # how vLLM batches its outputs; one answer here
    "best_of": (None, 1),
    "spaces_between_special_tokens": (True,),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "logits_processors": (None, []),
    "truncate_prompt_tokens": (None,),
    "extra_args": (None, {}),
    "structured_outputs": (None,),
    "guided_decoding": (None,),
    "prompt_logprobs": (None,),
    "flat_logprobs": (False,),
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GenerateRequest:
    token_ids: tuple[int, ...]
    params: SamplingParams
    model: str | None
    request_id: str | None
    priority: int
    cache_salt: str | None


def parse_generate(body: Any, defaults: Mapping[str, Any] | None = None) -> GenerateRequest:
    """The body of ``/inference/v1/generate``; :class:`APIError` naming a bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object", code="invalid_json")
    if body.get("stream"):
        raise APIError(400, "stream is not supported on /inference/v1/generate yet; send "
                       "stream: false", param="stream", code="unsupported_parameter")
    for name in ("features", "kv_transfer_params"):
        if body.get(name) is not None:
            raise APIError(400, f"{name} is not supported by this server", param=name,
                           code="unsupported_parameter")
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(is_token_id(t) for t in ids):
        raise APIError(400, "token_ids must be a non-empty list of token ids",
                       param="token_ids", code="invalid_type")
    raw = body.get("sampling_params")
    if not isinstance(raw, dict):
        raise APIError(400, "sampling_params must be an object", param="sampling_params",
                       code="invalid_type")
    kwargs: dict[str, Any] = dict(defaults or {})
    for key, value in raw.items():
        if key in _SAMPLING_KEYS:
            if value is not None:
                kwargs[key] = value
        elif key == "stop":
            if value:
                kwargs["stop"] = parse_stop(value)
        elif key == "stop_token_ids":
            if value:
                kwargs["stop_token_ids"] = tuple(value)
        elif key == "logit_bias":
            if value:
                kwargs["logit_bias"] = parse_logit_bias(value)
        elif key not in _NO_OP_KEYS or value not in _NO_OP_KEYS[key]:
            raise APIError(400, f"sampling_params.{key} is not supported by this server"
                           + ("" if key in _NO_OP_KEYS else " (unknown key)"),
                           param=f"sampling_params.{key}", code="unsupported_parameter")
    kwargs.setdefault("max_tokens", 16)  # vLLM's SamplingParams default
    request_id = body.get("request_id")
    if request_id is not None and (not isinstance(request_id, str) or not request_id):
        raise APIError(400, "request_id must be a non-empty string", param="request_id",
                       code="invalid_type")
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise APIError(400, "priority must be an integer", param="priority",
                       code="invalid_type")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise APIError(400, "cache_salt must be a non-empty string", param="cache_salt",
                       code="invalid_type")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, "model must be a string", param="model", code="invalid_type")
    return GenerateRequest(token_ids=tuple(ids), params=SamplingParams(**kwargs), model=model,
                           request_id=request_id, priority=priority, cache_salt=salt)


class GenerateAnswer:
    """The choices of one ``/inference/v1/generate`` request as engine outputs arrive."""

    def __init__(self, request_id: str, n: int, token_text: TokenText) -> None:
        self.request_id = request_id
        self._token_text = token_text
        self._tokens: list[list[int]] = [[] for _ in range(n)]
        self._logprobs: list[list[Any] | None] = [None] * n
        self._finish: list[str | None] = [None] * n

    def record(self, out: Any) -> None:
        self._tokens[out.index].extend(out.token_ids)
        if out.logprobs is not None:
            self._logprobs[out.index] = (self._logprobs[out.index] or []) + list(out.logprobs)
        if out.finished:
            self._finish[out.index] = out.finish_reason

    def response(self) -> dict[str, Any]:
        choices = [{
            "index": i,
            "logprobs": None if lp is None else chat_logprobs(lp, self._token_text),
            "finish_reason": finish,
            "token_ids": tokens,
        } for i, (tokens, lp, finish) in enumerate(
            zip(self._tokens, self._logprobs, self._finish, strict=True))]
        return {"request_id": self.request_id, "choices": choices, "prompt_logprobs": None,
                "kv_transfer_params": None}


def sampling_params_dict(params: SamplingParams, max_tokens: int) -> dict[str, Any]:
    """``params`` under vLLM's ``SamplingParams`` names, as :func:`parse_generate` reads
    them back (``max_tokens`` the effective one)."""
    out: dict[str, Any] = {key: getattr(params, key) for key in _SAMPLING_KEYS}
    out["max_tokens"] = max_tokens
    out["stop"] = list(params.stop)
    out["stop_token_ids"] = list(params.stop_token_ids)
    out["logit_bias"] = {str(t): b for t, b in params.logit_bias} or None
    return out


def render_body(token_ids: list[int], params: SamplingParams, *, max_model_len: int,
                model: str, request_id: str, priority: int,
                cache_salt: str | None) -> dict[str, Any]:
    """The ``/inference/v1/generate`` request that runs ``token_ids`` with ``params``."""
    max_tokens = params.max_tokens
    if max_tokens is None:  # up to the context, as the request would run
        max_tokens = max_model_len - len(token_ids)
    return {
        "request_id": request_id, "token_ids": list(token_ids), "features": None,
        "sampling_params": sampling_params_dict(params, max_tokens), "model": model,
        "stream": False, "stream_options": None, "cache_salt": cache_salt,
        "priority": priority, "kv_transfer_params": None,
    }
