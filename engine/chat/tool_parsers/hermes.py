"""``hermes`` and ``granite4``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
one block per call (Qwen2.5, Qwen3, Hermes 2/3; Granite 4, whose markers are special
tokens). Under the tools' grammar a call streams as it is written (:class:`_StreamingHermes`)."""

from __future__ import annotations

from engine.chat.tool_parsers.base import (
    CallArgs,
    CallClose,
    CallOpen,
    Format,
    Piece,
    Text,
    ToolParser,
    register_tool_parser,
)
from engine.chat.tool_parsers.scan import bracket_end, json_call, loads, text_until


class _Hermes(Format):
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def scan(self, buf: str, final: bool) -> tuple[list[Piece], int] | None:
        if not buf.startswith(self.OPEN):
            return text_until(buf, self.OPEN, final)
        end = self._close(buf, final)
        if end is None:
            if not final:
                return None
            # A model stopped by EOS right after the JSON: accept a complete call.
            call = json_call(loads(buf[len(self.OPEN):]), ("arguments", "parameters"))
            return ([call] if call else [Text(buf)]), len(buf)
        used = end + len(self.CLOSE)
        call = json_call(loads(buf[len(self.OPEN):end]), ("arguments", "parameters"))
        return ([call] if call else [Text(buf[:used])]), used

    def _close(self, buf: str, final: bool) -> int | None:
        """Where the call's closing tag starts, or None when that is not decided yet
        (needs more text) or there is none. A JSON object body is read to its end first:
        a string in it may hold "</tool_call>"."""
        i = len(buf) - len(buf[len(self.OPEN):].lstrip())
        if i < len(buf) and buf[i] == "{":
            end = bracket_end(buf, i)
            if end is None and not final:
                return None
            if end is not None:
                j = len(buf) - len(buf[end:].lstrip())
                if buf.startswith(self.CLOSE, j):
                    return j
                if not final and self.CLOSE.startswith(buf[j:]):
                    return None
        k = buf.find(self.CLOSE, len(self.OPEN))
        return None if k == -1 else k


class _JsonEnd:
    """Finds, across pieces of text, where one JSON object or array ends: bracket depth
    with strings skipped (the grammar has checked everything else)."""

    def __init__(self) -> None:
        self._depth = 0
        self._quoted = False
        self._escaped = False

    def scan(self, text: str) -> int | None:
        """Index just past the closing bracket in ``text``, or None when it is not there
        yet (all of ``text`` belongs to the value)."""
        for i, c in enumerate(text):
            if self._quoted:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._quoted = False
            elif self._depth == 0 and c not in "{[" and not c.isspace():
                return i  # not an object: the grammar was not the tools' one
            elif c == '"':
                self._quoted = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None


class _StreamingHermes(_Hermes):
    """hermes calls under the tools' grammar, streamed as they are written.

    The grammar writes ``<tool_call>``, up to two spaces or newlines, then exactly
    ``{"name": "NAME", "arguments": `` (:data:`engine.chat.tools._CALL_FRAMES`), the
    arguments object, ``}``, whitespace and ``</tool_call>``. A call whose opening does not
    read that way is parsed whole, as :class:`_Hermes` does.
    """

    HEAD = '{"name": "'
    ARGS = '", "arguments": '

    def __init__(self) -> None:
        self._mode = "text"  # text -> args -> tail -> text
        self._end = _JsonEnd()
        self._opened = False  # a call is open and not closed yet

    def scan(self, buf: str, final: bool) -> tuple[list[Piece], int] | None:
        if self._mode == "args":
            return self._arguments(buf)
        if self._mode == "tail":
            return self._tail(buf, final)
        if not buf.startswith(self.OPEN):
            return super().scan(buf, final)
        head = self._head(buf)
        if head is None:
            return None if not final else super().scan(buf, final)
        if not head:
            return super().scan(buf, final)
        name, used = head
        self._mode, self._end, self._opened = "args", _JsonEnd(), True
        return [CallOpen(name)], used

    def _head(self, buf: str) -> tuple[str, int] | tuple[()] | None:
        """The name and the length of the opening through ``"arguments": ``; ``()`` when
        the opening does not read as the grammar writes it, None when it may still."""
        at = len(self.OPEN)
        body = buf[at:].lstrip(" \n")
        at = len(buf) - len(body)
        if len(body) < len(self.HEAD):
            return None if self.HEAD.startswith(body) else ()
        if not body.startswith(self.HEAD):
            return ()
        quote = body.find('"', len(self.HEAD))
        if quote == -1:
            return None if "\\" not in body[len(self.HEAD):] else ()
        name = body[len(self.HEAD):quote]
        rest = body[quote:]
        if not name or "\\" in name:
            return ()
        if not rest.startswith(self.ARGS):
            return None if self.ARGS.startswith(rest) else ()
        return name, at + quote + len(self.ARGS)

    def _arguments(self, buf: str) -> tuple[list[Piece], int]:
        end = self._end.scan(buf)
        if end is None:
            return [CallArgs(buf)], len(buf)
        self._mode = "tail"
        return ([CallArgs(buf[:end])] if end else []), end

    def _tail(self, buf: str, final: bool) -> tuple[list[Piece], int] | None:
        """``}``, whitespace and ``</tool_call>`` close the call; at the end of the output
        any prefix of them does (a model may stop right after the arguments)."""
        body = buf.lstrip()
        if not body:
            return None if not final else self._close_call(len(buf))
        if not body.startswith("}"):
            return self._close_call(0)  # not the grammar's tail: the rest is content
        brace = len(buf) - len(body) + 1
        body = body[1:].lstrip()
        if body.startswith(self.CLOSE):
            return self._close_call(len(buf) - len(body) + len(self.CLOSE))
        if self.CLOSE.startswith(body):  # a prefix of it, or nothing yet
            return None if not final else self._close_call(len(buf))
        return self._close_call(brace)

    def _close_call(self, used: int) -> tuple[list[Piece], int]:
        self._mode, self._opened = "text", False
        return [CallClose()], used

    def close(self) -> list[Piece]:
        # Cut short by max_tokens inside the call: it keeps the arguments written.
        return [CallClose()] if self._opened else []


register_tool_parser(ToolParser("hermes", _Hermes, make_constrained_format=_StreamingHermes))
# Granite 4 writes hermes' syntax; its <tool_call> markers are special tokens.
register_tool_parser(ToolParser("granite4", _Hermes, make_constrained_format=_StreamingHermes,
                                needs_special_tokens=True))
