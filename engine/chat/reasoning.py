"""Reasoning parsers: split a thinking model's reasoning from its answer.

==================  ============================================  =============================
name                the output looks like                         model families
==================  ============================================  =============================
``deepseek_r1``     ``reasoning</think>answer`` (the template      DeepSeek-R1 and its distills,
                    opened ``<think>``; a leading ``<think>`` is   QwQ, Qwen3 thinking-only
                    allowed). No ``</think>``: all reasoning.       (2507)
``qwen3``           ``<think>reasoning</think>answer``. An output   Qwen3, SmolLM3 (hybrid;
                    that does not open with ``<think>`` is all       ``enable_thinking: false``
                    answer.                                          turns it off)
``glm45``           as ``qwen3``                                     GLM-4.5, 4.6
``olmo3``           as ``deepseek_r1``; the markers are plain text  OLMo 3 Think
``exaone4``         as ``deepseek_r1``, only when the request sets  EXAONE 4.0
                    ``chat_template_kwargs`` ``enable_thinking:
                    true`` (off by default, as the template is)
``deepseek_v3``     as ``deepseek_r1``, only with ``chat_template_  DeepSeek V3.1-style hybrid
                    kwargs`` ``thinking: true``                     templates
``granite``         ``Here is my thought process: reasoning Here    Granite 3.2 and 3.3, with
                    is my response: answer`` ("Here's" too); an      ``chat_template_kwargs``
                    output that opens otherwise is all answer        ``thinking: true`` (else off)
``mistral``         ``[THINK]reasoning[/THINK]answer``, the         Magistral, Mistral Small 3.2+
                    markers special tokens (kept in the text);      with a thinking prompt
                    no ``[THINK]``: all answer
``openai_gptoss``   harmony's channels: ``<|channel|>analysis        gpt-oss
                    <|message|>reasoning<|end|>``, then ``<|start|>
                    assistant<|channel|>final<|message|>answer``
                    (the final header dropped); special tokens
                    kept in the text
==================  ============================================  =============================

The split is exact: the opening marker (when the output has it) + reasoning + the closing
marker + content is the model's text, character for character (but for harmony's header
of the final answer, which is dropped from the content; a tool call's header is not: the
``openai`` tool parser reads it). Streaming holds back only
what could be the start of a marker, so the streamed pieces join to the complete split.
A parser whose thinking has a switch (``enable_thinking``, ``thinking``) reads it from the
request's ``chat_template_kwargs`` (:meth:`ReasoningParser.thinking_off`); off, the output
is all answer and a constraint starts at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from engine.structured.spec import think_value

THINK_START = "<think>"
THINK_END = "</think>"
# OpenAI's harmony format (gpt-oss): messages <|start|>ROLE<|channel|>CHANNEL<|message|>...<|end|>.
HARMONY_START = "<|start|>"
HARMONY_END = "<|end|>"
HARMONY_ANALYSIS = "<|channel|>analysis<|message|>"
HARMONY_FINAL = "<|channel|>final<|message|>"


@dataclasses.dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """What one piece of streamed text adds to the reasoning and to the content."""

    reasoning: str = ""
    content: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class ReasoningSplit:
    """A complete output: ``reasoning`` (None when the model did not think) and
    ``content`` (None when it wrote nothing after thinking)."""

    reasoning: str | None
    content: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class ReasoningParser:
    """A named reasoning format; :meth:`parse` and :meth:`streamer` agree on any text.

    ``starts`` and ``ends`` are the markers that open and close the reasoning (any one of
    each); ``starts_in_reasoning``: the prompt opened it, so the output is reasoning until
    an end marker (an opening marker at the very start is allowed). ``switch`` names the
    ``chat_template_kwargs`` key that turns thinking on or off and ``thinks_by_default``
    what its absence means. ``special_markers``: the markers are special tokens, which
    the text keeps only when the request's detokenizing does not skip them."""

    name: str
    starts_in_reasoning: bool
    starts: tuple[str, ...] = (THINK_START,)
    ends: tuple[str, ...] = (THINK_END,)
    switch: str | None = None
    thinks_by_default: bool = True
    special_markers: bool = False
    # Headers that open the answer after the reasoning, dropped from the content
    # (harmony's "<|start|>assistant<|channel|>final<|message|>"). A constraint after the
    # reasoning starts after the first of them.
    content_starts: tuple[str, ...] = ()

    def streamer(self) -> ReasoningStreamer:
        return ReasoningStreamer(self)

    def parse(self, text: str) -> ReasoningSplit:
        streamer = self.streamer()
        streamer.feed(text)
        streamer.finish()
        return streamer.result()

    @property
    def think(self) -> str:
        """The ``think`` of a constraint that starts after this format's reasoning
        (:func:`engine.structured.spec.think_value`)."""
        ends = self.ends if not self.content_starts else tuple(e + self.content_starts[0] for e in self.ends)
        return think_value("open" if self.starts_in_reasoning else "optional", self.starts, ends)

    def thinking_off(self, kwargs: Mapping[str, Any], reads_switch: Callable[[str], bool]) -> bool:
        """Whether a request's ``chat_template_kwargs`` turn this model's thinking off.
        A switch that is on by default (Qwen3's ``enable_thinking``) is off only when the
        request sets it false and the template reads it (such a template then closes the
        reasoning in the prompt); one that is off by default (Granite's ``thinking``,
        EXAONE's ``enable_thinking``) is off unless the request sets it true."""
        if self.switch is None:
            return False
        if self.thinks_by_default:
            return (self.switch in kwargs and not kwargs[self.switch]
                    and reads_switch(self.switch))
        return not kwargs.get(self.switch, False)


