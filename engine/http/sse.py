"""Server-sent events as OpenAI frames them: ``data: {json}\\n\\n`` and a final ``data: [DONE]``."""

from __future__ import annotations

import json
import math
from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"
CONTENT_TYPE = "text/event-stream; charset=utf-8"
# Proxies (nginx) buffer responses by default; these headers keep tokens flowing.
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# What OpenAI and vLLM write for the logprob of a token that has none (-inf): JSON has no
# infinities, and a NaN or Infinity literal makes the whole body invalid JSON.
NO_LOGPROB = -9999.0


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON, the way OpenAI's servers write it; always valid JSON.

    A non-finite float (a logprob of -inf, a NaN) becomes :data:`NO_LOGPROB` or ``null``
    instead of an invalid ``-Infinity``/``NaN`` literal.
    """
    try:
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(obj), ensure_ascii=False, separators=(",", ":"),
                          allow_nan=False)
    return text.encode()


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return NO_LOGPROB if obj == float("-inf") else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def dumps_floatless(obj: Any) -> bytes:
    """:func:`dumps` of an ``obj`` the caller knows holds no float (a token chunk without
    logprobs), by ``orjson``: the same bytes at a fraction of the CPU (about a tenth of
    the event loop's work per streamed token was the standard library's encoder). orjson
    would write a non-finite float as ``null``, hence the caller's promise; what orjson
    refuses (an integer past 64 bits, a lone surrogate) goes the standard way."""
    try:
        return orjson.dumps(obj)
    except TypeError:  # orjson.JSONEncodeError
        return dumps(obj)


def event(obj: Any, floats: bool = True) -> bytes:
    """One SSE event carrying ``obj`` as JSON; ``floats=False`` promises it holds none
    (:func:`dumps_floatless`)."""
    return b"data: " + (dumps(obj) if floats else dumps_floatless(obj)) + b"\n\n"


def typed_event(obj: Any) -> bytes:
    """One SSE event named by ``obj["type"]`` (the Responses API's framing:
    ``event: response.created`` then its data; no ``[DONE]`` follows the last)."""
    return b"event: " + obj["type"].encode() + b"\ndata: " + dumps(obj) + b"\n\n"
