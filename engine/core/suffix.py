"""Suffix decoding (vLLM's ``--speculative-config`` method ``suffix``, after Arctic
Inference's SuffixDecoding): proposals drawn from what was generated before.

Two corpora are searched for the end of a request's context (its prompt and outputs):
the context itself (vLLM's prompt tree, with the request's own answer so far; the
context's own end is not an occurrence), and the answers of the requests that finished
before it (vLLM's global tree; the last ``max_cached_requests``, first in first out).

In each, for every match length ``m`` (a suffix of the context of ``m`` tokens, at most
``max_depth - 1`` and fewer than the context's) the occurrences of that suffix are the
node a suffix tree would reach. A proposal walks on from them, each time to the next
token most of the occurrences still walking go on with, while the product of those shares
(the path's estimated probability; an occurrence with nothing after it counts in the
share, as a path ending in a tree node does) stays at least ``min_token_prob``; it is at
most ``min(num_speculative_tokens, max_spec_factor * m, max_depth - m)`` tokens long. The
proposal worth the most (the sum of its tokens' probabilities: the tokens expected to be
accepted) is taken over every ``m`` and both corpora, a longer match and then the
request's own context winning ties, as Arctic's ``speculate`` picks. The output is the
model's either way: the runner verifies every proposal.

The answers are found through an index of their token pairs (the latest
``OCCURRENCES_KEPT`` occurrences of each pair), so a match is at least two tokens long
there; within the request's own context every position is looked at. Where vLLM also
puts the answers of requests still running in its global tree, this one keeps an answer
once its request has finished.
"""

from __future__ import annotations

import array
import collections
from collections.abc import Sequence

import numpy as np

_SHIFT = 32  # an index entry: answer id << _SHIFT | position in the answer
_POSITION = (1 << _SHIFT) - 1

# The occurrences of a token pair kept in the answers' index (the latest ones): a common
# pair is seen often enough that older occurrences add little to the counts, and each
# proposal looks at every one kept.
OCCURRENCES_KEPT = 64


