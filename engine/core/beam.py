"""Beam search's ranking: from each live beam's top logprobs to the next beams (pure).

The rules are transformers' ``_beam_search`` (5.x, ``generation/utils.py``), step for step,
so the same model gives the same beams in the same order:

* Each step, every live beam ``b`` with cumulative logprob ``s_b`` proposes its tokens
  ``t`` at ``s_b + logprob(t)`` (``log_softmax`` of the raw fp32 logits). The ``K =
  max(2, 1 + #eos) * W`` best proposals over all beams are the candidates, best first.
  EOS (and ``stop_token_ids``) are no candidates before ``min_tokens`` outputs.
* A candidate *hits* when its token ends a sequence (EOS, a stop token) or it reaches
  ``max_tokens``. The next beams are the ``W`` best candidates that do not hit.
* A hitting candidate among the ``W`` best becomes a finished hypothesis scored
  ``s / (generated_len ** length_penalty)`` (its ending token counted), unless the search
  already cannot improve, or ``early_stopping is True`` and ``W`` hypotheses are in. The
  ``W`` best hypotheses are kept.
* After the step the search stops when no live beam can beat the worst of ``W`` kept
  hypotheses (the best live score over the current generated length, or over
  ``max_tokens`` for ``early_stopping="never"`` with a positive penalty; once unable, it
  stays unable), when ``early_stopping is True`` and ``W`` are kept, or when every
  candidate hit. The answer is the kept hypotheses, best score first.

The first step has one live beam (the prompt): transformers' other initial beams carry
-1e9 and contribute no candidate while the vocabulary holds ``K`` tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class Hypothesis:
    """A finished beam: its generated tokens (the ending one included), the sum of their
    logprobs, and its length-penalised score."""

    token_ids: tuple[int, ...]
    cumulative_logprob: float
    score: float


@dataclasses.dataclass(frozen=True, slots=True)
class NextBeam:
    """A live beam of the next step: the beam it extends (its index this step), the token
    it appends, and its cumulative logprob."""

    parent: int
    token_id: int
    cumulative_logprob: float


class BeamSearch:
    """The state of one beam search between steps: live beams' scores, kept hypotheses."""

    def __init__(
        self, *, width: int, max_tokens: int, min_tokens: int = 0, length_penalty: float = 1.0,
        early_stopping: bool | str = False, end_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.width = width
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.end_token_ids = end_token_ids
        self.num_candidates = max(2, 1 + len(end_token_ids)) * width
        self.generated = 0  # tokens every live beam has
        self.live: list[tuple[tuple[int, ...], float]] = [((), 0.0)]  # (tokens, cumulative)
        self.kept: list[Hypothesis] = []  # best score first, at most width
        self.improvable = True
        self.done = False

    @property
    def logprobs_needed(self) -> int:
        """How many top logprobs each live beam must report: ``K`` after dropping the end
        tokens, which are no candidates before ``min_tokens``."""
        return self.num_candidates + len(self.end_token_ids)

    def step(self, tops: Sequence[Sequence[tuple[int, float]]]) -> list[NextBeam]:
        """Advance by one token given each live beam's top ``(token_id, logprob)`` pairs
        (best first, at least :attr:`logprobs_needed` of them or the whole vocabulary).
        Returns the next live beams; empty once the search is :attr:`done`."""
        if self.done or len(tops) != len(self.live):
            raise ValueError(f"{len(tops)} beams reported for {len(self.live)} live ones")
        masked = self.generated < self.min_tokens
        proposals: list[tuple[float, int, int]] = []
        for b, top in enumerate(tops):
            base = self.live[b][1]
            taken = [(t, lp) for t, lp in top if not (masked and t in self.end_token_ids)]
            proposals.extend((base + lp, b, t) for t, lp in taken[: self.num_candidates])
        # torch.topk's order over the flattened [beam, vocab] scores; ties (never seen with
        # real logits) go to the lower flat index.
        proposals.sort(key=lambda p: (-p[0], p[1], p[2]))
        candidates = proposals[: self.num_candidates]
        length = self.generated + 1
        hits = [t in self.end_token_ids or length >= self.max_tokens for _, _, t in candidates]
        self._keep_finished(candidates[: self.width], hits, length)
        nxt = [NextBeam(b, t, s) for (s, b, t), hit in zip(candidates, hits, strict=True) if not hit]
        nxt = nxt[: self.width]
        self.live = [(self.live[n.parent][0] + (n.token_id,), n.cumulative_logprob) for n in nxt]
        self.generated = length
        self._check_stop(all(hits), nxt)
        return [] if self.done else nxt

    def _keep_finished(self, top: list[tuple[float, int, int]], hits: list[bool], length: int) -> None:
        full = len(self.kept) == self.width
        if not self.improvable or (full and self.early_stopping is True):
            return
        new = [Hypothesis(self.live[b][0] + (t,), s, s / (length ** self.length_penalty))
               for (s, b, t), hit in zip(top, hits, strict=False) if hit]
        if new:
            # A stable sort: a new hypothesis tying a kept one ranks after it (the kept
            # ones come first in transformers' merged list).
            self.kept = sorted(self.kept + new, key=lambda h: -h.score)[: self.width]

    def _check_stop(self, all_hit: bool, nxt: list[NextBeam]) -> None:
        full = len(self.kept) == self.width
        if self.improvable and full and nxt:
            if self.early_stopping == "never" and self.length_penalty > 0.0:
                best_length = self.max_tokens
            else:
                best_length = self.generated
            best_possible = nxt[0].cumulative_logprob / (best_length ** self.length_penalty)
            self.improvable = best_possible > self.kept[-1].score
        self.done = (not self.improvable or (full and self.early_stopping is True) or all_hit
                     or not nxt)

    def best(self, n: int) -> list[Hypothesis]:
        """The ``n`` best kept hypotheses, best first."""
        return self.kept[:n]


class BeamGroup:
    """A beam search request's group, as the scheduler keeps it on the group's
    :class:`~engine.core.request.Request` (``req.beam``).

    Each live beam is a :class:`Request` of its own (``beams``): its own block table in the
    pool and its own runner state, under a key ``{group id}/b{generation}.{index}``. The
    group is what the queue holds and preempts: its beams are planned, preempted and freed
    together. ``tops`` collects this step's reports by beam index; once every live beam
    reported, :meth:`BeamSearch.step` ranks them and ``pending`` holds the next beams,
    forked from their parents at the next plan.
    """

    __slots__ = ("search", "beams", "tops", "pending", "output_ids", "generation", "forked",
                 "stop_token_ids")

    def __init__(self, search: BeamSearch, output_ids: tuple[str, ...],
                 stop_token_ids: tuple[int, ...]) -> None:
        self.search = search
        self.beams: list = []  # list[Request]; the scheduler builds them
        self.tops: dict[int, tuple[tuple[int, float], ...]] = {}
        self.pending: list[NextBeam] = []
        self.output_ids = output_ids
        self.generation = 0
        self.forked: set[str] = set()  # keys whose tables came from a fork (not cached)
        self.stop_token_ids = stop_token_ids

    def key(self, group_id: str, index: int) -> str:
        """A beam's key: distinct from every sample id (those end in ``#digits[.digits]``)."""
        return f"{group_id}/b{self.generation}.{index}"

    def collect(self, index: int, top: tuple[tuple[int, float], ...]) -> list[NextBeam] | None:
        """Record beam ``index``'s report; rank when every live beam reported. Returns the
        next beams (empty: the search is done), or None while reports are missing."""
        self.tops[index] = top
        if len(self.tops) < len(self.beams):
            return None
        tops = [self.tops[i] for i in range(len(self.beams))]
        self.tops = {}
        self.pending = self.search.step(tops)
        return self.pending

    def finish_reason(self, hyp: Hypothesis) -> tuple[str, int | None]:
        """``("stop", stop token or None for EOS)`` for a hypothesis its last token ended,
        else ``("length", None)``."""
        last = hyp.token_ids[-1] if hyp.token_ids else None
        if last is not None and last in self.search.end_token_ids:
            return "stop", last if last in self.stop_token_ids else None
        return "length", None
