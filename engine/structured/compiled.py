"""What a grammar compile gives (:class:`CompiledGrammar`), and what the two compilers
(``xgrammar_compiler.py``, ``guidance.py``) share: :class:`Refused` for a spec one of
them cannot take, and the reasoning prefix's gap."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A grammar ready to make matchers: ``backend`` is ``"xgrammar"`` or ``"guidance"``."""

    backend: str
    handle: Any  # xgrammar.CompiledGrammar, or llguidance's grammar text
    seconds: float  # how long the compile took


class Refused(Exception):
    """One backend cannot take a spec; the message says why."""


# The text a model may write between </think> and the constrained output (Qwen3 writes
# "\n\n"): a little whitespace, bounded so a small model cannot loop on it.
THINK_GAP = r"[ \t\r\n]{0,4}"


def first_line(exc: BaseException | str) -> str:
    """The message of a backend error without its C++ location prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    if ".cc:" in text and ": " in text:
        text = text.split(": ", 1)[1]
    return text[:500]
