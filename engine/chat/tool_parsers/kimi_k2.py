"""``kimi_k2``: Kimi K2's calls, in one section, each with the id the model gives it::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The id (``functions.NAME:INDEX``) is kept as the call's id, as vLLM keeps it (K2's template
writes it back into the history); the name is what stands between ``functions.`` and the
colon. The markers are special tokens, kept in the text for it."""

from __future__ import annotations

import json
import re

from engine.chat.tool_parsers.base import Call, ToolParser, register_tool_parser
from engine.chat.tool_parsers.scan import Blocks

_CALL = re.compile(r"\s*<\|tool_call_begin\|>\s*(?P<id>[^\s<]+)\s*<\|tool_call_argument_begin\|>"
                   r"(?P<args>.*?)<\|tool_call_end\|>\s*", re.DOTALL)


class _KimiK2(Blocks):
    OPEN = "<|tool_calls_section_begin|>"
    CLOSE = "<|tool_calls_section_end|>"

    def body(self, text: str) -> list[Call] | None:
        calls, i = [], 0
        while i < len(text):
            call = _CALL.match(text, i)
            if call is None:
                return None
            ident = call.group("id")
            name = ident.removeprefix("functions.").rsplit(":", 1)[0]
            try:
                args = json.loads(call.group("args"))
            except ValueError:
                return None
            if not name or not isinstance(args, dict):
                return None
            calls.append(Call(name, json.dumps(args, ensure_ascii=False), ident))
            i = call.end()
        return calls or None


register_tool_parser(ToolParser("kimi_k2", _KimiK2, needs_special_tokens=True))
