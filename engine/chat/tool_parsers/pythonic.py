"""``pythonic``: a Python list of calls with keyword arguments, ``[get_weather(city="Paris"),
...]``, optionally inside ``<|python_start|>...<|python_end|>`` (Llama 3.2/4, ToolACE)."""

from __future__ import annotations

import ast
import json
from typing import Any

from engine.chat.tool_parsers.base import (
    Call,
    Format,
    Piece,
    Text,
    ToolParser,
    register_tool_parser,
)
from engine.chat.tool_parsers.scan import bracket_end


class _Pythonic(Format):
    """A Python list of calls with keyword arguments, at the start of the output."""

    START = "<|python_start|>"
    END = "<|python_end|>"

    def __init__(self) -> None:
        self._mode = "start"  # start -> list [-> end] -> text
        self._prefix = ""  # consumed text given back if the list fails

    def scan(self, buf: str, final: bool) -> tuple[list[Piece], int] | None:
        if self._mode == "text":
            return [Text(buf)], len(buf)
        if self._mode == "start":
            return self._start(buf, final)
        if self._mode == "list":
            return self._list(buf, final)
        body = buf.lstrip()  # mode "end": an optional <|python_end|>
        if body.startswith(self.END):
            self._mode = "text"
            return [], len(buf) - len(body) + len(self.END)
        if not final and (not body or self.END.startswith(body)):
            return None
        self._mode = "text"
        return [], 0

    def _start(self, buf: str, final: bool) -> tuple[list[Piece], int] | None:
        body = buf.lstrip()
        if body.startswith(self.START):
            used = len(buf) - len(body) + len(self.START)
            self._mode, self._prefix = "list", buf[:used]
            return [], used
        if not final and (not body or self.START.startswith(body)):
            return None
        self._mode = "list" if body.startswith("[") else "text"
        return [], 0

    def _list(self, buf: str, final: bool) -> tuple[list[Piece], int] | None:
        lead = len(buf) - len(buf.lstrip())
        if lead == len(buf):
            return None if not final else self._fail(buf, len(buf))
        if buf[lead] != "[":
            return self._fail(buf, len(buf))
        end = bracket_end(buf, lead, quotes="\"'")
        if end is None:
            return None if not final else self._fail(buf, len(buf))
        calls = python_calls(buf[lead:end])
        if calls is None:
            return self._fail(buf, end)
        self._mode = "end" if self._prefix else "text"
        return list(calls), end

    def _fail(self, buf: str, upto: int) -> tuple[list[Piece], int]:
        self._mode = "text"
        text, self._prefix = self._prefix + buf[:upto], ""
        return [Text(text)], upto

    def close(self) -> list[Piece]:
        if self._mode == "list" and self._prefix:
            return [Text(self._prefix)]
        return []


_PY_CONSTANTS = {"true": True, "false": False, "null": None}


def python_calls(source: str) -> list[Call] | None:
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or not isinstance(
                node.func, (ast.Name, ast.Attribute)):
            return None
        try:
            args = {kw.arg: _py_value(kw.value) for kw in node.keywords if kw.arg is not None}
        except ValueError:
            return None
        if len(args) != len(node.keywords):  # **kwargs
            return None
        calls.append(Call(ast.unparse(node.func), json.dumps(args, ensure_ascii=False)))
    return calls


def _py_value(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _PY_CONSTANTS:
        return _PY_CONSTANTS[node.id]
    if isinstance(node, ast.List):
        return [_py_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {_py_key(k): _py_value(v) for k, v in zip(node.keys, node.values, strict=True)}
    value = ast.literal_eval(node)  # raises ValueError on anything not a literal
    if isinstance(value, tuple):
        return list(value)
    if not isinstance(value, (str, int, float, bool)) and value is not None:
        raise ValueError(f"not a JSON value: {value!r}")
    return value


def _py_key(node: ast.expr | None) -> str:
    key = _py_value(node) if node is not None else None
    if not isinstance(key, str):
        raise ValueError("dict keys must be strings")
    return key


register_tool_parser(ToolParser("pythonic", _Pythonic, needs_special_tokens=True))
