"""One chat choice's model text turned into an assistant message: reasoning, content, calls.

:class:`ChatOutputParser` chains the stages a request asks for. The reasoning parser
(``--reasoning-parser``) splits off ``<think>...</think>`` first; what follows is content,
which then goes through one tool stage:

* a forced call (``tool_choice`` ``required`` or a named function): the output is the
  constrained JSON, read by :class:`engine.chat.tools.ForcedCallStreamer`, or, for
  ``required`` with a parser whose syntax a grammar can follow, calls in that syntax,
  read by the parser;
* ``auto`` with a tool-call parser (``--enable-auto-tool-choice --tool-call-parser``):
  the parser's streamer (:mod:`engine.chat.tool_parsers`);
* otherwise the content is passed through unchanged (``tool_choice: "none"`` never
  produces calls).

``feed`` and ``finish`` return what to stream; :meth:`message` is the complete message,
equal to what the streamed deltas add up to (but for a forced call cut short by
``max_tokens``: the fragment of it already streamed as call pieces stays sent, and the
message drops it; markup still held back is dropped from both). A choice that
produced calls and stopped on its own reports ``finish_reason: "tool_calls"``, as OpenAI
does, except under a named ``tool_choice``: ``"stop"``, as OpenAI and vLLM send it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from engine.chat.reasoning import ReasoningParser, ReasoningStreamer
from engine.chat.tool_parsers import ToolCall, ToolCallDelta, ToolCallStreamer, ToolParser
from engine.chat.tools import NO_TOOLS, ForcedCallStreamer, Tool, ToolChoice


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ChatOutputOptions:
    """How a chat request's outputs are read; one per request."""

    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = NO_TOOLS
    tool_parser: ToolParser | None = None  # used for tool_choice "auto"
    reasoning_parser: ReasoningParser | None = None
    # vLLM's include_reasoning: false parses the reasoning off and drops it (no reasoning
    # deltas, no message.reasoning); the content is the same either way.
    include_reasoning: bool = True
    # tool_choice "required" was generated in the tool parser's own call syntax (a
    # grammar of its <tool_call> blocks), so the parser reads it; otherwise a forced
    # output is JSON for ForcedCallStreamer.
    forced_in_parser_syntax: bool = False

    @property
    def forced(self) -> bool:
        return self.tool_choice.mode in ("required", "function")

    @property
    def parses(self) -> bool:
        """Whether outputs need more than plain text handling."""
        return self.forced or self.reasoning_parser is not None or (
            self.tool_choice.mode == "auto" and self.tool_parser is not None)


