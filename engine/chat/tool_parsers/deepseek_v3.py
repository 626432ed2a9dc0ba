"""``deepseek_v3``: DeepSeek V3's special-token frames around a fenced JSON block per call,
in one ``<｜tool▁calls▁begin｜>`` ... ``<｜tool▁calls▁end｜>`` section; ``deepseek_v31``:
DeepSeek V3.1's, the name then the JSON arguments in each frame."""

from __future__ import annotations

import json
import re

from engine.chat.tool_parsers.base import (
    Call,
    Format,
    Piece,
    Text,
    ToolParser,
    register_tool_parser,
)
from engine.chat.tool_parsers.scan import loads, text_until


class _DeepSeekV3(Format):
    """DeepSeek-V3's calls, each a special-token frame around a fenced JSON block, all in
    one ``<｜tool▁calls▁begin｜>`` ... ``<｜tool▁calls▁end｜>`` section::

        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
        ```json
        {"city": "Paris"}
        ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

    Each call is sent once its ``<｜tool▁call▁end｜>`` arrives. A section whose first call
    does not read is content from its opening marker on; one that breaks after a call is
    content from there."""

    BEGIN = "<｜tool▁calls▁begin｜>"
    END = "<｜tool▁calls▁end｜>"
    CALL = "<｜tool▁call▁begin｜>"
    CALL_END = "<｜tool▁call▁end｜>"
    SEP = "<｜tool▁sep｜>"
    _BODY = re.compile(r"\s*function" + re.escape(SEP) + r"(?P<name>[^\n`<]+?)[ \t]*\n\s*```(?:json)?\s*"
                       r"(?P<args>\{.*\})\s*```\s*", re.DOTALL)

    def __init__(self) -> None:
        self._mode = "text"  # text -> calls -> text
        self._prefix = ""  # the section's opening, given back if its first call fails
        self._calls = 0

    def scan(self, buf: str, final: bool) -> tuple[list[Piece], int] | None:
        if self._mode == "text":
            if not buf.startswith(self.BEGIN):
                return text_until(buf, self.BEGIN, final)
            self._mode, self._prefix, self._calls = "calls", self.BEGIN, 0
            return [], len(self.BEGIN)
        lead = len(buf) - len(buf.lstrip())
        rest = buf[lead:]
        if rest.startswith(self.END) and self._calls:
            self._mode = "text"
            return [], lead + len(self.END)
        if not rest.startswith(self.CALL):
            if not final and (not rest or self.CALL.startswith(rest)
                              or (self._calls and self.END.startswith(rest))):
                return None
            if self._calls and not rest:
                return [], len(buf)  # stopped after a call, before the section's end
            return self._fail(buf)
        end = rest.find(self.CALL_END)
        if end == -1:
            return None if not final else self._fail(buf)
        match = self._BODY.fullmatch(rest, len(self.CALL), end)
        args = loads(match.group("args")) if match else None
        if match is None or not isinstance(args, dict):
            return self._fail(buf)
        self._calls += 1
        self._prefix = ""
        call = Call(match.group("name").strip(), json.dumps(args, ensure_ascii=False))
        return [call], lead + end + len(self.CALL_END)

    def _fail(self, buf: str) -> tuple[list[Piece], int]:
        self._mode = "text"
        text, self._prefix = self._prefix + buf, ""
        return [Text(text)], len(buf)

    def close(self) -> list[Piece]:
        # The section's opening and nothing after it.
        return [Text(self._prefix)] if self._mode == "calls" and self._prefix else []


class _DeepSeekV31(_DeepSeekV3):
    """DeepSeek V3.1's calls: the same section and frames, each the function's name, the
    separator, then its JSON arguments (no "function" word, no fence)::

        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    """

    _BODY = re.compile(r"\s*(?P<name>[^\s<`]+?)\s*" + re.escape(_DeepSeekV3.SEP) + r"\s*(?P<args>\{.*\})\s*",
                       re.DOTALL)


register_tool_parser(ToolParser("deepseek_v3", _DeepSeekV3, needs_special_tokens=True))
register_tool_parser(ToolParser("deepseek_v31", _DeepSeekV31, needs_special_tokens=True))
