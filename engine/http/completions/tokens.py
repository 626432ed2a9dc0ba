"""vLLM's token-in/token-out route, ``POST /inference/v1/generate``, and the render routes
that produce its requests: pure parsing and shaping.

The body is ``{"token_ids": [int], "sampling_params": {...}, "model", "request_id",
"priority", "cache_salt", "stream", "stream_options"}``; ``sampling_params`` uses the names
of vLLM's (and the engine's) ``SamplingParams``. The answer is ``{"request_id", "choices":
[{"index", "logprobs", "finish_reason", "token_ids"}], "prompt_logprobs",
"kv_transfer_params"}``: token ids only, no text, no chat template, as vLLM's disaggregated
front ends expect. Streamed, each SSE chunk is ``{"request_id", "choices": [one choice's
new tokens], "usage"}``, then a usage chunk with ``stream_options.include_usage``, then
``[DONE]`` (:class:`GenerateAnswer`).

``POST /v1/chat/completions/render`` and ``/v1/completions/render`` answer with the
request(s) of that shape a chat or completions body would run (:func:`render_body`): the
prompt's token ids after the chat template, and the sampling parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from engine.chat.request import lax_bool
from engine.http.completions.answer import token_id_text, top_entries, usage_dict
from engine.http.completions.protocol import is_token_id, parse_logit_bias, parse_stop
from engine.http.errors import APIError
from engine.params import SamplingParams

# sampling_params keys taken as they are (the engine's SamplingParams has each).
_SAMPLING_KEYS = (
    "n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
    "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
    "include_stop_str_in_output", "skip_special_tokens", "allowed_token_ids", "bad_words",
    "truncate_prompt_tokens", "spaces_between_special_tokens", "extra_args", "detokenize",
)
# Keys of vLLM's SamplingParams this route takes at their no-op values only (a client that
# serialises a whole SamplingParams sends them); any other value changes the answer and
# is refused.
_NO_OP_KEYS: dict[str, tuple[Any, ...]] = {
    "output_kind": (0, 1, 2),  # how vLLM batches its outputs; one answer here
    "best_of": (None, 1),
    "logits_processors": (None, []),
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
    stream: bool = False
    # stream_options (read only when streaming, as vLLM reads them): a last usage chunk,
    # and usage on every chunk.
    include_usage: bool = False
    continuous_usage: bool = False


def parse_generate(body: Any, defaults: Mapping[str, Any] | None = None) -> GenerateRequest:
    """The body of ``/inference/v1/generate``; :class:`APIError` naming a bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object", code="invalid_json")
    stream = lax_bool(body.get("stream"), "stream")
    include_usage, continuous = _stream_options(body.get("stream_options"))
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
    if raw.get("detokenize") is False and kwargs.get("stop"):
        raise APIError(400, "stop strings need detokenize: true (without text there is "
                       "nothing to match them in); send stop_token_ids instead",
                       param="sampling_params.stop", code="invalid_value")
    # No max_tokens: up to the context (the engine's None; SamplingParams' own default is
    # 16), as vLLM's route fills it when the client leaves it out; the model's generation
    # defaults above still apply.
    kwargs.setdefault("max_tokens", None)
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
                           request_id=request_id, priority=priority, cache_salt=salt,
                           stream=stream, include_usage=stream and include_usage,
                           continuous_usage=stream and continuous)


def _stream_options(options: Any) -> tuple[bool, bool]:
    """``stream_options``' ``include_usage`` and ``continuous_usage_stats`` (the latter only
    with the former, as vLLM reads it)."""
    if options is None:
        return False, False
    if not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", param="stream_options",
                       code="invalid_type")
    usage = lax_bool(options.get("include_usage"), "stream_options.include_usage")
    continuous = lax_bool(options.get("continuous_usage_stats"),
                          "stream_options.continuous_usage_stats")
    return usage, usage and continuous


def token_logprobs(logprobs: Any, top: int) -> dict[str, Any]:
    """vLLM's ``logprobs`` of this route: each token named ``token_id:N`` (there is no
    text), no ``bytes``, and ``max(top, 1)`` ``top_logprobs`` entries: the chosen token
    first, then the most likely others (so ``logprobs: 0`` still names the chosen one)."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": token_id_text(token_id), "logprob": logprob, "bytes": None}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [
        entry(t, v) for t, v in top_entries(lp, max(top, 1))]} for lp in logprobs]}


class GenerateAnswer:
    """The choices of one ``/inference/v1/generate`` request as engine outputs arrive: one
    response body (:meth:`record`, :meth:`response`) or SSE chunks
    (:meth:`stream_output`, :meth:`usage_chunk`). ``top`` is the request's
    ``sampling_params.logprobs`` (None: no logprobs)."""

    def __init__(self, request_id: str, n: int, prompt_tokens: int, top: int | None, *,
                 continuous_usage: bool = False) -> None:
        self.request_id = request_id
        self._top = top
        self._prompt_tokens = prompt_tokens
        self._continuous = continuous_usage
        self._tokens: list[list[int]] = [[] for _ in range(n)]
        self._logprobs: list[list[Any]] = [[] for _ in range(n)]
        self._finish: list[str | None] = [None] * n

    def record(self, out: Any) -> None:
        self._tokens[out.index].extend(out.token_ids)
        self._logprobs[out.index].extend(out.logprobs or ())
        if out.finished:
            self._finish[out.index] = out.finish_reason

    def _logprobs_of(self, logprobs: list[Any]) -> dict[str, Any] | None:
        return None if self._top is None else token_logprobs(logprobs, self._top)

    def response(self) -> dict[str, Any]:
        choices = [{
            "index": i,
            "logprobs": self._logprobs_of(lp),
            "finish_reason": finish,
            "token_ids": tokens,
        } for i, (tokens, lp, finish) in enumerate(
            zip(self._tokens, self._logprobs, self._finish, strict=True))]
        return {"request_id": self.request_id, "choices": choices, "prompt_logprobs": None,
                "kv_transfer_params": None}

    def stream_output(self, out: Any) -> list[dict[str, Any]]:
        """Record one engine output; the chunk that says it (none for an output with no
        token that does not finish the choice)."""
        self.record(out)
        if not out.token_ids and not out.finished:
            return []
        choice = {"index": out.index, "logprobs": self._logprobs_of(list(out.logprobs or ())),
                  "finish_reason": out.finish_reason if out.finished else None,
                  "token_ids": list(out.token_ids)}
        usage = (usage_dict(self._prompt_tokens, len(self._tokens[out.index]))
                 if self._continuous else None)
        return [{"request_id": self.request_id, "choices": [choice], "usage": usage}]

    def usage_chunk(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "choices": [], "usage": usage_dict(
            self._prompt_tokens, sum(len(t) for t in self._tokens))}


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
                model: str, request_id: str, priority: int, cache_salt: str | None,
                stream: bool = False, stream_options: Mapping[str, Any] | None = None,
                ) -> dict[str, Any]:
    """The ``/inference/v1/generate`` request that runs ``token_ids`` with ``params``;
    ``stream`` and its ``stream_options`` as the rendered request asked (vLLM's)."""
    max_tokens = params.max_tokens
    if max_tokens is None:  # up to the context, as the request would run
        max_tokens = max_model_len - len(token_ids)
    return {
        "request_id": request_id, "token_ids": list(token_ids), "features": None,
        "sampling_params": sampling_params_dict(params, max_tokens), "model": model,
        "stream": stream, "stream_options": dict(stream_options) if stream and stream_options
        else None, "cache_salt": cache_salt, "priority": priority, "kv_transfer_params": None,
    }