@dataclasses.dataclass(frozen=True, slots=True)
class ChatDelta:
    """What one piece of output adds: reasoning text, content text, call pieces."""

    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def to_openai_chunks(self) -> list[dict[str, Any]]:
        """The ``delta`` objects to send, one chunk each: the text and the first call
        piece, then one chunk per further call piece (so a call's header and its
        arguments arrive in separate chunks, as OpenAI streams them)."""
        first = ChatDelta(self.reasoning, self.content, self.tool_calls[:1]).to_openai()
        return [first, *({"tool_calls": [d.to_openai()]} for d in self.tool_calls[1:])]

    def to_openai(self) -> dict[str, Any]:
        """The ``delta`` object of a chat chunk (without ``role``)."""
        out: dict[str, Any] = {}
        if self.reasoning:
            # "reasoning" is vLLM's current name; "reasoning_content" its older one, which
            # clients written for DeepSeek's API read.
            out["reasoning"] = out["reasoning_content"] = self.reasoning
        if self.content:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = [d.to_openai() for d in self.tool_calls]
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class ChatMessage:
    """A complete assistant message: the embedded API's typed value, and HTTP's body."""

    content: str | None
    reasoning_content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()

    def to_openai(self, role: str = "assistant") -> dict[str, Any]:
        out: dict[str, Any] = {"role": role, "content": self.content}
        if self.reasoning_content is not None:
            # vLLM's current name, and its older one that DeepSeek-style clients read.
            out["reasoning"] = out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return out


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class ChatOutputParser:
    """Incremental reading of one choice; see the module docstring."""

    def __init__(self, options: ChatOutputOptions, *, constrained: bool = False) -> None:
        """``constrained``: the output is generated under the tools' grammar in the
        parser's call syntax (:func:`engine.chat.request.calls_constrained`), so a call
        may stream as it is written."""
        self._options = options
        # With a reasoning parser every constraint (a forced call's included) starts after
        # the reasoning (engine.chat.request.chat_sampling_params), so reasoning is split
        # off first whatever the tool choice.
        self._reasoning: ReasoningStreamer | None = (
            options.reasoning_parser.streamer() if options.reasoning_parser is not None
            else None)
        self._tools: ForcedCallStreamer | ToolCallStreamer | None = None
        if options.forced_in_parser_syntax and options.tool_parser is not None:
            self._tools = options.tool_parser.streamer(constrained=constrained,
                                                      tools=options.tools)
        elif options.forced:
            self._tools = ForcedCallStreamer(options.tool_choice)
        elif options.tool_choice.mode == "auto" and options.tool_parser is not None:
            self._tools = options.tool_parser.streamer(constrained=constrained,
                                                      tools=options.tools)
        self._content: list[str] = []
        self._finished = False

    def feed(self, text: str) -> ChatDelta:
        if not text:
            return ChatDelta()
        if self._reasoning is None:
            return self._after_reasoning("", text, final=False)
        split = self._reasoning.feed(text)
        return self._after_reasoning(split.reasoning, split.content, final=False)

    def finish(self, *, cut_short: bool = False) -> ChatDelta:
        """What the end of the output adds. ``cut_short`` (it hit max_tokens): under a
        forced call, the call markup still held back is dropped, not sent as content, as
        :meth:`message` drops it."""
        if self._finished:
            return ChatDelta()
        self._finished = True
        if self._reasoning is None:
            return self._after_reasoning("", "", final=True, cut_short=cut_short)
        split = self._reasoning.finish()
        return self._after_reasoning(split.reasoning, split.content, final=True,
                                     cut_short=cut_short)

    def _after_reasoning(self, reasoning: str, content: str, *, final: bool,
                         cut_short: bool = False) -> ChatDelta:
        if not self._options.include_reasoning:
            reasoning = ""
        if self._tools is None:
            self._content.append(content)
            return ChatDelta(reasoning, content)
        delta = self._tools.feed(content) if content else None
        text = delta.content if delta else ""
        calls = delta.tool_calls if delta else ()
        if final:
            end = self._tools.finish()
            if not (cut_short and self._options.forced):
                text += end.content
            calls += end.tool_calls
        return ChatDelta(reasoning, text, calls)

    def message(self, *, cut_short: bool = False) -> ChatMessage:
        """The complete message; call after :meth:`finish`. ``cut_short``: the output hit
        max_tokens, so a forced call (a named one, or the last of a ``required`` list) may
        be unfinished: such a call and any call markup left as text are dropped (no
        fragment comes back as a call, as vLLM answers)."""
        reasoning = self._reasoning.result().reasoning if self._reasoning else None
        if not self._options.include_reasoning:
            reasoning = None
        if self._tools is None:
            content = "".join(self._content)
            # With a reasoning parser, "no answer after thinking" is null, as vLLM sends it.
            return ChatMessage(content or None if self._reasoning else content, reasoning)
        parsed = self._tools.result()
        if cut_short and self._options.forced:
            calls = tuple(c for c in parsed.tool_calls if _is_json(c.arguments))
            return ChatMessage(None, reasoning, calls)
        return ChatMessage(parsed.content, reasoning, parsed.tool_calls)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's finish reason: ``tool_calls`` when calls ended the turn, but for a
        named ``tool_choice``, whose call ends with ``stop`` (as OpenAI and vLLM send it)."""
        if (engine_reason == "stop" and self._tools is not None
                and self._options.tool_choice.mode != "function"
                and self._tools.result().tool_calls):
            return "tool_calls"
        return engine_reason
