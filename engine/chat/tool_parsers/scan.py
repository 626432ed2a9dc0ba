"""Scanning helpers the tool-call formats share: finding a marker or a closing bracket
in partial text, reading a JSON call object, and :class:`Blocks`, the format of calls
between an opening and a closing marker (internlm, qwen3_coder)."""

from __future__ import annotations

import json
from typing import Any

from engine.chat.tool_parsers.base import Call, Format, Piece, Text


def partial_marker(buf: str, marker: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``marker``."""
    for n in range(min(len(buf), len(marker) - 1), 0, -1):
        if marker.startswith(buf[-n:]):
            return n
    return 0


def text_until(buf: str, marker: str, final: bool) -> tuple[list[Piece], int] | None:
    """Content up to ``marker`` (exclusive), holding back a possible partial marker."""
    i = buf.find(marker)
    if i == -1:
        keep = 0 if final else partial_marker(buf, marker)
        i = len(buf) - keep
    if i == 0:
        return None
    return [Text(buf[:i])], i


def bracket_end(buf: str, start: int, quotes: str = '"') -> int | None:
    """Index just past the bracket that closes the one at ``start`` (``{`` or ``[``),
    skipping brackets inside strings; None when the text ends first."""
    depth = 0
    quote = ""
    escaped = False
    for i in range(start, len(buf)):
        c = buf[i]
        if quote:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == quote:
                quote = ""
        elif c in quotes:
            quote = c
        elif c in "{[(":
            depth += 1
        elif c in "}])":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def json_call(obj: Any, args_keys: tuple[str, ...]) -> Call | None:
    """``{"name": str, <args key>: object}`` as a call; None if it is not that shape."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


class Blocks(Format):
    """Calls in blocks between an opening and a closing marker, with text around them; a
    block whose body does not read as calls is content. ``body`` turns a block's inner
    text into its calls (None: not calls). At the end of the output a block missing only
    its closing marker still counts when its body reads (a model stopped by EOS)."""

    OPEN = ""
    CLOSE = ""

    def body(self, text: str) -> list[Call] | None:
        raise NotImplementedError

    def body_end(self, buf: str, final: bool) -> int | None:
        """Where the closing marker starts (``buf`` begins with ``OPEN``); None when
        that needs more text, or (with ``final``) there is none."""
        k = buf.find(self.CLOSE, len(self.OPEN))
        return None if k == -1 else k

    def scan(self, buf: str, final: bool) -> tuple[list[Piece], int] | None:
        if not buf.startswith(self.OPEN):
            return text_until(buf, self.OPEN, final)
        end = self.body_end(buf, final)
        if end is None:
            if not final:
                return None
            calls = self.body(buf[len(self.OPEN):])
            return (list(calls) if calls else [Text(buf)]), len(buf)
        used = end + len(self.CLOSE)
        calls = self.body(buf[len(self.OPEN):end])
        return (list(calls) if calls else [Text(buf[:used])]), used