class ReasoningStreamer:
    """Incremental split of one output; ``feed`` pieces of text, then ``finish``."""

    def __init__(self, parser: ReasoningParser) -> None:
        self._starts = parser.starts
        self._ends = parser.ends
        self._content_starts = parser.content_starts
        self._header_done = not parser.content_starts
        self._default = "reasoning" if parser.starts_in_reasoning else "content"
        self._state = "start"  # start -> reasoning -> content, or start -> content
        self._buf = ""
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._thought = False

    @property
    def in_reasoning(self) -> bool:
        """True until the reasoning has ended (or was found absent)."""
        return self._state != "content"

    def feed(self, text: str) -> ReasoningDelta:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> ReasoningDelta:
        return self._drain(final=True)

    def result(self) -> ReasoningSplit:
        reasoning = "".join(self._reasoning)
        content = "".join(self._content)
        return ReasoningSplit(reasoning if self._thought and reasoning else None,
                              content or None)

    def _drain(self, final: bool) -> ReasoningDelta:
        reasoning = content = ""
        if self._state == "start":
            opened = next((m for m in self._starts if self._buf.startswith(m)), None)
            if opened is not None:
                self._buf = self._buf[len(opened):]
                self._state = "reasoning"
            elif not final and any(m.startswith(self._buf) for m in self._starts):
                return ReasoningDelta()
            else:
                self._state = self._default
            self._thought = self._state == "reasoning"
        if self._state == "reasoning":
            end, marker = _first(self._buf, self._ends)
            if end == -1:
                keep = 0 if final else max(_partial(self._buf, m) for m in self._ends)
                reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[
                    len(self._buf) - keep:]
            else:
                reasoning = self._buf[:end]
                self._buf = self._buf[end + len(marker):]
                self._state = "content"
        if self._state == "content" and not self._header_done:
            header = next((m for m in self._content_starts if self._buf.startswith(m)), None)
            if header is not None:
                self._buf = self._buf[len(header):]
            elif not final and any(m.startswith(self._buf) for m in self._content_starts):
                self._reasoning.append(reasoning)
                return ReasoningDelta(reasoning, "")
            self._header_done = True
        if self._state == "content":
            content, self._buf = self._buf, ""
        self._reasoning.append(reasoning)
        self._content.append(content)
        return ReasoningDelta(reasoning, content)


def _first(buf: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """Where the earliest of ``markers`` starts in ``buf`` and which one (-1 if none)."""
    found = [(i, m) for m in markers if (i := buf.find(m)) != -1]
    return min(found, key=lambda f: (f[0], -len(f[1]))) if found else (-1, "")


def _partial(buf: str, marker: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``marker``."""
    for n in range(min(len(buf), len(marker) - 1), 0, -1):
        if marker.startswith(buf[-n:]):
            return n
    return 0


_GRANITE_STARTS = ("Here is my thought process:", "Here's my thought process:")
_GRANITE_ENDS = ("Here is my response:", "Here's my response:")

REASONING_PARSERS: dict[str, ReasoningParser] = {p.name: p for p in (
    ReasoningParser("deepseek_r1", starts_in_reasoning=True),
    ReasoningParser("qwen3", starts_in_reasoning=False, switch="enable_thinking"),
    ReasoningParser("glm45", starts_in_reasoning=False, switch="enable_thinking"),
    ReasoningParser("olmo3", starts_in_reasoning=True),
    ReasoningParser("exaone4", starts_in_reasoning=True, switch="enable_thinking",
                    thinks_by_default=False),
    ReasoningParser("deepseek_v3", starts_in_reasoning=True, switch="thinking",
                    thinks_by_default=False),
    ReasoningParser("granite", starts_in_reasoning=False, starts=_GRANITE_STARTS,
                    ends=_GRANITE_ENDS, switch="thinking", thinks_by_default=False),
    ReasoningParser("mistral", starts_in_reasoning=False, starts=("[THINK]",),
                    ends=("[/THINK]",), special_markers=True),
    ReasoningParser("openai_gptoss", starts_in_reasoning=False, starts=(HARMONY_ANALYSIS,),
                    ends=(HARMONY_END,), special_markers=True,
                    content_starts=(HARMONY_START + "assistant" + HARMONY_FINAL, HARMONY_FINAL)),
)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser called ``name``; ``ValueError`` naming the choices otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{', '.join(sorted(REASONING_PARSERS))}") from None
