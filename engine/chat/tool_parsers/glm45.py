"""``glm45``: GLM-4.5's calls (and GLM-4.6's), one block each, the name on the first line
and each argument a key/value pair::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

A value is text, typed by its tool's schema as ``qwen3_coder``'s are (the template writes
strings as they are and other values as JSON). The markers are special tokens, kept in
the text for it."""

from __future__ import annotations

import json
import re
from typing import Any

from engine.chat.tool_parsers.base import Call, ToolParser, register_tool_parser
from engine.chat.tool_parsers.qwen3_coder import _typed_value
from engine.chat.tool_parsers.scan import Blocks

_NAME = re.compile(r"\s*([^\s<]+)\s*")
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)


class _Glm45(Blocks):
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self, tools: Any = ()) -> None:
        self._schemas: dict[str, Any] = {t.name: t.parameters for t in tools}

    def body(self, text: str) -> list[Call] | None:
        name = _NAME.match(text)
        if name is None:
            return None
        i, params = name.end(), {}
        while i < len(text):
            pair = _PAIR.match(text, i)
            if pair is None or pair.group(1).strip() in params:
                return None
            params[pair.group(1).strip()] = pair.group(2)
            i = pair.end()
        schema = self._schemas.get(name.group(1))
        props = schema.get("properties", {}) if isinstance(schema, dict) else {}
        args = {k: _typed_value(v, props.get(k) if isinstance(props, dict) else None) for k, v in params.items()}
        return [Call(name.group(1), json.dumps(args, ensure_ascii=False))]


register_tool_parser(ToolParser("glm45", _Glm45, needs_special_tokens=True, reads_tools=True))
