"""Speculative decoding with a draft model (``--speculative-config`` method ``draft_model``).

A second, smaller model (or the same weights quantized) proposes ``k`` tokens for each
speculating request of a step; the target verifies them in its one forward of the step
(``Verifier.sample``, engine/runner/verify.py). The draft runs in the same worker thread, in the same
:meth:`ModelRunner.execute`, before the target.

The draft's KV cache mirrors the target's block tables: one cache of the same number of
blocks of the same size, indexed by the same block ids, so the scheduler, the allocator,
the prefix cache and preemption cover both with no bookkeeping of their own::

    target KV  [num_blocks][block_size] x target layers   block b holds positions ...
    draft KV   [num_blocks][block_size] x draft layers    ... of the same tokens

A block the prefix cache shares was computed by both models (the draft runs over every
chunk the target runs, prefill chunks included). The draft's KV may lag the target's by the
positions the target verified that the draft never ran: the last of a fully accepted
proposal (the draft computes ``d_k`` but never feeds it back) and a prediction's accepted
tokens. The next chunk of the request runs the draft over those positions first (its
"catch-up"), so a request's draft KV is whole before its next proposal. Rejected positions
of both caches lie past the verified count and are overwritten by the next step.

Per step, for the chunks of the plan:

1. one draft forward over every chunk's known tokens (plus any catch-up positions);
2. for each chunk with ``num_model_drafts = k``: ``d_1`` is drawn from the draft's
   distribution ``q_1`` at its last position, then ``k - 1`` batched one-token forwards draw
   ``d_2 .. d_k``. A greedy request's draft takes the arg-max (``q`` a point mass); any
   other draws from ``q`` after the request's own temperature, top-k/p, min-p, penalties
   and min_tokens (the Sampler's :meth:`~engine.runner.sampler.Sampler.distributions`), so
   ``q`` is close to the target's ``p`` and acceptance high. The draws are seeded from the
   request's seed where it has one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from engine.messages import ScheduledChunk
from engine.models.registry import build_model
from engine.ops import Ops
from engine.ops.sampling_ref import inverse_cdf, row_uniforms
from engine.runner.batch import build_batch
from engine.runner.kv_cache import allocate_kv_caches
from engine.runner.request_state import RequestState
from engine.runner.sampler import _GREEDY_TEMPERATURE, Sampler, SamplingRow, step_seed

# Distinct streams for the draft's draws and the verifier's accept/resample uniforms of a
# seeded request (its own sampler stream stays as without speculation). Arbitrary odd
# 64-bit constants; any fixed values that differ would do.
DRAFT_SALT = 0x5DEECE66D2B1A3F1
ACCEPT_SALT = 0x2545F4914F6CDD1D
RESIDUAL_SALT = 0x9E3779B97F4A7C55


@dataclasses.dataclass(frozen=True, slots=True)
class Proposal:
    """A draft model's proposal for one chunk: the tokens, and the distribution each was
    drawn from (``probs[j]`` for ``token_ids[j]``, ``[k, V]`` fp32), or ``None`` where each
    is the arg-max (a greedy request: ``q`` is a point mass)."""

    token_ids: tuple[int, ...]
    probs: torch.Tensor | None


class DraftModel:
    """The draft model, its KV cache and its per-request progress.

    ``loaded`` is the draft's :class:`engine.models.loader.LoadedModel`; ``num_blocks`` and
    ``block_size`` are the target's (the caches share the block tables). ``sampler`` is the
    target runner's (its :meth:`Sampler.distributions` turns logits into ``q``)."""

    def __init__(
        self, loaded: Any, *, device: torch.device, ops: Ops, num_blocks: int, block_size: int,
        kv_cache_dtype: str, sampler: Sampler, seed: int = 0,
    ) -> None:
        self.config = loaded.config
        self.device = device
        self.dtype = loaded.dtype
        self.block_size = block_size
        self._ops = ops
        self.model: Any = build_model(loaded.config, loaded.weights, ops, dtype=loaded.dtype, device=device)
        self.kv_caches = allocate_kv_caches(
            loaded.config, num_blocks, block_size, loaded.dtype, device, kv_cache_dtype=kv_cache_dtype)
        self._sampler = sampler
        # Unseeded requests' draft and verification uniforms.
        self._generator = torch.Generator().manual_seed(seed ^ (DRAFT_SALT >> 1))

    def rebuild(self, weights: Any) -> None:
        """Build the draft model again from ``weights`` (sleep mode's level 2 wake-up; the
        model was let go while it slept)."""
        self.model = build_model(self.config, weights, self._ops, dtype=self.dtype, device=self.device)

    def propose(
        self, chunks: Sequence[ScheduledChunk], states: Sequence[RequestState],
    ) -> list[Proposal | None]:
        """Run the draft over every chunk and propose for those with ``num_model_drafts``.

        ``states`` are the runner's request states (``tokens``, ``prompt``, ``outputs``,
        ``params``, ``eos_token_ids``, ``draft_end``, ``target_end``). Returns one entry
        per chunk, ``None`` where it proposes nothing."""
        spans = []
        for c, s in zip(chunks, states, strict=True):
            known_end = c.start + c.num_tokens - c.num_proposed
            # A continuation (the chunk starts where the target's verified tokens end) picks
            # up the positions the draft has not run; a new block table (after preemption,
            # maybe from the prefix cache) starts where the chunk does.
            first = s.draft_end if c.start == s.target_end and s.draft_end < c.start else c.start
            spans.append((first, s.tokens[first:known_end], c.block_ids))
        input_ids, positions, meta = build_batch(spans, self.block_size, self.device)
        hidden = self.model.forward(input_ids, positions, meta, self.kv_caches)
        speculating = [i for i, c in enumerate(chunks) if c.num_model_drafts]
        out: list[Proposal | None] = [None] * len(chunks)
        if not speculating:
            return out
        ends = torch.tensor([len(t) for _, t, _ in spans]).cumsum(0) - 1
        rows = ends[speculating].to(self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        drafts: dict[int, list[int]] = {i: [] for i in speculating}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in speculating}
        live = speculating
        while True:
            tokens, q = self._draw(logits, [states[i] for i in live], [drafts[i] for i in live])
            for b, i in enumerate(live):
                drafts[i].append(tokens[b])
                if q is not None:
                    probs[i].append(q[b])
            live = [i for i in live if len(drafts[i]) < chunks[i].num_model_drafts]
            if not live:
                break
            # One more token each: d_j at the position after the last one run.
            step_spans = []
            for i in live:
                c, j = chunks[i], len(drafts[i])
                pos = c.start + c.num_tokens - c.num_proposed - 1 + j
                step_spans.append((pos, [drafts[i][-1]], c.block_ids))
            input_ids, positions, meta = build_batch(step_spans, self.block_size, self.device)
            hidden = self.model.forward(input_ids, positions, meta, self.kv_caches)
            logits = self.model.compute_logits(hidden)
        for i in speculating:
            greedy = _is_greedy(states[i])
            out[i] = Proposal(tuple(drafts[i]), None if greedy else torch.stack(probs[i]))
        return out

    def _draw(
        self, logits: torch.Tensor, states: Sequence[RequestState], drafted: Sequence[list[int]]
    ) -> tuple[list[int], torch.Tensor | None]:
        """One draft token per row (its request's state, the tokens drafted so far), and the
        distributions drawn from (rows of greedy requests hold a one-hot)."""
        rows = [SamplingRow(s.params, s.prompt, [*s.outputs, *d], s.eos_token_ids)
                for s, d in zip(states, drafted, strict=True)]
        _, q = self._sampler.distributions(logits, rows)
        uniforms = torch.tensor([
            self._uniform(s, len(s.outputs) + len(d), DRAFT_SALT)
            for s, d in zip(states, drafted, strict=True)], dtype=torch.float64)
        # A one-hot row draws its arg-max whatever the uniform.
        tokens = inverse_cdf(q, uniforms).tolist()
        return tokens, q

    def _uniform(self, state: RequestState, index: int, salt: int) -> float:
        """A uniform in [0, 1) for output ``index`` of a request: from its seed and ``salt``
        when it has one, else from the draft's generator."""
        seed = state.params.seed
        if seed is None:
            return float(torch.rand((), generator=self._generator, dtype=torch.float64))
        return float(row_uniforms(torch.tensor([step_seed(seed ^ salt, index)]))[0])

    def verify(
        self, proposal: Proposal, p: torch.Tensor, adjusted: torch.Tensor, state: RequestState,
    ) -> list[tuple[int, float]]:
        """The accept/resample rule over a sampled proposal: ``p`` ([k, V]) the target's
        distributions at the proposal's rows, ``adjusted`` its logits for logprobs. Returns
        ``(token, logprob)`` for rows ``0 ..`` up to the first rejection (its resampled
        token), see :func:`accept_or_resample`."""
        assert proposal.probs is not None
        base = len(state.outputs)
        out = []
        logprobs = torch.log_softmax(adjusted, dim=-1)
        for j, d in enumerate(proposal.token_ids):
            u = self._uniform(state, base + j, ACCEPT_SALT)
            v = self._uniform(state, base + j, RESIDUAL_SALT)
            token = accept_or_resample(p[j], proposal.probs[j], d, u, v)
            out.append((token, float(logprobs[j, token])))
            if token != d:
                break
        return out


