"""``olmo3``: ``<function_calls>`` and one Python call a line, ``get_weather(city="Paris")``,
then ``</function_calls>`` (OLMo 3 Instruct and Think). Values are Python literals or
JSON's ``true``, ``false`` and ``null``."""

from __future__ import annotations

from engine.chat.tool_parsers.base import Format, Piece, Text, ToolParser, register_tool_parser
from engine.chat.tool_parsers.pythonic import python_calls


class _Olmo3(Format):
    """An output that opens with ``<function_calls>``: the lines up to
    ``</function_calls>`` (or the end of the output) are calls, each a Python call with
    keyword arguments; text after the block is content. A block that does not parse, and
    an output that opens otherwise, are content."""

    START = "<function_calls>"
    END = "</function_calls>"

    def __init__(self) -> None:
        self._mode = "start"  # start -> block -> text

    def scan(self, buf: str, final: bool) -> tuple[list[Piece], int] | None:
        if self._mode == "text":
            return [Text(buf)], len(buf)
        if self._mode == "start":
            body = buf.lstrip()
            if not final and (not body or (self.START.startswith(body) and body != self.START)):
                return None
            self._mode = "block" if body.startswith(self.START) else "text"
            return [], 0
        end = buf.find(self.END)
        if end == -1 and not final:
            return None
        upto = len(buf) if end == -1 else end + len(self.END)
        lead = len(buf) - len(buf.lstrip())
        inner = buf[lead + len(self.START):end if end != -1 else len(buf)]
        lines = [line.strip() for line in inner.splitlines() if line.strip()]
        calls = python_calls(f"[{', '.join(lines)}]") if lines else None
        self._mode = "text"
        if calls is None:
            return [Text(buf[:upto])], upto
        return list(calls), upto


register_tool_parser(ToolParser("olmo3", _Olmo3))
