"""Incremental detokenization with stop strings: token ids in, finished text out.

Pure and synchronous (no trio, no I/O); the detokenizer actor holds one
:class:`IncrementalDetokenizer` per request.

Two things make streaming text harder than ``decode(all_ids)`` at the end:

* A token is not always whole characters. Byte-level BPE splits a multi-byte UTF-8
  character (an emoji is four bytes) across tokens, and decoding a part gives U+FFFD.
  Sentencepiece-style decoders also change a token's text depending on what precedes it
  (the leading space of ``▁word`` is dropped at the start of a string).
* A stop string can span tokens and must not leak: once ``"\\n\\n"`` is the stop, a lone
  ``"\\n"`` may not be sent until the next character shows it is not the stop.

The first is solved with two offsets into the token list::

    tokens:  ... | prefix window  | new tokens |
                 ^prefix_offset   ^read_offset ^len(tokens)

    new text = decode(tokens[prefix_offset:]) minus decode(tokens[prefix_offset:read_offset])

The prefix window gives the new tokens their left context; its text is decoded and
dropped. New text that ends in U+FFFD is held (offsets unchanged) until the character
completes. Both windows stay a few tokens long, so each push costs O(1), not O(output).
The window starts in the prompt's last tokens, so the first output token gets its context
too: the text is the prompt's continuation, which for byte-level BPE equals
``decode(output_ids)`` exactly.

The second is solved by holding back the longest tail of the text that is a proper prefix
of some stop string, and searching for stop strings only in that tail plus the new text.
The held tail is found without storing the stop strings' prefixes (memory linear in the
stop strings; ``SamplingParams`` caps their count and length).

``spaces_between_special_tokens=False`` (with special tokens kept in the text) writes an
added token that follows another added token as its own text, with nothing between them:
the text is decoded in runs cut before each such token, as vLLM's fast detokenizer does
(whatever separator the tokenizer's decoder puts between tokens, a WordPiece decoder's
space for one, then falls away there only).

``min_tokens`` protects the text of the first ``min_tokens`` outputs, as in vLLM: a stop
string cannot end inside it (one that starts there and ends later still stops), just as
EOS and stop token ids cannot end the request that early.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from typing import Protocol

from engine.errors import InvalidParamError

# Prompt tokens used as the first prefix window. A handful is enough left context for
# every decoder rule we know of (sentencepiece's leading space, byte-level partial
# characters); vLLM uses the same count for the same reason.
PROMPT_CONTEXT_TOKENS = 5

# Once this many consumed tokens sit before the prefix window, drop them, so a long
# output keeps O(1) memory here; amortized O(1) per token.
_COMPACT_AFTER = 256

_REPLACEMENT_CHAR = "\ufffd"


class _Decoder(Protocol):
    """What the detokenizer needs of :class:`engine.models.tokenizer.Tokenizer`."""

    skipped_special_ids: frozenset[int]
    added_token_ids: frozenset[int]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclasses.dataclass(frozen=True, slots=True)
class DetokenizerUpdate:
    """The result of one push: text to send now and whether the request stopped.

    ``text`` is new text since the previous update (possibly empty). ``stopped`` is true
    once a stop string matched; ``stop_reason`` is that stop string.
    """

    text: str
    stopped: bool = False
    stop_reason: str | None = None


class IncrementalDetokenizer:
    """Turn one request's output token ids into text, piece by piece.

    Call :meth:`push` with each step's new ids and send ``update.text``; call
    :meth:`finish` when the request ends to release text held back (an unfinished UTF-8
    character or a possible stop-string start). Without a stop string, the concatenation
    of every update's text equals the text of the output ids decoded with
    ``skip_special_tokens`` in the prompt's context (for byte-level BPE:
    ``tokenizer.decode(output_ids)``). With stop strings, the text ends where the first
    stop string ends (``include_stop_str_in_output``) or begins (otherwise), and nothing
    after it is ever returned; no stop string may end in the text of the first
    ``min_tokens`` ids.
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Iterable[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # Adjacent added tokens written with nothing between them (only where special
        # tokens stay in the text: skipped, they leave no neighbours to space).
        self._tight: frozenset[int] = frozenset() if (
            skip_special_tokens or spaces_between_special_tokens) else tokenizer.added_token_ids
        self._stop = tuple(stop)
        if any(not isinstance(s, str) or not s for s in self._stop):
            raise InvalidParamError("stop must hold non-empty strings", param="stop")
        self._include_stop = include_stop_str_in_output

        context = self._kept_tail(prompt_token_ids, PROMPT_CONTEXT_TOKENS)
        self._tokens: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        # The prefix window's text, decoded when the first token needs it: a request that
        # ends before any token has text (a pooling request, an early abort) never pays
        # for the decode.
        self._prefix: str | None = None
        self._held = ""  # decoded text not yet returned: a possible stop-string start
        self._stop_reason: str | None = None
        self._min_tokens = min_tokens
        self._num_outputs = 0  # ids pushed, special ones included (min_tokens counts them)
        # Leading characters of the text not sent yet (_held, then text waiting for a
        # character to complete) that belong to the first min_tokens outputs.
        self._protected = 0

    @property
    def stopped(self) -> bool:
        """True once a stop string matched; later pushes return no text."""
        return self._stop_reason is not None

    def push(self, token_ids: Iterable[int]) -> DetokenizerUpdate:
        """Add newly sampled ids; return the text that is now safe to send."""
        if self.stopped:
            return self._stopped_update("")
        ids = list(token_ids)
        # Ids that are still among the first min_tokens outputs: their text is protected.
        split = min(len(ids), max(0, self._min_tokens - self._num_outputs))
        self._num_outputs += len(ids)
        text = ""
        if split:
            self._tokens.extend(self._kept(ids[:split]))
            text = self._emit(self._new_text(flush=False), final=False, protected=True).text
            if split == len(ids):
                return DetokenizerUpdate(text)
        self._tokens.extend(self._kept(ids[split:]))
        update = self._emit(self._new_text(flush=False), final=False)
        # Once past min_tokens (nearly every push) there is no protected text to prepend;
        # the copy was 1.5% of the event loop's CPU at concurrency 32 (issue 42).
        return dataclasses.replace(update, text=text + update.text) if text else update

    def finish(self) -> DetokenizerUpdate:
        """Release everything held back, at the end of the request.

        An unfinished character is sent as U+FFFD (what a full decode gives); a held tail
        that could have started a stop string is sent as it is.
        """
        if self.stopped:
            return self._stopped_update("")
        protected = self._num_outputs <= self._min_tokens and self._min_tokens > 0
        return self._emit(self._new_text(flush=True), final=True, protected=protected)

    # -- tokens to text -----------------------------------------------------------------

    def _kept(self, ids: Iterable[int]) -> list[int]:
        # decode(skip_special_tokens=True) drops special tokens before running the decoder,
        # so dropping them here gives the same text and keeps the windows short.
        if not self._skip_special:
            return list(ids)
        skipped = self._tokenizer.skipped_special_ids
        return [i for i in ids if i not in skipped]

    def _kept_tail(self, ids: Sequence[int], count: int) -> list[int]:
        """The last ``count`` of ``_kept(ids)``, reading ``ids`` from the end only as far
        as they reach (a long prompt is not walked whole for its last few tokens)."""
        if not self._skip_special:
            return list(ids[-count:])
        skipped = self._tokenizer.skipped_special_ids
        tail: list[int] = []
        for i in reversed(range(len(ids))):
            if len(tail) == count:
                break
            if ids[i] not in skipped:
                tail.append(ids[i])
        tail.reverse()
        return tail

    @property
    def _prefix_text(self) -> str:
        if self._prefix is None:
            self._prefix = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        return self._prefix

    def _decode(self, ids: Sequence[int]) -> str:
        if not self._tight:
            return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)
        added = self._tight
        cuts = [i for i in range(1, len(ids)) if ids[i] in added and ids[i - 1] in added]
        bounds = [0, *cuts, len(ids)]
        return "".join(self._tokenizer.decode(ids[a:b], skip_special_tokens=False)
                       for a, b in itertools.pairwise(bounds))

    def _new_text(self, *, flush: bool) -> str:
        """Text of the tokens after read_offset, or "" while it ends mid-character."""
        if self._read_offset == len(self._tokens):
            return ""
        full = self._decode(self._tokens[self._prefix_offset :])
        if not flush and (full.endswith(_REPLACEMENT_CHAR) or len(full) <= len(self._prefix_text)):
            return ""
        new = full[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self._prefix = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        self._compact()
        return new

    def _compact(self) -> None:
        if self._prefix_offset >= _COMPACT_AFTER:
            del self._tokens[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    # -- stop strings -------------------------------------------------------------------

    def _emit(self, new_text: str, *, final: bool, protected: bool = False) -> DetokenizerUpdate:
        """Send ``_held + new_text`` up to a stop string or a possible stop-string start.
        ``protected``: ``new_text`` comes from the first min_tokens outputs; no stop ends in it."""
        text = self._held + new_text
        self._held = ""
        # Leading characters of ``text`` in which no stop string may end.
        num_protected = len(text) if protected else self._protected
        match = None if protected else self._find_stop(text, num_protected)
        if match is not None:
            start, stop = match
            self._stop_reason = stop
            end = start + len(stop) if self._include_stop else start
            return self._stopped_update(text[:end])
        hold = 0 if final else self._held_tail_length(text)
        self._held = text[len(text) - hold :] if hold else ""
        sent = len(text) - hold
        if protected:  # the held tail, and text waiting for a character to complete
            self._protected = hold + len(self._unfinished_text())
        else:
            self._protected = max(0, num_protected - sent)
        return DetokenizerUpdate(text[:sent])

    def _unfinished_text(self) -> str:
        """The whole characters of tokens that ``_new_text`` holds back because their text
        ends mid-character; the next ``_new_text`` starts with them."""
        if self._read_offset == len(self._tokens):
            return ""
        full = self._decode(self._tokens[self._prefix_offset :])
        return full[len(self._prefix_text) :].rstrip(_REPLACEMENT_CHAR)

    def _find_stop(self, text: str, num_protected: int = 0) -> tuple[int, str] | None:
        """The stop string that completes first in ``text`` (longest on a tie), and where;
        only matches that end after the first ``num_protected`` characters count."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stop:
            start = text.find(stop, max(0, num_protected - len(stop) + 1))
            if start >= 0:
                candidate = (start + len(stop), start, stop)
                best = candidate if best is None or candidate[:2] < best[:2] else best
        return None if best is None else (best[1], best[2])

    def _held_tail_length(self, text: str) -> int:
        """Length of the longest tail of ``text`` that a stop string starts with.

        Memory stays linear in the stop strings (storing every prefix of each one cost
        ~800 MB for one 40,000-character stop string): a held tail starts with its stop's
        first character, so only those positions in the last ``len(stop) - 1`` characters
        are tried, leftmost (longest) first.
        """
        best = 0
        for stop in self._stop:
            i = text.find(stop[0], max(0, len(text) - len(stop) + 1))
            while i != -1 and len(text) - i > best:
                if stop.startswith(text[i:]):
                    best = len(text) - i
                    break
                i = text.find(stop[0], i + 1)
        return best

    def _stopped_update(self, text: str) -> DetokenizerUpdate:
        return DetokenizerUpdate(text, stopped=True, stop_reason=self._stop_reason)
