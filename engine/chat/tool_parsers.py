"""Tool-call parsers: a model's text in, OpenAI tool calls and the remaining content out.

Each parser knows one model family's way of writing calls:

===============  ==========================================================  ===============
name             what the model writes                                       model families
===============  ==========================================================  ===============
``hermes``       ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``  Qwen2.5, Qwen3,
                 (one block per call)                                        Hermes 2/3
``granite4``     the same as ``hermes`` (its markers special tokens)         Granite 4
``llama3_json``  ``{"name": ..., "parameters": {...}}``, calls joined by      Llama 3.1-3.3
                 ``;``, optionally after ``<|python_tag|>``
``mistral``      ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` or   Mistral 7B v0.3,
                 ``[TOOL_CALLS]name[ARGS]{...}``                             Mistral Small/Nemo
``pythonic``     ``[get_weather(city="Paris"), ...]`` (optionally inside      Llama 3.2/4,
                 ``<|python_start|>...<|python_end|>``)                      ToolACE
``granite``      ``<|tool_call|>`` or ``<tool_call>``, then a JSON list of     Granite 3.0-3.3
                 ``{"name", "arguments"}`` (the whole output)
``internlm``     ``<|action_start|><|plugin|>{"name", "parameters"}``         InternLM 2/2.5
                 ``<|action_end|>``
``qwen3_coder``  ``<tool_call><function=NAME><parameter=P>value</parameter>``  Qwen3-Coder
                 ``</function></tool_call>``, values typed by the schema
``deepseek_v3``  ``<｜tool▁calls▁begin｜>``, per call ``<｜tool▁call▁begin｜>``       DeepSeek V3
                 ``function<｜tool▁sep｜>NAME`` + a ```json block +
                 ``<｜tool▁call▁end｜>``, then ``<｜tool▁calls▁end｜>``
===============  ==========================================================  ===============

Streaming (:meth:`ToolParser.streamer`) gives OpenAI-shaped deltas: text before a call
streams as content as it arrives (holding back only what could be the start of a call
marker); a call is sent once its text is complete and parses, as one delta with ``index``,
``id``, ``type`` and ``name`` and then its ``arguments``. Holding a call until it is
complete is deliberate: text that opens a call and then turns out malformed comes back as
content, never as a half-sent broken call, and a streamed response assembles to exactly
what the complete parse returns (the tests check this at every split point).
``arguments`` is then the JSON text of the call's arguments object, written by
``json.dumps`` (so it always parses).

A call generated under the tools' grammar (``streamer(constrained=True)``: ``auto`` once
the call opens, ``required`` in the parser's syntax) cannot turn out malformed, so where
the parser knows the grammar's frame (``hermes``, ``granite4``) it streams the call as it is written:
the header once the name is complete, then each new piece of the arguments object as an
argument fragment, the model's own JSON text. Only ``max_tokens`` can cut such a call
short; its arguments are then the prefix that was written, as with a named forced call.
The other parsers send constrained calls whole, as above.

Whitespace right before or after a call is not content (models put newlines between
calls); other text around calls is.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import secrets
import string
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


_ALNUM = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    # Mistral's chat templates refuse tool_call_ids that are not 9 alphanumerics.
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


# -- pieces a format scanner yields -----------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Text:
    text: str


@dataclasses.dataclass(frozen=True, slots=True)
class _Call:
    name: str
    arguments: str


@dataclasses.dataclass(frozen=True, slots=True)
class _CallOpen:
    """A call streamed as it is written: its name is known, its arguments follow as
    :class:`_CallArgs` pieces."""

    name: str


@dataclasses.dataclass(frozen=True, slots=True)
class _CallArgs:
    text: str


@dataclasses.dataclass(frozen=True, slots=True)
class _CallClose:
    pass


_Piece = _Text | _Call | _CallOpen | _CallArgs | _CallClose


class _Format:
    """One model family's call syntax as a resumable scanner.

    ``scan(buf, final)`` is given the unconsumed text (never empty) and returns the pieces
    it could decide and how many characters they used, or None when it needs more text.
    It may return ``([], 0)`` after changing its own state (the driver calls it again);
    with ``final`` it must make progress every call. ``close`` is called once at the end,
    after everything was consumed, for text a scanner consumed but still holds.
    """

    def scan(self, buf: str, final: bool) -> tuple[list[_Piece], int] | None:
        raise NotImplementedError

    def close(self) -> list[_Piece]:
        return []


class ToolParser:
    """A named tool-call syntax. :meth:`parse` for a complete text, :meth:`streamer` for
    a stream; both give the same result on the same text."""

    def __init__(self, name: str, make_format: Callable[..., _Format],
                 new_id: Callable[[], str] = random_call_id,
                 needs_special_tokens: bool = False,
                 make_constrained_format: Callable[[], _Format] | None = None,
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

    def __init__(self, fmt: _Format, new_id: Callable[[], str]) -> None:
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

        def take(pieces: list[_Piece]) -> None:
            for piece in pieces:
                if isinstance(piece, _Text):
                    content.append(self._text(piece.text))
                elif isinstance(piece, _Call):
                    deltas.extend(self._call(piece))
                elif isinstance(piece, _CallOpen):
                    deltas.append(self._open(piece.name))
                elif isinstance(piece, _CallArgs):
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

    def _call(self, call: _Call) -> Iterator[ToolCallDelta]:
        self._held_space = ""
        self._after_call = True
        index = len(self._calls)
        parsed = ToolCall(self._new_id(), call.name, call.arguments)
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


# -- shared scanning helpers ------------------------------------------------------------


def _partial_marker(buf: str, marker: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``marker``."""
    for n in range(min(len(buf), len(marker) - 1), 0, -1):
        if marker.startswith(buf[-n:]):
            return n
    return 0


