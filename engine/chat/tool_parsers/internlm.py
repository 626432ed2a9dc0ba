"""``internlm``: ``<|action_start|><|plugin|>{"name", "parameters"}<|action_end|>``
(InternLM 2/2.5)."""

from __future__ import annotations

from engine.chat.tool_parsers.base import Call, ToolParser, register_tool_parser
from engine.chat.tool_parsers.scan import Blocks, json_call, loads


class _InternLM(Blocks):
    """InternLM2/2.5: ``<|action_start|><|plugin|>`` + ``{"name", "parameters"}`` +
    ``<|action_end|>`` (all three special tokens)."""

    OPEN = "<|action_start|><|plugin|>"
    CLOSE = "<|action_end|>"

    def body(self, text: str) -> list[Call] | None:
        call = json_call(loads(text.strip()), ("parameters", "arguments"))
        return [call] if call else None


register_tool_parser(ToolParser("internlm", _InternLM, needs_special_tokens=True))
