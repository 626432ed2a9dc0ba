"""``granite``: ``<|tool_call|>`` or ``<tool_call>``, then a JSON list of
``{"name", "arguments"}`` objects, the whole output (Granite 3.0-3.3)."""

from __future__ import annotations

from engine.chat.tool_parsers.base import Format, Piece, Text, ToolParser, register_tool_parser
from engine.chat.tool_parsers.scan import bracket_end, json_call, loads


class ListAfterMarker(Format):
    """An output that is one of ``MARKS`` and a JSON list of ``{"name", "arguments"}``
    objects (Granite 3's layout, Phi-4-mini's). Text after the list is content; an output
    that does not open this way is all content."""

    MARKS: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._mode = "start"  # start -> list -> text
        self._prefix = ""  # consumed text given back if the list fails

    def scan(self, buf: str, final: bool) -> tuple[list[Piece], int] | None:
        if self._mode == "text":
            return [Text(buf)], len(buf)
        if self._mode == "start":
            return self._start(buf, final)
        return self._list(buf, final)

    def _start(self, buf: str, final: bool) -> tuple[list[Piece], int] | None:
        body = buf.lstrip()
        for mark in self.MARKS:
            if body.startswith(mark):
                used = len(buf) - len(body) + len(mark)
                self._mode, self._prefix = "list", buf[:used]
                return [], used
        if not final and (not body or any(m.startswith(body) for m in self.MARKS)):
            return None
        self._mode = "list" if body.startswith("[") else "text"
        return [], 0

    def _list(self, buf: str, final: bool) -> tuple[list[Piece], int] | None:
        lead = len(buf) - len(buf.lstrip())
        if lead == len(buf):
            return None if not final else self._fail(buf, len(buf))
        if buf[lead] != "[":
            return self._fail(buf, len(buf))
        end = bracket_end(buf, lead)
        if end is None:
            return None if not final else self._fail(buf, len(buf))
        items = loads(buf[lead:end])
        calls = ([json_call(o, ("arguments", "parameters")) for o in items]
                 if isinstance(items, list) and items else [None])
        if any(c is None for c in calls):
            return self._fail(buf, end)
        self._mode, self._prefix = "text", ""
        return [c for c in calls if c is not None], end

    def _fail(self, buf: str, upto: int) -> tuple[list[Piece], int]:
        self._mode = "text"
        text, self._prefix = self._prefix + buf[:upto], ""
        return [Text(text)], upto

    def close(self) -> list[Piece]:
        # A marker and nothing after it.
        return [Text(self._prefix)] if self._mode == "list" and self._prefix else []


class _Granite(ListAfterMarker):
    """Granite 3.x: ``<|tool_call|>`` (3.0's special token) or ``<tool_call>`` (3.1+)."""

    MARKS = ("<|tool_call|>", "<tool_call>")


register_tool_parser(ToolParser("granite", _Granite, needs_special_tokens=True))