def _text_until(buf: str, marker: str, final: bool) -> tuple[list[_Piece], int] | None:
    """Content up to ``marker`` (exclusive), holding back a possible partial marker."""
    i = buf.find(marker)
    if i == -1:
        keep = 0 if final else _partial_marker(buf, marker)
        i = len(buf) - keep
    if i == 0:
        return None
    return [_Text(buf[:i])], i


def _bracket_end(buf: str, start: int, quotes: str = '"') -> int | None:
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


def _json_call(obj: Any, args_keys: tuple[str, ...]) -> _Call | None:
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
    return _Call(obj["name"], json.dumps(args, ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


# -- hermes -----------------------------------------------------------------------------


class _Hermes(_Format):
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def scan(self, buf: str, final: bool) -> tuple[list[_Piece], int] | None:
        if not buf.startswith(self.OPEN):
            return _text_until(buf, self.OPEN, final)
        end = self._close(buf, final)
        if end is None:
            if not final:
                return None
            # A model stopped by EOS right after the JSON: accept a complete call.
            call = _json_call(_loads(buf[len(self.OPEN):]), ("arguments", "parameters"))
            return ([call] if call else [_Text(buf)]), len(buf)
        used = end + len(self.CLOSE)
        call = _json_call(_loads(buf[len(self.OPEN):end]), ("arguments", "parameters"))
        return ([call] if call else [_Text(buf[:used])]), used

    def _close(self, buf: str, final: bool) -> int | None:
        """Where the call's closing tag starts, or None when that is not decided yet
        (needs more text) or there is none. A JSON object body is read to its end first:
        a string in it may hold "</tool_call>"."""
        i = len(buf) - len(buf[len(self.OPEN):].lstrip())
        if i < len(buf) and buf[i] == "{":
            end = _bracket_end(buf, i)
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

    def scan(self, buf: str, final: bool) -> tuple[list[_Piece], int] | None:
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
        return [_CallOpen(name)], used

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

    def _arguments(self, buf: str) -> tuple[list[_Piece], int]:
        end = self._end.scan(buf)
        if end is None:
            return [_CallArgs(buf)], len(buf)
        self._mode = "tail"
        return ([_CallArgs(buf[:end])] if end else []), end

    def _tail(self, buf: str, final: bool) -> tuple[list[_Piece], int] | None:
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

    def _close_call(self, used: int) -> tuple[list[_Piece], int]:
        self._mode, self._opened = "text", False
        return [_CallClose()], used

    def close(self) -> list[_Piece]:
        # Cut short by max_tokens inside the call: it keeps the arguments written.
        return [_CallClose()] if self._opened else []


# -- llama3_json ------------------------------------------------------------------------


class _Llama3Json(_Format):
    """Calls only at the start of the output; the first text that is not a call (or
    a ``;`` between calls) ends them and is content from there on."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._mode = "start"  # start -> calls -> text
        self._calls = 0
        self._prefix = ""  # consumed text given back if the first call fails

    def scan(self, buf: str, final: bool) -> tuple[list[_Piece], int] | None:
        if self._mode == "text":
            return [_Text(buf)], len(buf)
        if self._mode == "start":
            return self._start(buf, final)
        return self._next_call(buf, final)

    def _start(self, buf: str, final: bool) -> tuple[list[_Piece], int] | None:
        body = buf.lstrip()
        if body.startswith(self.TAG):
            used = len(buf) - len(body) + len(self.TAG)
            self._mode, self._prefix = "calls", buf[:used]
            return [], used
        if not final and (not body or self.TAG.startswith(body)):
            return None
        self._mode = "calls" if body.startswith("{") else "text"
        return [], 0

    def _next_call(self, buf: str, final: bool) -> tuple[list[_Piece], int] | None:
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
        end = _bracket_end(buf, i)
        if end is None:
            return None if not final else self._fail(buf)
        call = _json_call(_loads(buf[i:end]), ("parameters", "arguments"))
        if call is None:
            return self._fail(buf)
        self._calls += 1
        return [call], end

    def _fail(self, buf: str) -> tuple[list[_Piece], int]:
        self._mode = "text"
        text = buf if self._calls else self._prefix + buf
        self._prefix = ""
        return [_Text(text)], len(buf)

    def close(self) -> list[_Piece]:
        # "<|python_tag|>" and nothing after it.
        return [_Text(self._prefix)] if self._mode == "calls" and not self._calls \
            and self._prefix else []


# -- mistral ----------------------------------------------------------------------------


class _Mistral(_Format):
    MARK = "[TOOL_CALLS]"
    ARGS = "[ARGS]"

    def scan(self, buf: str, final: bool) -> tuple[list[_Piece], int] | None:
        if not buf.startswith(self.MARK):
            return _text_until(buf, self.MARK, final)
        at = len(self.MARK)
        i = at + len(buf[at:]) - len(buf[at:].lstrip())
        if i == len(buf):
            return None if not final else ([_Text(buf)], len(buf))
        if buf[i] == "[" and not buf.startswith(self.ARGS, i):
            return self._array(buf, i, final)
        return self._named(buf, at, final)

    def _array(self, buf: str, i: int, final: bool) -> tuple[list[_Piece], int] | None:
        end = _bracket_end(buf, i)
        if end is None:
            return None if not final else ([_Text(buf)], len(buf))
        items = _loads(buf[i:end])
        if not isinstance(items, list) or not items:
            return [_Text(buf[:end])], end
        calls = [_json_call(o, ("arguments", "parameters")) for o in items]
        if any(c is None for c in calls):
            return [_Text(buf[:end])], end
        return [c for c in calls if c is not None], end

    def _named(self, buf: str, at: int, final: bool) -> tuple[list[_Piece], int] | None:
        """``name[ARGS]{...}``: the name is checked as it arrives, so text that cannot be
        one is content at once."""
        k = buf.find(self.ARGS, at)
        head_end = k if k != -1 else len(buf) - (0 if final else _partial_marker(buf, self.ARGS))
        bad = next((at + n for n, c in enumerate(buf[at:head_end])
                    if not (c.isalnum() or c in "_-.") and not c.isspace()), None)
        if bad is not None:
            return [_Text(buf[:bad])], bad
        if k == -1:
            return None if not final else ([_Text(buf)], len(buf))
        name = buf[at:k].strip()
        j = k + len(self.ARGS)
        if not name or any(c.isspace() for c in name):
            return [_Text(buf[:j])], j
        if j == len(buf):
            return None if not final else ([_Text(buf)], len(buf))
        if buf[j] != "{":
            return [_Text(buf[:j])], j
        end = _bracket_end(buf, j)
        if end is None:
            return None if not final else ([_Text(buf)], len(buf))
        args = _loads(buf[j:end])
        if not isinstance(args, dict):
            return [_Text(buf[:end])], end
        return [_Call(name, json.dumps(args, ensure_ascii=False))], end


# -- pythonic ---------------------------------------------------------------------------


class _Pythonic(_Format):
    """A Python list of calls with keyword arguments, at the start of the output."""

    START = "<|python_start|>"
    END = "<|python_end|>"

    def __init__(self) -> None:
        self._mode = "start"  # start -> list [-> end] -> text
        self._prefix = ""  # consumed text given back if the list fails

    def scan(self, buf: str, final: bool) -> tuple[list[_Piece], int] | None:
        if self._mode == "text":
            return [_Text(buf)], len(buf)
        if self._mode == "start":
            return self._start(buf, final)
        if self._mode == "list":
            return self._list(buf, final)
        body = buf.lstrip()  # mode "end": an optional <|python_end|>
        if body.startswith(self.END):
            self._mode = "text"
            return [], len(buf) - len(body) + len(self.END)
        if not final and (not body or self.END.startswith(body)):
            return None
        self._mode = "text"
        return [], 0

    def _start(self, buf: str, final: bool) -> tuple[list[_Piece], int] | None:
        body = buf.lstrip()
        if body.startswith(self.START):
            used = len(buf) - len(body) + len(self.START)
            self._mode, self._prefix = "list", buf[:used]
            return [], used
        if not final and (not body or self.START.startswith(body)):
            return None
        self._mode = "list" if body.startswith("[") else "text"
        return [], 0

    def _list(self, buf: str, final: bool) -> tuple[list[_Piece], int] | None:
        lead = len(buf) - len(buf.lstrip())
        if lead == len(buf):
            return None if not final else self._fail(buf, len(buf))
        if buf[lead] != "[":
            return self._fail(buf, len(buf))
        end = _bracket_end(buf, lead, quotes="\"'")
        if end is None:
            return None if not final else self._fail(buf, len(buf))
        calls = _python_calls(buf[lead:end])
        if calls is None:
            return self._fail(buf, end)
        self._mode = "end" if self._prefix else "text"
        return list(calls), end

    def _fail(self, buf: str, upto: int) -> tuple[list[_Piece], int]:
        self._mode = "text"
        text, self._prefix = self._prefix + buf[:upto], ""
        return [_Text(text)], upto

    def close(self) -> list[_Piece]:
        if self._mode == "list" and self._prefix:
            return [_Text(self._prefix)]
        return []


_PY_CONSTANTS = {"true": True, "false": False, "null": None}


def _python_calls(source: str) -> list[_Call] | None:
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or not isinstance(
                node.func, (ast.Name, ast.Attribute)):
            return None
        try:
            args = {kw.arg: _py_value(kw.value) for kw in node.keywords if kw.arg is not None}
        except ValueError:
            return None
        if len(args) != len(node.keywords):  # **kwargs
            return None
        calls.append(_Call(ast.unparse(node.func), json.dumps(args, ensure_ascii=False)))
    return calls


def _py_value(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _PY_CONSTANTS:
        return _PY_CONSTANTS[node.id]
    if isinstance(node, ast.List):
        return [_py_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {_py_key(k): _py_value(v) for k, v in zip(node.keys, node.values, strict=True)}
    value = ast.literal_eval(node)  # raises ValueError on anything not a literal
    if isinstance(value, tuple):
        return list(value)
    if not isinstance(value, (str, int, float, bool)) and value is not None:
        raise ValueError(f"not a JSON value: {value!r}")
    return value


def _py_key(node: ast.expr | None) -> str:
    key = _py_value(node) if node is not None else None
    if not isinstance(key, str):
        raise ValueError("dict keys must be strings")
    return key


# -- granite ----------------------------------------------------------------------------


class _Granite(_Format):
    """Granite 3.x: the whole output is ``<|tool_call|>`` (3.0's special token) or
    ``<tool_call>`` (3.1+) and a JSON list of ``{"name", "arguments"}`` objects. Text
    after the list is content; an output that does not open this way is all content."""

    MARKS = ("<|tool_call|>", "<tool_call>")

    def __init__(self) -> None:
        self._mode = "start"  # start -> list -> text
        self._prefix = ""  # consumed text given back if the list fails

    def scan(self, buf: str, final: bool) -> tuple[list[_Piece], int] | None:
        if self._mode == "text":
            return [_Text(buf)], len(buf)
        if self._mode == "start":
            return self._start(buf, final)
        return self._list(buf, final)

    def _start(self, buf: str, final: bool) -> tuple[list[_Piece], int] | None:
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

    def _list(self, buf: str, final: bool) -> tuple[list[_Piece], int] | None:
        lead = len(buf) - len(buf.lstrip())
        if lead == len(buf):
            return None if not final else self._fail(buf, len(buf))
        if buf[lead] != "[":
            return self._fail(buf, len(buf))
        end = _bracket_end(buf, lead)
        if end is None:
            return None if not final else self._fail(buf, len(buf))
        items = _loads(buf[lead:end])
        calls = ([_json_call(o, ("arguments", "parameters")) for o in items]
                 if isinstance(items, list) and items else [None])
        if any(c is None for c in calls):
            return self._fail(buf, end)
        self._mode, self._prefix = "text", ""
        return [c for c in calls if c is not None], end

    def _fail(self, buf: str, upto: int) -> tuple[list[_Piece], int]:
        self._mode = "text"
        text, self._prefix = self._prefix + buf[:upto], ""
        return [_Text(text)], upto

    def close(self) -> list[_Piece]:
        # A marker and nothing after it.
        return [_Text(self._prefix)] if self._mode == "list" and self._prefix else []


# -- tagged blocks: internlm, qwen3_coder -------------------------------------------------


class _Blocks(_Format):
    """Calls in blocks between an opening and a closing marker, with text around them; a
    block whose body does not read as calls is content. ``body`` turns a block's inner
    text into its calls (None: not calls). At the end of the output a block missing only
    its closing marker still counts when its body reads (a model stopped by EOS)."""

    OPEN = ""
    CLOSE = ""

    def body(self, text: str) -> list[_Call] | None:
        raise NotImplementedError

    def body_end(self, buf: str, final: bool) -> int | None:
        """Where the closing marker starts (``buf`` begins with ``OPEN``); None when
        that needs more text, or (with ``final``) there is none."""
        k = buf.find(self.CLOSE, len(self.OPEN))
        return None if k == -1 else k

    def scan(self, buf: str, final: bool) -> tuple[list[_Piece], int] | None:
        if not buf.startswith(self.OPEN):
            return _text_until(buf, self.OPEN, final)
        end = self.body_end(buf, final)
        if end is None:
            if not final:
                return None
            calls = self.body(buf[len(self.OPEN):])
            return (list(calls) if calls else [_Text(buf)]), len(buf)
        used = end + len(self.CLOSE)
        calls = self.body(buf[len(self.OPEN):end])
        return (list(calls) if calls else [_Text(buf[:used])]), used


class _InternLM(_Blocks):
    """InternLM2/2.5: ``<|action_start|><|plugin|>`` + ``{"name", "parameters"}`` +
    ``<|action_end|>`` (all three special tokens)."""

    OPEN = "<|action_start|><|plugin|>"
    CLOSE = "<|action_end|>"

    def body(self, text: str) -> list[_Call] | None:
        call = _json_call(_loads(text.strip()), ("parameters", "arguments"))
        return [call] if call else None


class _Qwen3Coder(_Blocks):
    """Qwen3-Coder's XML-like calls, one per block::

        <tool_call>
        <function=get_weather>
        <parameter=city>
        Paris
        </parameter>
        </function>
        </tool_call>

    A value is text (one newline either side is the layout's, not the value's), turned
    into the type its tool's schema gives the parameter (:func:`_typed_value`)."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    FUNCTION = "<function="
    FUNCTION_END = "</function>"
    PARAM = "<parameter="
    PARAM_END = "</parameter>"

    def __init__(self, tools: Any = ()) -> None:
        self._schemas: dict[str, Any] = {t.name: t.parameters for t in tools}

    def body_end(self, buf: str, final: bool) -> int | None:
        # The function's own structure is read first: a value may hold "</tool_call>".
        at = self._function_end(buf, len(self.OPEN))
        if at is not None:
            j = len(buf) - len(buf[at:].lstrip())
            if buf.startswith(self.CLOSE, j):
                return j
            if not final and self.CLOSE.startswith(buf[j:]):
                return None
        elif not final and self._may_continue(buf):
            return None
        k = buf.find(self.CLOSE, len(self.OPEN))
        return None if k == -1 else k

    def _may_continue(self, buf: str) -> bool:
        """Whether the block so far is a prefix of a well-formed function."""
        try:
            self._read(buf[len(self.OPEN):], partial=True)
        except ValueError:
            return False
        return True

    def _function_end(self, buf: str, start: int) -> int | None:
        """Index just past ``</function>`` when the block's function reads to its end."""
        try:
            read = self._read(buf[start:], partial=False)
        except ValueError:
            return None
        return None if read is None else start + read[2]

    def _read(self, text: str, *, partial: bool) -> tuple[str, dict[str, str], int] | None:
        """``(name, {parameter: raw value}, end)`` of the function ``text`` opens; None
        when ``partial`` and the text ends first; ``ValueError`` when it is not one."""
        def need(i: int, marker: str) -> int:
            rest = text[i:]
            if rest.startswith(marker):
                return i + len(marker)
            if partial and marker.startswith(rest):
                raise _NeedMore
            raise ValueError(marker)

        try:
            i = need(len(text) - len(text.lstrip()), self.FUNCTION)
            gt = text.find(">", i)
            if gt == -1:
                if partial and "\n" not in text[i:]:
                    raise _NeedMore
                raise ValueError("name")
            name = text[i:gt].strip()
            if not name or any(c in name for c in "<\n"):
                raise ValueError("name")
            i, params = gt + 1, {}
            while True:
                i += len(text[i:]) - len(text[i:].lstrip())
                if text.startswith(self.FUNCTION_END, i):
                    return name, params, i + len(self.FUNCTION_END)
                if partial and self.FUNCTION_END.startswith(text[i:]) and i < len(text):
                    raise _NeedMore
                i = need(i, self.PARAM)
                gt = text.find(">", i)
                if gt == -1:
                    if partial and "\n" not in text[i:]:
                        raise _NeedMore
                    raise ValueError("parameter")
                key = text[i:gt].strip()
                end = text.find(self.PARAM_END, gt + 1)
                if not key or key in params:
                    raise ValueError("parameter")
                if end == -1:
                    if partial:
                        raise _NeedMore
                    raise ValueError("parameter")
                value = text[gt + 1:end]
                value = value[1:] if value.startswith("\n") else value
                params[key] = value[:-1] if value.endswith("\n") else value
                i = end + len(self.PARAM_END)
        except _NeedMore:
            return None

    def body(self, text: str) -> list[_Call] | None:
        try:
            read = self._read(text, partial=False)
        except ValueError:
            return None
        if read is None or text[read[2]:].strip():
            return None
        name, params, _ = read
        schema = self._schemas.get(name)
        props = schema.get("properties", {}) if isinstance(schema, dict) else {}
        args = {k: _typed_value(v, props.get(k) if isinstance(props, dict) else None)
                for k, v in params.items()}
        return [_Call(name, json.dumps(args, ensure_ascii=False))]


class _NeedMore(Exception):
    """A partial read ran out of text."""


def _schema_types(schema: Any) -> list[str]:
    """The JSON types a parameter's schema allows, in the order it lists them."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    if "enum" in schema and isinstance(schema["enum"], list):
        return sorted({_json_type(v) for v in schema["enum"]})
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return [t for option in schema[key] for t in _schema_types(option)]
    return []


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return "string" if isinstance(value, str) else "object"


def _typed_value(text: str, schema: Any) -> Any:
    """A qwen3_coder parameter's text as the type its schema gives it: strings stay as
    written; ``integer``, ``number``, ``boolean`` and ``null`` are read from the text;
    ``object`` and ``array`` as JSON (or a Python literal, which some templates write);
    ``null`` or ``None`` where the schema allows null. Text that does not read as the schema's type stays a string, so the schema's
    validator sees what the model wrote. A parameter the schema does not declare is a
    string."""
    types = _schema_types(schema)
    value = text.strip()
    if "null" in types and value in ("null", "None"):
        return None
    if not types or types[0] == "string":
        return text
    for kind in (t for t in types if t != "null"):
        if kind == "integer":
            try:
                return int(value)
            except ValueError:
                continue
        if kind == "number":
            try:
                return int(value)
            except ValueError:
                pass
            try:
                number = float(value)
            except ValueError:
                continue
            if number == number and abs(number) != float("inf"):
                return number
        if kind == "boolean" and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if kind in ("object", "array"):
            parsed = _loads(value)
            if parsed is None:
                try:
                    parsed = ast.literal_eval(value)
                except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                    continue
            if isinstance(parsed, dict if kind == "object" else (list, tuple)):
                return list(parsed) if isinstance(parsed, tuple) else parsed
        if kind == "string":
            return text
    return text


# -- deepseek_v3 ------------------------------------------------------------------------


class _DeepSeekV3(_Format):
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
    _BODY = re.compile(r"\s*function" + re.escape(SEP) + r"([^\n`<]+?)[ \t]*\n\s*```(?:json)?\s*"
                       r"(\{.*\})\s*```\s*", re.DOTALL)

    def __init__(self) -> None:
        self._mode = "text"  # text -> calls -> text
        self._prefix = ""  # the section's opening, given back if its first call fails
        self._calls = 0

    def scan(self, buf: str, final: bool) -> tuple[list[_Piece], int] | None:
        if self._mode == "text":
            if not buf.startswith(self.BEGIN):
                return _text_until(buf, self.BEGIN, final)
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
        args = _loads(match.group(2)) if match else None
        if match is None or not isinstance(args, dict):
            return self._fail(buf)
        self._calls += 1
        self._prefix = ""
        call = _Call(match.group(1).strip(), json.dumps(args, ensure_ascii=False))
        return [call], lead + end + len(self.CALL_END)

    def _fail(self, buf: str) -> tuple[list[_Piece], int]:
        self._mode = "text"
        text, self._prefix = self._prefix + buf, ""
        return [_Text(text)], len(buf)

    def close(self) -> list[_Piece]:
        # The section's opening and nothing after it.
        return [_Text(self._prefix)] if self._mode == "calls" and self._prefix else []


# -- registry ---------------------------------------------------------------------------

TOOL_PARSERS: dict[str, ToolParser] = {
    "hermes": ToolParser("hermes", _Hermes, make_constrained_format=_StreamingHermes),
    "llama3_json": ToolParser("llama3_json", _Llama3Json, needs_special_tokens=True),
    "mistral": ToolParser("mistral", _Mistral, new_id=mistral_call_id,
                          needs_special_tokens=True),
    "pythonic": ToolParser("pythonic", _Pythonic, needs_special_tokens=True),
    "granite": ToolParser("granite", _Granite, needs_special_tokens=True),
    # Granite 4 writes hermes' syntax; its <tool_call> markers are special tokens.
    "granite4": ToolParser("granite4", _Hermes, make_constrained_format=_StreamingHermes,
                           needs_special_tokens=True),
    "internlm": ToolParser("internlm", _InternLM, needs_special_tokens=True),
    "qwen3_coder": ToolParser("qwen3_coder", _Qwen3Coder, reads_tools=True),
    "deepseek_v3": ToolParser("deepseek_v3", _DeepSeekV3, needs_special_tokens=True),
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser called ``name``; ``ValueError`` naming the choices otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None
