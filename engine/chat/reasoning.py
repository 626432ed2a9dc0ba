"""Reasoning parsers: split a thinking model's ``<think>...</think>`` from its answer.

==============  ===============================================  ==========================
name            the output looks like                            model families
==============  ===============================================  ==========================
``deepseek_r1`` ``reasoning</think>answer`` (the template already  DeepSeek-R1 and its
                opened ``<think>``; a leading ``<think>`` is       distills, QwQ, Qwen3
                allowed). No ``</think>``: all reasoning.          thinking-only (2507)
``qwen3``       ``<think>reasoning</think>answer``. An output that  Qwen3 (hybrid; also with
                does not open with ``<think>`` is all answer.      ``enable_thinking: false``)
==============  ===============================================  ==========================

The split is exact: ``<think>`` (when the output has it) + reasoning + ``</think>`` +
content is the model's text, character for character. Streaming holds back only what
could be the start of a tag, so the streamed pieces join to the complete split.
"""

from __future__ import annotations

import dataclasses

THINK_START = "<think>"
THINK_END = "</think>"


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


class ReasoningParser:
    """A named reasoning format; :meth:`parse` and :meth:`streamer` agree on any text."""

    def __init__(self, name: str, *, starts_in_reasoning: bool) -> None:
        self.name = name
        self.starts_in_reasoning = starts_in_reasoning

    def streamer(self) -> ReasoningStreamer:
        return ReasoningStreamer(self.starts_in_reasoning)

    def parse(self, text: str) -> ReasoningSplit:
        streamer = self.streamer()
        streamer.feed(text)
        streamer.finish()
        return streamer.result()


class ReasoningStreamer:
    """Incremental split of one output; ``feed`` pieces of text, then ``finish``."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        self._default = "reasoning" if starts_in_reasoning else "content"
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
            if self._buf.startswith(THINK_START):
                self._buf = self._buf[len(THINK_START):]
                self._state = "reasoning"
            elif not final and THINK_START.startswith(self._buf):
                return ReasoningDelta()
            else:
                self._state = self._default
            self._thought = self._state == "reasoning"
        if self._state == "reasoning":
            end = self._buf.find(THINK_END)
            if end == -1:
                keep = 0 if final else _partial(self._buf, THINK_END)
                reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[
                    len(self._buf) - keep:]
            else:
                reasoning = self._buf[:end]
                self._buf = self._buf[end + len(THINK_END):]
                self._state = "content"
        if self._state == "content":
            content, self._buf = self._buf, ""
        self._reasoning.append(reasoning)
        self._content.append(content)
        return ReasoningDelta(reasoning, content)


def _partial(buf: str, marker: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``marker``."""
    for n in range(min(len(buf), len(marker) - 1), 0, -1):
        if marker.startswith(buf[-n:]):
            return n
    return 0


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_in_reasoning=True),
    "qwen3": ReasoningParser("qwen3", starts_in_reasoning=False),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser called ``name``; ``ValueError`` naming the choices otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{', '.join(sorted(REASONING_PARSERS))}") from None
