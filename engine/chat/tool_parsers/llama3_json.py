"""``llama3_json``: ``{"name": ..., "parameters": {...}}`` calls joined by ``;`` at the start
of the output, optionally after ``<|python_tag|>`` (Llama 3.1-3.3)."""

from __future__ import annotations

from engine.chat.tool_parsers.base import Format, Piece, Text, ToolParser, register_tool_parser
from engine.chat.tool_parsers.scan import bracket_end, json_call, loads


class _Llama3Json(Format):
    """Calls only at the start of the output; the first text that is not a call (or
    a ``;`` between calls) ends them and is content from there on."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._mode = "start"  # start -> calls -> text
        self._calls = 0
        self._prefix = ""  # consumed text given back if the first call fails

    def scan(self, buf: str, final: bool) -> tuple[list[Piece], int] | None:
        if self._mode == "text":
            return [Text(buf)], len(buf)
        if self._mode == "start":
            return self._start(buf, final)
        return self._next_call(buf, final)

    def _start(self, buf: str, final: bool) -> tuple[list[Piece], int] | None:
        body = buf.lstrip()
        if body.startswith(self.TAG):
            used = len(buf) - len(body) + len(self.TAG)
            self._mode, self._prefix = "calls", buf[:used]
            return [], used
        if not final and (not body or self.TAG.startswith(body)):
            return None
        self._mode = "calls" if body.startswith("{") else "text"
        return [], 0

    def _next_call(self, buf: str, final: bool) -> tuple[list[Piece], int] | None:
        i = len(buf) - len(buf.lstrip())
        if self._calls and buf[i:i + 1] == ";":
            i += 1
            i += len(buf[i:]) - len(buf[i:].lstrip())
        if i == len(buf):
            if not final:
                return None
            return ([], len(buf)) if self._calls else self._fail(buf)
        if buf[i] != "{":
            return self._fail(buf)
        end = bracket_end(buf, i)
        if end is None:
            return None if not final else self._fail(buf)
        call = json_call(loads(buf[i:end]), ("parameters", "arguments"))
        if call is None:
            return self._fail(buf)
        self._calls += 1
        return [call], end

    def _fail(self, buf: str) -> tuple[list[Piece], int]:
        self._mode = "text"
        text = buf if self._calls else self._prefix + buf
        self._prefix = ""
        return [Text(text)], len(buf)

    def close(self) -> list[Piece]:
        # "<|python_tag|>" and nothing after it.
        return [Text(self._prefix)] if self._mode == "calls" and not self._calls \
            and self._prefix else []


register_tool_parser(ToolParser("llama3_json", _Llama3Json, needs_special_tokens=True))
