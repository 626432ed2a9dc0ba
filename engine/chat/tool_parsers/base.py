"""The shared pieces of the tool-call parsers: what a parse gives (:class:`ToolCall`,
:class:`ToolCallDelta`, :class:`ParsedOutput`, :class:`StreamDelta`), the scanner
interface one model family's syntax implements (:class:`Format` and the pieces it yields),
the driver that streams any scanner (:class:`ToolParser`, :class:`ToolCallStreamer`), and
the registry of parsers by name (:data:`TOOL_PARSERS`)."""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import Callable, Iterator, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call, as OpenAI's ``message.tool_calls[i]``."""

    id: str
    name: str
    arguments: str  # a JSON object, as text

    def args(self) -> dict[str, Any]:
        """The arguments as a dict. A call cut short by ``max_tokens`` (a named call, or
        one streamed as written) may not parse: ``ValueError``."""
        value = json.loads(self.arguments)
        if not isinstance(value, dict):
            raise ValueError(f"the arguments of {self.name!r} are not a JSON object")
        return value

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a streamed call: the first piece of a call has ``id`` and ``name``."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            function = {"name": self.name, **function}
        out["function"] = function
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class ParsedOutput:
    """A complete output split into content (None when there is none) and calls."""

    content: str | None
    tool_calls: tuple[ToolCall, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class StreamDelta:
    """What one piece of streamed text adds: content text and call pieces."""

    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


def random_call_id() -> str:
    """An OpenAI-style call id (``call_`` and 24 hex digits)."""
    return "call_" + secrets.token_hex(12)


# -- pieces a format scanner yields -----------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Text:
    text: str


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: str
    id: str | None = None  # the model's own call id (Kimi K2 writes one), else a new one


@dataclasses.dataclass(frozen=True, slots=True)
class CallOpen:
    """A call streamed as it is written: its name is known, its arguments follow as
    :class:`CallArgs` pieces."""

    name: str


@dataclasses.dataclass(frozen=True, slots=True)
class CallArgs:
    text: str


@dataclasses.dataclass(frozen=True, slots=True)
class CallClose:
    pass


Piece = Text | Call | CallOpen | CallArgs | CallClose


class Format:
    """One model family's call syntax as a resumable scanner.

    ``scan(buf, final)`` is given the unconsumed text (never empty) and returns the pieces
    it could decide and how many characters they used, or None when it needs more text.
    It may return ``([], 0)`` after changing its own state (the driver calls it again);
    with ``final`` it must make progress every call. ``close`` is called once at the end,
    after everything was consumed, for text a scanner consumed but still holds.
    """

    def scan(self, buf: str, final: bool) -> tuple[list[Piece], int] | None:
        raise NotImplementedError

    def close(self) -> list[Piece]:
        return []


class ToolParser:
    """A named tool-call syntax. :meth:`parse` for a complete text, :meth:`streamer` for
    a stream; both give the same result on the same text."""

    def __init__(self, name: str, make_format: Callable[..., Format],
                 new_id: Callable[[], str] = random_call_id,
                 needs_special_tokens: bool = False,
                 make_constrained_format: Callable[[], Format] | None = None,
                 reads_tools: bool = False) -> None:
        self.name = name
        self._make_format = make_format
        self._make_constrained_format = make_constrained_format or make_format
        self.new_id = new_id
        self.needs_special_tokens = needs_special_tokens
        """True when the call markers are special tokens, which the output text must keep
        (the server then decodes with ``skip_special_tokens=False``)."""
        self.reads_tools = reads_tools
        """True when the syntax needs the request's tools to read a call
        (``qwen3_coder`` types its parameter values by the tool's schema)."""

    def streamer(self, new_id: Callable[[], str] | None = None, *,
                 constrained: bool = False, tools: Sequence[Any] = ()) -> ToolCallStreamer:
        """A streamer for one output; ``constrained`` when its calls are generated under
        the tools' grammar (they may then stream as they are written); ``tools`` the
        request's :class:`engine.chat.tools.Tool` values."""
        make = self._make_constrained_format if constrained else self._make_format
        return ToolCallStreamer(make(tools) if self.reads_tools else make(),
                                new_id or self.new_id)

    def parse(self, text: str, new_id: Callable[[], str] | None = None, *,
              constrained: bool = False, tools: Sequence[Any] = ()) -> ParsedOutput:
        streamer = self.streamer(new_id, constrained=constrained, tools=tools)
        streamer.feed(text)
        streamer.finish()
        return streamer.result()


class ToolCallStreamer:
    """Incremental parsing of one output: ``feed`` each new piece of text, ``finish`` at
    the end; each returns the :class:`StreamDelta` to send."""

    def __init__(self, fmt: Format, new_id: Callable[[], str]) -> None:
        self._format = fmt
        self._new_id = new_id
        self._buf = ""
        self._held_space = ""  # trailing whitespace of the content, dropped before a call
        self._after_call = False
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._finished = False

    def feed(self, text: str) -> StreamDelta:
        if self._finished:
            raise RuntimeError("feed after finish")
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> StreamDelta:
        delta = self._drain(final=True)
        self._finished = True
        if self._held_space and not self._after_call:
            # Trailing whitespace of a plain answer is the answer's.
            tail, self._held_space = self._held_space, ""
            self._content.append(tail)
            return StreamDelta(delta.content + tail, delta.tool_calls)
        return delta

    def result(self) -> ParsedOutput:
        content = "".join(self._content)
        return ParsedOutput(content or None, tuple(self._calls))

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        return tuple(self._calls)

    def _drain(self, final: bool) -> StreamDelta:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []

        def take(pieces: list[Piece]) -> None:
            for piece in pieces:
                if isinstance(piece, Text):
                    content.append(self._text(piece.text))
                elif isinstance(piece, Call):
                    deltas.extend(self._call(piece))
                elif isinstance(piece, CallOpen):
                    deltas.append(self._open(piece.name))
                elif isinstance(piece, CallArgs):
                    deltas.append(self._args(piece.text))
                else:
                    self._after_call = True

        while self._buf:
            step = self._format.scan(self._buf, final)
            if step is None:
                if final:
                    raise AssertionError("a scanner must decide everything at the end")
                break
            pieces, used = step
            self._buf = self._buf[used:]
            take(pieces)
        if final:
            take(self._format.close())
        text = "".join(content)
        self._content.append(text)
        return StreamDelta(text, tuple(deltas))

    def _text(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return ""
            self._after_call = False
        text = self._held_space + text
        stripped = text.rstrip()
        self._held_space = text[len(stripped):]
        return stripped

    def _call(self, call: Call) -> Iterator[ToolCallDelta]:
        self._held_space = ""
        self._after_call = True
        index = len(self._calls)
        parsed = ToolCall(call.id or self._new_id(), call.name, call.arguments)
        self._calls.append(parsed)
        yield ToolCallDelta(index, id=parsed.id, name=parsed.name)
        yield ToolCallDelta(index, arguments=parsed.arguments)

    def _open(self, name: str) -> ToolCallDelta:
        self._held_space = ""
        call = ToolCall(self._new_id(), name, "")
        self._calls.append(call)
        return ToolCallDelta(len(self._calls) - 1, id=call.id, name=name)

    def _args(self, text: str) -> ToolCallDelta:
        call = self._calls[-1]
        self._calls[-1] = dataclasses.replace(call, arguments=call.arguments + text)
        return ToolCallDelta(len(self._calls) - 1, arguments=text)


# -- registry ---------------------------------------------------------------------------

TOOL_PARSERS: dict[str, ToolParser] = {}
"""Every tool-call parser by name; each family's module adds its own
(:func:`register_tool_parser`) when :mod:`engine.chat.tool_parsers` imports it."""


def register_tool_parser(parser: ToolParser) -> ToolParser:
    """Add ``parser`` to :data:`TOOL_PARSERS` under its name (a name is taken once)."""
    if parser.name in TOOL_PARSERS:
        raise ValueError(f"tool-call parser {parser.name!r} is registered twice")
    TOOL_PARSERS[parser.name] = parser
    return parser


def get_tool_parser(name: str) -> ToolParser:
    """The parser called ``name``; ``ValueError`` naming the choices otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None
