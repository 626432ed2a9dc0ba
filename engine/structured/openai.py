"""The OpenAI and vLLM request fields that ask for structured output, read into one
:class:`StructuredOutputs`.

Pure (no I/O). Accepted, as vLLM names them:

* ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``;
* ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" | "json_object"}``;
* the older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

Fail closed: an unknown ``response_format`` type, an unknown ``structured_outputs`` key, a
malformed value or two constraints in one body raise :class:`InvalidParamError` naming the
field (``response_format.type``, ``structured_outputs.regex``, ``guided_json``, ...).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from engine.errors import InvalidParamError
from engine.structured.spec import StructuredOutputs

# The body fields this module reads (the HTTP layer lists them as known).
FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
          "guided_choice", "guided_grammar")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_JSON_SCHEMA_KEYS = frozenset({"name", "schema", "strict", "description"})


def structured_from_body(body: Mapping[str, Any]) -> tuple[StructuredOutputs | None, str | None]:
    """The body's constraint and the field that carried it (``None, None`` when it asks
    for none), or :class:`InvalidParamError` naming the field at fault."""
    found: list[tuple[str, str, Any]] = []  # (field, kind, value)
    fmt = body.get("response_format")
    if fmt is not None:
        found.extend(_response_format(fmt))
    so = body.get("structured_outputs")
    if so is not None:
        found.extend(_structured_outputs(so))
    for field, kind in _GUIDED.items():
        if body.get(field) is not None:
            found.append((field, kind, body[field]))
    if not found:
        return None, None
    if len(found) > 1:
        names = ", ".join(f for f, _, _ in found)
        raise InvalidParamError(f"only one structured output constraint may be given, got {names}",
                                param=found[1][0])
    field, kind, value = found[0]
    return _spec(field, kind, value), field


def _response_format(fmt: Any) -> list[tuple[str, str, Any]]:
    if not isinstance(fmt, Mapping):
        raise InvalidParamError("response_format must be an object", param="response_format")
    kind = fmt.get("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", "json_object", True)]
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, Mapping):
            raise InvalidParamError('response_format type "json_schema" needs a json_schema '
                                    "object", param="response_format.json_schema")
        unknown = sorted(set(spec) - _JSON_SCHEMA_KEYS)
        if unknown:
            raise InvalidParamError(f"response_format.json_schema has unknown key {unknown[0]!r}",
                                    param=f"response_format.json_schema.{unknown[0]}")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise InvalidParamError("response_format.json_schema.name must be a string",
                                    param="response_format.json_schema.name")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidParamError("response_format.json_schema.strict must be a boolean",
                                    param="response_format.json_schema.strict")
        if spec.get("schema") is None:
            raise InvalidParamError("response_format.json_schema.schema is required",
                                    param="response_format.json_schema.schema")
        # strict or not, the output is held to the schema: the grammar is the schema.
        return [("response_format.json_schema.schema", "json", spec["schema"])]
    raise InvalidParamError(
        f"response_format type {kind!r} is not supported; use text, json_object or "
        "json_schema", param="response_format.type")


def _structured_outputs(so: Any) -> list[tuple[str, str, Any]]:
    if not isinstance(so, Mapping):
        raise InvalidParamError("structured_outputs must be an object", param="structured_outputs")
    unknown = sorted(set(so) - set(_STRUCTURED_KEYS))
    if unknown:
        raise InvalidParamError(
            f"structured_outputs key {unknown[0]!r} is not supported; the keys are "
            f"{', '.join(_STRUCTURED_KEYS)}", param=f"structured_outputs.{unknown[0]}")
    out = []
    for key in _STRUCTURED_KEYS:
        value = so.get(key)
        if value is None or (key == "json_object" and value is False):
            continue
        if key == "json_object" and value is not True:
            raise InvalidParamError("structured_outputs.json_object must be a boolean",
                                    param="structured_outputs.json_object")
        out.append((f"structured_outputs.{key}", key, value))
    return out


def _spec(field: str, kind: str, value: Any) -> StructuredOutputs:
    try:
        if kind == "json":
            if isinstance(value, str):  # vLLM takes the schema as JSON text too
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise InvalidParamError(f"not JSON: {exc}") from None
            if not isinstance(value, dict):
                raise InvalidParamError("a JSON schema must be an object")
            return StructuredOutputs(json=value)
        if kind == "json_object":
            return StructuredOutputs(json_object=True)
        if kind == "choice":
            if not isinstance(value, list):
                raise InvalidParamError("choice must be a list of strings")
            return StructuredOutputs(choice=tuple(value))
        if not isinstance(value, str):
            raise InvalidParamError(f"{kind} must be a string")
        return StructuredOutputs(**{kind: value})
    except InvalidParamError as exc:
        raise InvalidParamError(f"{field}: {exc.message}", param=field) from None