class SuffixCache:
    """The answers of finished requests and the proposals drawn from them."""

    def __init__(self, max_depth: int, max_cached_requests: int, max_spec_factor: float,
                 min_token_prob: float) -> None:
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        # Answers as arrays of 64-bit ids (a third of a tuple's memory); the index's entries
        # are single ints, answer id and position packed (``_SHIFT``).
        self._answers: collections.OrderedDict[int, array.array[int]] = collections.OrderedDict()
        self._next_id = 0
        self._evicted = 0  # answers dropped since the index was last pruned
        # The pair (a, b) as a << _SHIFT | b -> its occurrences, each answer id << _SHIFT |
        # index of the token after the pair: one int while there is one (most pairs of a
        # large vocabulary occur once: a list each would cost ten times the memory), then a
        # list of the latest OCCURRENCES_KEPT.
        self._pairs: dict[int, int | list[int]] = {}

    def __len__(self) -> int:
        return len(self._answers)

    def add_answer(self, tokens: Sequence[int]) -> None:
        """Keep a finished request's output tokens (the oldest kept one goes past
        ``max_cached_requests``)."""
        if not self.max_cached_requests or len(tokens) < 3:
            return
        answer_id = self._next_id
        self._next_id += 1
        tokens = self._answers[answer_id] = array.array("q", tokens)
        # The pair before each position i; at the answer's end (i == len) nothing follows,
        # and the occurrence still counts, as a path ending in a suffix tree's node does.
        pairs, base = self._pairs, answer_id << _SHIFT
        for i in range(2, len(tokens) + 1):
            pair = tokens[i - 2] << _SHIFT | tokens[i - 1]
            slot = pairs.get(pair)
            if slot is None:
                pairs[pair] = base | i
            elif isinstance(slot, int):
                pairs[pair] = [slot, base | i]
            else:
                slot.append(base | i)
                if len(slot) > 2 * OCCURRENCES_KEPT:
                    del slot[:-OCCURRENCES_KEPT]
        while len(self._answers) > self.max_cached_requests:
            self._answers.popitem(last=False)  # its index entries are skipped until pruned
            self._evicted += 1
        if self._evicted >= max(64, self.max_cached_requests):
            self._prune()

    def propose(self, context: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to ``k`` tokens to verify after ``context`` (empty: none worth it)."""
        if k < 1 or len(context) < 2:
            return ()
        ctx = np.asarray(context, dtype=np.int64)
        own = self._best(_own_occurrences(ctx, context, self.max_depth - 1), k, 1)
        if not self._answers:
            return own[0]
        other = self._best(self._answer_occurrences(ctx), k, 2)
        return own[0] if own[1] >= other[1] else other[0]

    # -- matching --------------------------------------------------------------------------

    def _answer_occurrences(self, ctx: np.ndarray) -> list[tuple[Sequence[int], int, int]]:
        """The answers' occurrences of the context's last two tokens, each as (answer,
        index after it, how far back it matches the context: 2 or more)."""
        slot = self._pairs.get(int(ctx[-2]) << _SHIFT | int(ctx[-1]))
        if slot is None:
            return []
        slot = [slot] if isinstance(slot, int) else slot[-OCCURRENCES_KEPT:]
        limit = min(self.max_depth - 1, len(ctx) - 1)
        if limit < 2:
            return []
        tail = ctx[-limit - 1:].tolist()[::-1]  # the context backwards from its last token
        out = []
        for entry in slot:
            seq = self._answers.get(entry >> _SHIFT)
            pos = entry & _POSITION
            if seq is None:
                continue
            m, top = 2, min(limit, pos)
            while m < top and seq[pos - m - 1] == tail[m]:
                m += 1
            out.append((seq, pos, m))
        return out

    def _best(self, occurrences: list[tuple[Sequence[int], int, int]], k: int,
              low: int) -> tuple[tuple[int, ...], float]:
        """The best proposal over every match length (Arctic's rule): for a length ``m``
        the occurrences matching at least ``m`` tokens are walked, up to
        ``min(k, max_spec_factor * m, max_depth - m)`` tokens; the walk with the most
        tokens expected to be accepted wins, a longer match on a tie. The occurrences of
        one set are walked once, at the length of its range that allows the longest walk.
        ``low``: the shortest match the occurrences stand for."""
        best: tuple[tuple[int, ...], float] = ((), 0.0)
        if not occurrences:
            return best
        for top in sorted({m for _, _, m in occurrences}):
            # Match lengths low..top share one set: the occurrences matching top or more.
            live = [(seq, pos) for seq, pos, m in occurrences if m >= top]
            caps = [(min(k, int(self.max_spec_factor * m + 1e-6), self.max_depth - m), m)
                    for m in range(low, top + 1)]
            cap = max(caps)[0]
            walk = self._walk(live, cap)
            if walk[1] >= best[1]:
                best = walk
            low = top + 1
        return best

    def _walk(self, live: list[tuple[Sequence[int], int]], length: int) -> tuple[tuple[int, ...], float]:
        """From a match's occurrences (sequence, index after it): the path of the tokens most
        of them go on with, while its probability holds, and its worth (the sum of its
        tokens' probabilities: the tokens expected to be accepted)."""
        out: list[int] = []
        prob, expected = 1.0, 0.0
        while len(out) < length and live:
            counts: collections.Counter[int] = collections.Counter(
                seq[pos] for seq, pos in live if pos < len(seq))
            if not counts:
                break
            token, count = counts.most_common(1)[0]
            prob *= count / len(live)
            if prob < self.min_token_prob:
                break
            out.append(token)
            expected += prob
            live = [(seq, pos + 1) for seq, pos in live if pos < len(seq) and seq[pos] == token]
        return tuple(out), expected

    def _prune(self) -> None:
        """Drop the index entries of answers no longer kept (once as many were dropped as
        are kept, so the index stays within twice the answers' tokens)."""
        self._evicted = 0
        for pair, slot in list(self._pairs.items()):
            kept = [e for e in ([slot] if isinstance(slot, int) else slot) if e >> _SHIFT in self._answers]
            if not kept:
                del self._pairs[pair]
            else:
                self._pairs[pair] = kept[0] if len(kept) == 1 else kept[-OCCURRENCES_KEPT:]


def _own_occurrences(ctx: np.ndarray, seq: Sequence[int], limit: int) -> list[tuple[Sequence[int], int, int]]:
    """The earlier occurrences, in ``ctx`` itself, of its last token, each as (ctx, index
    after it, how far back it matches the context: at most ``limit`` tokens); ``seq`` is
    ``ctx`` as given. The context's own end is not one: nothing follows it."""
    n = len(ctx)
    ends = np.flatnonzero(ctx[: n - 1] == ctx[-1]) + 1  # e: ctx[e - 1] == ctx[-1], e <= n - 1
    if not ends.size:
        return []
    lengths = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for m in range(1, min(limit, n - 1)):
        idx = ends - m - 1
        ok = alive & (idx >= 0)
        ok[ok] = ctx[idx[ok]] == ctx[n - m - 1]
        if not ok.any():
            break
        lengths[ok] = m + 1
        alive = ok
    return [(seq, int(e), int(m)) for e, m in zip(ends, lengths, strict=True)]