def track_draft(
    chunks: Sequence[ScheduledChunk], states: Sequence[RequestState], before: Sequence[int],
    model_drafted: set[str],
) -> None:
    """After a step: where each request's verified positions end for the target and for the
    draft. A proposal of ``k`` with ``m`` kept: the target verified the known tokens and
    ``m`` proposal tokens; the draft ran the known tokens and its own ``d_1 .. d_{k-1}``
    (none of a prediction's)."""
    for c, s, n in zip(chunks, states, before, strict=True):
        end = c.start + c.num_tokens
        k = c.num_proposed
        if not k:
            s.target_end = s.draft_end = end
            continue
        kept = len(s.outputs) - n
        if kept < 1:
            continue  # the request failed; its state is dropped
        known_end, m = end - k, kept - 1
        s.target_end = known_end + m
        s.draft_end = known_end + min(m, k - 1) if c.sample_id in model_drafted else known_end


def accept_or_resample(p: torch.Tensor, q: torch.Tensor, d: int, u: float, v: float) -> int:
    """One row of speculative sampling's rule: keep the proposed ``d`` (drawn from ``q``)
    when ``u < p(d) / q(d)``, else draw from ``normalize(max(p - q, 0))`` with uniform
    ``v``. The token is then distributed as ``p``: ``P(d) = q(d) min(1, p(d)/q(d)) +
    (1 - sum min(p, q)) r(d)`` and the second term makes up exactly ``p - min(p, q)``.

    A point-mass ``q`` (prompt lookup) is the case the runner takes a draw ``t ~ p`` for
    and keeps ``d`` when ``t == d``: the same distribution, and ``t`` is the token the
    request would have drawn without speculation."""
    pd, qd = float(p[d]), float(q[d])
    if u * qd < pd:
        return d
    residual = torch.clamp(p.double() - q.double(), min=0.0)
    if float(residual.sum()) <= 0.0:
        # p == q up to rounding: every d is accepted in exact arithmetic; draw from p.
        residual = p.double()
    return int(inverse_cdf(residual.unsqueeze(0), torch.tensor([v], dtype=torch.float64))[0])


def _is_greedy(state: RequestState) -> bool:
    return bool(state.params.temperature < _GREEDY_TEMPERATURE)
