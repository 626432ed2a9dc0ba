"""``openai``: gpt-oss's calls in OpenAI's harmony format, a message to a function on the
commentary channel, its JSON arguments as the message::

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>

(the recipient before or after the channel, the content type with or without
``<|constrain|>``, the leading ``<|start|>assistant`` absent when nothing came before).
``<|call|>`` ends the model's turn (a stop token, so usually not in the text). It reads the
content the ``openai_gptoss`` reasoning parser leaves after the analysis channel; a
commentary message to no one (a preamble) is content, its markup dropped. The markers
are special tokens, kept in the text for it."""

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

_MESSAGE = "<|message|>"
# A commentary message's header, up to and with <|message|>: the recipient (a function)
# before or after the channel, then an optional content type.
_HEADER = re.compile(
    r"\s*(?:<\|start\|>assistant)?\s*(?:to=functions\.(?P<before>[^\s<]+)\s*)?<\|channel\|>commentary"
    r"(?:\s*to=functions\.(?P<after>[^\s<]+))?\s*(?:<\|constrain\|>)?\s*(?:\w+)?\s*<\|message\|>")
_OPENERS = ("<|start|>", "<|channel|>", "to=")
_ENDS = ("<|call|>", "<|end|>")


def _could_open(buf: str) -> bool:
    """Whether ``buf`` (with no <|message|> yet) may still become a commentary header."""
    body = buf.lstrip()
    return not body or any(body.startswith(o) or o.startswith(body) for o in _OPENERS)


class _Harmony(Format):
    def __init__(self) -> None:
        self._mode = "start"  # start -> call/preamble -> start, or start -> text
        self._name: str | None = None
        self._header = ""

    def scan(self, buf: str, final: bool) -> tuple[list[Piece], int] | None:
        if self._mode == "text":
            return [Text(buf)], len(buf)
        if self._mode == "start":
            end = buf.find(_MESSAGE)
            if end == -1:
                if not final and _could_open(buf):
                    return None
                self._mode = "text"
                return [], 0
            header = _HEADER.fullmatch(buf, 0, end + len(_MESSAGE))
            if header is None:
                self._mode = "text"
                return [], 0
            self._name = header.group("before") or header.group("after")
            self._header = header.group(0)
            self._mode = "body"
            return [], header.end()
        # A message's body, up to <|call|> / <|end|> or the end of the output.
        found = [(i, m) for m in _ENDS if (i := buf.find(m)) != -1]
        if not found and not final:
            return None
        stop, marker = min(found) if found else (len(buf), "")
        body, used = buf[:stop], stop + len(marker)
        self._mode = "start"
        if self._name is None:  # a preamble to the user: content
            return [Text(body)], used
        try:
            args = json.loads(body)
        except ValueError:
            args = None
        if not isinstance(args, dict):  # not a call after all: the text as written
            self._mode = "text"
            return [Text(self._header + body + marker)], used
        return [Call(self._name, json.dumps(args, ensure_ascii=False))], used


register_tool_parser(ToolParser("openai", _Harmony, needs_special_tokens=True))
