"""Strict JSON for request bodies: :func:`loads_body` and the limits it enforces.

Pure (no I/O, no trio). Every route reads its body through it, so a body too deep, too
large in values, holding ``NaN`` or a lone surrogate is a 400 before any family looks at it.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from typing import Any

from engine.http.errors import APIError

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
