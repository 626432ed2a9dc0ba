"""``qwen3_coder``: ``<tool_call><function=NAME><parameter=P>value</parameter></function>
</tool_call>``, each value typed by its tool's schema (Qwen3-Coder)."""

from __future__ import annotations

import ast
import json
from typing import Any

from engine.chat.tool_parsers.base import Call, ToolParser, register_tool_parser
from engine.chat.tool_parsers.scan import Blocks, loads


class _Qwen3Coder(Blocks):
    """Qwen3-Coder's XML-like calls, one per block::

        <tool_call>
        <function=get_weather>
        <parameter=city>
        Paris
        </parameter>
        </function>
        </tool_call>

    A value is text (one newline either side is the layout's, not the value's), turned
    into the type its tool's schema gives the parameter (:func:`_typed_value`)."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    FUNCTION = "<function="
    FUNCTION_END = "</function>"
    PARAM = "<parameter="
    PARAM_END = "</parameter>"

    def __init__(self, tools: Any = ()) -> None:
        self._schemas: dict[str, Any] = {t.name: t.parameters for t in tools}

    def body_end(self, buf: str, final: bool) -> int | None:
        # The function's own structure is read first: a value may hold "</tool_call>".
        at = self._function_end(buf, len(self.OPEN))
        if at is not None:
            j = len(buf) - len(buf[at:].lstrip())
            if buf.startswith(self.CLOSE, j):
                return j
            if not final and self.CLOSE.startswith(buf[j:]):
                return None
        elif not final and self._may_continue(buf):
            return None
        k = buf.find(self.CLOSE, len(self.OPEN))
        return None if k == -1 else k

    def _may_continue(self, buf: str) -> bool:
        """Whether the block so far is a prefix of a well-formed function."""
        try:
            self._read(buf[len(self.OPEN):], partial=True)
        except ValueError:
            return False
        return True

    def _function_end(self, buf: str, start: int) -> int | None:
        """Index just past ``</function>`` when the block's function reads to its end."""
        try:
            read = self._read(buf[start:], partial=False)
        except ValueError:
            return None
        return None if read is None else start + read[2]

    def _read(self, text: str, *, partial: bool) -> tuple[str, dict[str, str], int] | None:
        """``(name, {parameter: raw value}, end)`` of the function ``text`` opens; None
        when ``partial`` and the text ends first; ``ValueError`` when it is not one."""
        def need(i: int, marker: str) -> int:
            rest = text[i:]
            if rest.startswith(marker):
                return i + len(marker)
            if partial and marker.startswith(rest):
                raise _NeedMore
            raise ValueError(marker)

        try:
            i = need(len(text) - len(text.lstrip()), self.FUNCTION)
            gt = text.find(">", i)
            if gt == -1:
                if partial and "\n" not in text[i:]:
                    raise _NeedMore
                raise ValueError("name")
            name = text[i:gt].strip()
            if not name or any(c in name for c in "<\n"):
                raise ValueError("name")
            i, params = gt + 1, {}
            while True:
                i += len(text[i:]) - len(text[i:].lstrip())
                if text.startswith(self.FUNCTION_END, i):
                    return name, params, i + len(self.FUNCTION_END)
                if partial and self.FUNCTION_END.startswith(text[i:]) and i < len(text):
                    raise _NeedMore
                i = need(i, self.PARAM)
                gt = text.find(">", i)
                if gt == -1:
                    if partial and "\n" not in text[i:]:
                        raise _NeedMore
                    raise ValueError("parameter")
                key = text[i:gt].strip()
                end = text.find(self.PARAM_END, gt + 1)
                if not key or key in params:
                    raise ValueError("parameter")
                if end == -1:
                    if partial:
                        raise _NeedMore
                    raise ValueError("parameter")
                value = text[gt + 1:end]
                value = value[1:] if value.startswith("\n") else value
                params[key] = value[:-1] if value.endswith("\n") else value
                i = end + len(self.PARAM_END)
        except _NeedMore:
            return None

    def body(self, text: str) -> list[Call] | None:
        try:
            read = self._read(text, partial=False)
        except ValueError:
            return None
        if read is None or text[read[2]:].strip():
            return None
        name, params, _ = read
        schema = self._schemas.get(name)
        props = schema.get("properties", {}) if isinstance(schema, dict) else {}
        args = {k: _typed_value(v, props.get(k) if isinstance(props, dict) else None)
                for k, v in params.items()}
        return [Call(name, json.dumps(args, ensure_ascii=False))]


class _NeedMore(Exception):
    """A partial read ran out of text."""


def _schema_types(schema: Any) -> list[str]:
    """The JSON types a parameter's schema allows, in the order it lists them."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    if "enum" in schema and isinstance(schema["enum"], list):
        return sorted({_json_type(v) for v in schema["enum"]})
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return [t for option in schema[key] for t in _schema_types(option)]
    return []


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return "string" if isinstance(value, str) else "object"


def _typed_value(text: str, schema: Any) -> Any:
    """A qwen3_coder parameter's text as the type its schema gives it: strings stay as
    written; ``integer``, ``number``, ``boolean`` and ``null`` are read from the text;
    ``object`` and ``array`` as JSON (or a Python literal, which some templates write);
    ``null`` or ``None`` where the schema allows null. Text that does not read as the schema's type stays a string, so the schema's
    validator sees what the model wrote. A parameter the schema does not declare is a
    string."""
    types = _schema_types(schema)
    value = text.strip()
    if "null" in types and value in ("null", "None"):
        return None
    if not types or types[0] == "string":
        return text
    for kind in (t for t in types if t != "null"):
        if kind == "integer":
            try:
                return int(value)
            except ValueError:
                continue
        if kind == "number":
            try:
                return int(value)
            except ValueError:
                pass
            try:
                number = float(value)
            except ValueError:
                continue
            if number == number and abs(number) != float("inf"):
                return number
        if kind == "boolean" and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if kind in ("object", "array"):
            parsed = loads(value)
            if parsed is None:
                try:
                    parsed = ast.literal_eval(value)
                except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                    continue
            if isinstance(parsed, dict if kind == "object" else (list, tuple)):
                return list(parsed) if isinstance(parsed, tuple) else parsed
        if kind == "string":
            return text
    return text


register_tool_parser(ToolParser("qwen3_coder", _Qwen3Coder, reads_tools=True))
