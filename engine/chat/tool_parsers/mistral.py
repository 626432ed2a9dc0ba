"""``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` or
``[TOOL_CALLS]name[ARGS]{...}`` (Mistral 7B v0.3, Mistral Small/Nemo), with Mistral's
nine-character call ids."""

from __future__ import annotations

import json
import secrets
import string

from engine.chat.tool_parsers.base import (
    Call,
    Format,
    Piece,
    Text,
    ToolParser,
    register_tool_parser,
)
from engine.chat.tool_parsers.scan import bracket_end, json_call, loads, partial_marker, text_until

_ALNUM = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    # Mistral's chat templates refuse tool_call_ids that are not 9 alphanumerics.
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


class _Mistral(Format):
    MARK = "[TOOL_CALLS]"
    ARGS = "[ARGS]"

    def scan(self, buf: str, final: bool) -> tuple[list[Piece], int] | None:
        if not buf.startswith(self.MARK):
            return text_until(buf, self.MARK, final)
        at = len(self.MARK)
        i = at + len(buf[at:]) - len(buf[at:].lstrip())
        if i == len(buf):
            return None if not final else ([Text(buf)], len(buf))
        if buf[i] == "[" and not buf.startswith(self.ARGS, i):
            return self._array(buf, i, final)
        return self._named(buf, at, final)

    def _array(self, buf: str, i: int, final: bool) -> tuple[list[Piece], int] | None:
        end = bracket_end(buf, i)
        if end is None:
            return None if not final else ([Text(buf)], len(buf))
        items = loads(buf[i:end])
        if not isinstance(items, list) or not items:
            return [Text(buf[:end])], end
        calls = [json_call(o, ("arguments", "parameters")) for o in items]
        if any(c is None for c in calls):
            return [Text(buf[:end])], end
        return [c for c in calls if c is not None], end

    def _named(self, buf: str, at: int, final: bool) -> tuple[list[Piece], int] | None:
        """``name[ARGS]{...}``: the name is checked as it arrives, so text that cannot be
        one is content at once."""
        k = buf.find(self.ARGS, at)
        head_end = k if k != -1 else len(buf) - (0 if final else partial_marker(buf, self.ARGS))
        bad = next((at + n for n, c in enumerate(buf[at:head_end])
                    if not (c.isalnum() or c in "_-.") and not c.isspace()), None)
        if bad is not None:
            return [Text(buf[:bad])], bad
        if k == -1:
            return None if not final else ([Text(buf)], len(buf))
        name = buf[at:k].strip()
        j = k + len(self.ARGS)
        if not name or any(c.isspace() for c in name):
            return [Text(buf[:j])], j
        if j == len(buf):
            return None if not final else ([Text(buf)], len(buf))
        if buf[j] != "{":
            return [Text(buf[:j])], j
        end = bracket_end(buf, j)
        if end is None:
            return None if not final else ([Text(buf)], len(buf))
        args = loads(buf[j:end])
        if not isinstance(args, dict):
            return [Text(buf[:end])], end
        return [Call(name, json.dumps(args, ensure_ascii=False))], end


register_tool_parser(ToolParser("mistral", _Mistral, new_id=mistral_call_id,
                                needs_special_tokens=True))
