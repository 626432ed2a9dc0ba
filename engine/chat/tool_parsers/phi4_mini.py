"""``phi4_mini_json``: ``functools[{"name": ..., "arguments": {...}}, ...]``, the whole
output (Phi-4-mini-instruct): Granite 3's layout under another opening word."""

from __future__ import annotations

from engine.chat.tool_parsers.base import ToolParser, register_tool_parser
from engine.chat.tool_parsers.granite import ListAfterMarker


class _Phi4Mini(ListAfterMarker):
    """The output opens with ``functools`` and a JSON list of ``{"name", "arguments"}``
    objects (``parameters`` read as ``arguments`` too); text after the list is content,
    and an output that does not open so is all content."""

    MARKS = ("functools",)


register_tool_parser(ToolParser("phi4_mini_json", _Phi4Mini))
