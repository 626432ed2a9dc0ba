"""One sample's position in its grammar: :class:`Matcher`, over either backend.

A matcher belongs to the one thread that drives the model runner. It fills one row of the
bitmask (``bitmask.py``) with the tokens allowed next.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from engine.structured.compiled import CompiledGrammar


@dataclasses.dataclass(frozen=True, slots=True)
class ThinkKeep:
    """The mask of a reasoning prefix whose markers hold special tokens (Mistral's
    ``[THINK]``, harmony's ``<|end|><|start|>assistant<|channel|>final<|message|>``):
    ``keep`` lets those through while the output is reasoning; the matcher's own mask
    applies once the special tokens accepted end with one of ``ends`` (each end marker's
    special tokens, in order: the grammar holds the text between them), or, when the
    block is ``optional``, once the first token is not one of ``starts``. ``marked``:
    every special token of the markers."""

    keep: torch.Tensor
    starts: frozenset[int]
    ends: tuple[tuple[int, ...], ...]
    optional: bool
    marked: frozenset[int]


class Matcher:
    """One sample's position in its grammar. ``accept`` each sampled token in order;
    ``fill`` writes the tokens allowed next into a bitmask row. EOS is allowed only where
    the grammar accepts; accepting it terminates the matcher."""

    __slots__ = ("_m", "_guidance", "_stop_ids", "_keep", "_think", "_past", "_marks", "accepted",
                 "ended")

    def __init__(self, compiled: CompiledGrammar, stop_ids: frozenset[int],
                 guidance_tokenizer: Any = None, keep: torch.Tensor | None = None,
                 think: ThinkKeep | None = None) -> None:
        self._guidance = compiled.backend == "guidance"
        self._stop_ids = stop_ids
        self._keep = keep  # int32 words ANDed into each mask row (None: all tokens kept)
        self._think = think
        # How many tokens in the reasoning prefix ended (``think``'s mask applies before).
        self._past: int | None = None if think is not None else 0
        # The reasoning's marker tokens accepted so far: (position, token).
        self._marks: list[tuple[int, int]] = []
        self._m: Any  # llguidance.LLMatcher or xgrammar.GrammarMatcher
        # Lazy imports: heavy optional libraries (seconds to import); a compiled grammar
        # of a backend means that backend was imported already.
        if self._guidance:
            import llguidance

            self._m = llguidance.LLMatcher(guidance_tokenizer, compiled.handle)
        else:
            import xgrammar

            self._m = xgrammar.GrammarMatcher(compiled.handle)
        self.accepted = 0  # tokens accepted so far
        # A stop token was accepted: the sample is over, and no mask may be asked for
        # (xgrammar raises). A grammar that is complete but has not seen EOS yet is not
        # ended: its mask then allows the stop tokens only.
        self.ended = False

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (and no change) if the grammar does not allow it."""
        ok = bool(self._m.consume_token(token) if self._guidance else self._m.accept_token(token))
        if ok:
            self.accepted += 1
            self.ended = token in self._stop_ids
            think = self._think
            if think is not None and self._past is None:
                if token in think.marked:
                    self._marks.append((self.accepted, token))
                    tail = tuple(t for _, t in self._marks[-max(map(len, think.ends), default=1):])
                    if any(tail[len(tail) - len(end):] == end for end in think.ends if len(end) <= len(tail)):
                        self._past = self.accepted
                if think.optional and self.accepted == 1 and token not in think.starts:
                    self._past = self.accepted
        return ok

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` (a speculative proposal) the grammar takes from
        here, counting none from the first stop token on (nothing can be masked after
        one); the matcher is left where it was."""
        tokens = list(tokens)
        cut = next((i for i, t in enumerate(tokens) if t in self._stop_ids), len(tokens))
        if self._guidance:
            return int(self._m.validate_tokens(tokens[:cut]))
        n = 0
        while n < cut and self._m.accept_token(tokens[n]):
            n += 1
        if n:
            self._m.rollback(n)
        return n

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (a matcher ended by a stop token is not
        ended any more once that token is undone)."""
        if n < 0 or n > self.accepted:
            raise ValueError(f"cannot roll back {n} of {self.accepted} accepted tokens")
        if n:
            self._m.rollback(n)
            self.accepted -= n
            self.ended = False
            if self._think is not None and self._past is not None and self.accepted < self._past:
                self._past = None  # back inside the reasoning
            while self._marks and self._marks[-1][0] > self.accepted:
                self._marks.pop()

    def complete(self) -> bool:
        """Whether the tokens accepted so far form a whole output (EOS may follow)."""
        return bool(self._m.is_accepting() if self._guidance else self._m.is_completed())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, on the CPU)."""
        if self._guidance:
            import llguidance.torch  # lazy: a heavy optional library, as above

            llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)
        else:
            self._m.fill_next_token_bitmask(bitmask, row)
        keep = self._keep if self._past is not None else self._think.keep  # type: ignore[union-attr]
        if keep is not None:
            bitmask[row] &= keep
