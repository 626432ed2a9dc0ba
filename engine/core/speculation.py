"""The scheduler's speculative decoding bookkeeping: who gets a proposal, of what, and
how the verified tokens are checked and counted.

The proposals themselves come from :func:`engine.core.spec.propose` (prompt lookup, a
Predicted Outputs request's prediction) or from the runner's draft model; the runner
verifies them in the same forward as the request's next token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from engine.core.request import ProtocolError, Request, RequestStatus
from engine.core.scheduler_config import SchedulerConfig
from engine.core.spec import propose
from engine.core.suffix import SuffixCache
from engine.messages import SampledToken, ScheduledChunk


def speculates(config: SchedulerConfig, req: Request) -> bool:
    """Whether ``req`` gets proposals: prompt lookup is on or it has a prediction, and
    no thinking budget forces its tokens (the runner masks one row per request). Under
    a grammar the runner verifies the prefix of the proposal the grammar takes."""
    return bool(config.num_speculative_tokens or req.prediction) and (
        req.params.thinking_token_budget is None)


def choose_proposal(config: SchedulerConfig, req: Request, budget: int,
                    counters: SpecCounters | None = None) -> tuple[tuple[int, ...], int]:
    """The tokens to verify after ``req``'s next one this step, and how many: a decode
    step of a request whose every token is known (none in flight), with room left in
    ``max_tokens`` and the budget. With a draft model the runner proposes them in the
    step: ``((), k)``; with suffix decoding they come from ``counters.suffix``."""
    if req.prediction:
        k = config.num_prediction_tokens
    else:
        k = config.num_speculative_tokens
    k = min(k, req.max_tokens - req.num_sampled - 1, budget - 1)
    if (k < 1 or req.num_pending_tokens or req.num_known_tokens - req.num_computed_tokens != 1
            or not speculates(config, req)):
        return (), 0
    if req.prediction:
        drafts, start = propose(req.known_token_ids(), req.prediction, k, config.prompt_lookup_max,
                                config.prompt_lookup_min, after=req.prediction_pos)
        if start >= 0:
            req.prediction_pos = start
        return drafts, len(drafts)
    if config.draft_model:
        return (), k
    if counters is not None and counters.suffix is not None:
        drafts = counters.suffix.propose(req.known_token_ids(), k)
        return drafts, len(drafts)
    drafts = propose(req.known_token_ids(), None, k, config.prompt_lookup_max,
                     config.prompt_lookup_min)[0]
    return drafts, len(drafts)


def accepted_count(req: Request, chunk: ScheduledChunk, tokens: Sequence[SampledToken]) -> int:
    """How many proposal tokens a speculative step's result accepted: all its tokens but
    the model's own last one. Raises :class:`ProtocolError` when they do not follow the
    proposal."""
    drafts = chunk.draft_token_ids  # empty for a draft model's proposal (never sent back)
    accepted = len(tokens) - 1
    if not 0 <= accepted <= chunk.num_proposed or any(
            t.token_id != d for t, d in zip(tokens[:-1], drafts, strict=False)):
        raise ProtocolError(f"tokens {[t.token_id for t in tokens]} do not follow the "
                            f"proposal {drafts or chunk.num_proposed} of {req.sample_id!r}")
    return accepted


@dataclasses.dataclass(slots=True)
class SpecCounters:
    """Cumulative counters (vLLM's spec_decode ones): verification steps of requests with
    a proposal, tokens proposed, tokens accepted, and accepted tokens by their place in
    the proposal."""

    per_pos: list[int]
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    # Suffix decoding's answers of finished requests (None: another method, or none).
    suffix: SuffixCache | None = None

    @classmethod
    def for_config(cls, config: SchedulerConfig) -> SpecCounters:
        suffix = None if config.suffix_decoding is None else SuffixCache(*config.suffix_decoding)
        return cls([0] * max(config.num_speculative_tokens, config.num_prediction_tokens), suffix=suffix)

    def finished(self, req: Request) -> None:
        """A request ended: suffix decoding keeps its answer."""
        if self.suffix is not None and req.beam is None and req.output_token_ids:
            self.suffix.add_answer(req.output_token_ids)

    def record(self, req: Request, proposed: int, accepted: int) -> None:
        """Count one verification step of ``req`` (its own counters too)."""
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted += accepted
        for i in range(accepted):
            self.per_pos[i] += 1
        req.num_draft_tokens += proposed
        req.num_accepted_tokens += accepted


def prediction_usage(req: Request, status: RequestStatus | None) -> tuple[int, int] | None:
    """``(accepted, rejected)`` prediction tokens, on a Predicted Outputs request's last delta."""
    if status is None or not req.prediction:
        return None
    return req.num_accepted_tokens, req.num_draft_tokens - req.num_accepted_tokens
