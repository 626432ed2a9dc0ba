"""The sampling half of a step: from the forward's hidden states to each request's new tokens.

For each chunk that samples, :class:`Verifier` computes the logits of its rows, fills the
structured-output and thinking-budget masks, has the :class:`~engine.runner.sampler.Sampler`
draw every row, and keeps the tokens: one for a plain chunk, or for a chunk with a
speculative proposal the draws up to the first that differs from it (a draft model's
sampled proposal by the accept/resample rule instead). The kept tokens are appended to the
requests' states.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from engine.errors import EngineError
from engine.messages import RequestFailure, SampledToken, ScheduledChunk
from engine.params import thinking_forced_token
from engine.runner.draft import DraftModel, Proposal
from engine.runner.request_state import RequestState, StepPlanError
from engine.runner.sampler import Sampler, SamplingFailure, SamplingRow, TokenBitmask
from engine.structured import GrammarBackend, Matcher, bitmask_words


class Verifier:
    """Samples a step's rows and verifies its proposals, for one :class:`ModelRunner`.

    ``model`` gives the logits (``compute_logits``); ``grammar`` compiles structured-output
    specs and makes matchers (None: such requests fail); ``drafter`` is the draft model
    whose sampled proposals take the accept/resample rule. Runs in the runner's thread.
    """

    def __init__(
        self, model: Any, sampler: Sampler, *, device: torch.device, vocab_size: int, max_num_seqs: int,
        grammar: GrammarBackend | None, drafter: DraftModel | None,
    ) -> None:
        self.model = model
        self.sampler = sampler
        self.device = device
        self.grammar = grammar
        self.drafter = drafter
        # One row per sequence a step can hold, filled only for the constrained rows; reused
        # every step (int32, on the CPU where the grammar libraries write it). Speculative
        # verification samples several rows of a request: it grows to the widest step's rows.
        self._bitmask = torch.zeros((max_num_seqs, bitmask_words(vocab_size)), dtype=torch.int32)
        # Time spent filling bitmasks and rows filled (the benchmark's per-token mask cost).
        self.mask_fill_seconds = 0.0
        self.mask_rows = 0

    def sample(
        self,
        hidden: torch.Tensor,
        chunks: Sequence[ScheduledChunk],
        states: Sequence[RequestState],
        sample_rows: list[int],
        drafted: dict[str, Proposal] | None = None,
    ) -> tuple[tuple[SampledToken, ...], tuple[RequestFailure, ...]]:
        """One token per sampling chunk, or, for a chunk with a proposal, the verification.

        Speculative verification: row ``j`` of a proposal ``d`` (k tokens) holds the
        logits after the known tokens and ``d[:j]``; it is sampled exactly as a decode step
        with those outputs would be (penalties, min_tokens and the seed's step counted
        with ``d[:j]``). The proposal is kept while each draw equals it: the tokens are the
        draws ``t_0 .. t_m`` where ``m`` is the first ``j`` with ``t_j != d[j]`` (or k).
        Each kept draw comes from the target's distribution given the verified tokens
        before it, so the output is distributed as without speculation (for a point-mass
        proposal this is the accept/resample rule: accept ``d[j]`` with probability
        ``p(d[j])``, else draw from ``p`` without ``d[j]``, renormalised).

        A draft model's proposal for a sampled request (``drafted``: its tokens and the
        distributions ``q`` they were drawn from) replaces the draws of its rows ``0 .. k-1``
        by the general rule (:func:`engine.runner.draft.accept_or_resample`): keep ``d[j]``
        with probability ``min(1, p/q)``, else draw from ``normalize(max(p - q, 0))``; row
        ``k`` is the plain draw (a structured-output request's proposal is verified as a
        point mass: its draws are masked, the draft's were not). Everything else (rows, penalties, logprobs, the keeping
        loop) is the shared path above."""
        picked = [(c, s) for c, s in zip(chunks, states, strict=True) if c.sample]
        # Under a grammar only the proposal's prefix the grammar takes is verified (the rows
        # after it are not sampled); each verified row is masked with the grammar's state
        # after the proposal tokens before it.
        proposals = [self._grammar_proposal(c, s) for c, s in picked]
        # One entry per sampled row: its chunk, state and place in the chunk's proposal.
        expanded = [(c, s, d, j) for (c, s), d in zip(picked, proposals, strict=True) for j in range(len(d) + 1)]
        kept_rows: list[int] = []
        at = 0
        for c, d in zip((c for c, _ in picked), proposals, strict=True):
            kept_rows.extend(sample_rows[at : at + len(d) + 1])
            at += len(c.draft_token_ids) + 1
        # The grammar masks are filled before the logits are computed: on a GPU the host
        # fills them while the device still runs the forward.
        bitmask, failed = self._fill_bitmask([(c, s, d[:j]) for c, s, d, j in expanded])
        if kept_rows == list(range(hidden.shape[0])):  # every row, in order (a decode step)
            logits = self.model.compute_logits(hidden)
        else:
            logits = self.model.compute_logits(hidden.index_select(0, torch.tensor(kept_rows, device=self.device)))
        sampling_rows = [
            SamplingRow(s.params, s.prompt, s.outputs if not j else [*s.outputs, *d[:j]], s.eos_token_ids,
                        c.sample_id)
            for c, s, d, j in expanded
        ]
        drawn_rows = self.sampler(logits, sampling_rows, bitmask)
        if drafted:
            self._apply_rejection_rule(logits, sampling_rows, picked, proposals, drawn_rows, drafted)
        out = []
        gone = {f.sample_id for f in failed}
        at = 0
        for (c, s), d in zip(picked, proposals, strict=True):
            k = len(d)
            draws, at = drawn_rows[at : at + k + 1], at + k + 1
            if c.sample_id in gone:
                continue
            kept: list[SampledToken] = []
            for j, drawn in enumerate(draws):
                if isinstance(drawn, SamplingFailure):
                    why = _dead_end(s) if j == 0 else None  # the matcher is at row 0
                    failed.append(RequestFailure(c.sample_id, why or drawn.reason))
                    kept = []
                    break
                token, logprob, top = drawn
                if s.matcher is not None and not s.matcher.ended and not s.matcher.accept(token):
                    # The mask allowed only tokens the grammar takes; this is a backend fault.
                    failed.append(RequestFailure(
                        c.sample_id, "the sampled token does not fit the structured output grammar"))
                    kept = []
                    break
                kept.append(SampledToken(c.sample_id, token, logprob, tuple(top)))
                if j == k or token != d[j]:
                    break  # the model's own token ends the step's output
            for t in kept:
                s.outputs.append(t.token_id)
                s.tokens.append(t.token_id)
            out.extend(kept)
        return tuple(out), tuple(failed)

    def _grammar_proposal(self, chunk: ScheduledChunk, state: RequestState) -> tuple[int, ...]:
        """The part of ``chunk``'s proposal to verify: all of it, or under a grammar the
        prefix the grammar takes (none if the matcher cannot be had; ``_fill_bitmask``
        reports why)."""
        d = chunk.draft_token_ids
        if not d or state.params.structured_outputs is None:
            return d
        try:
            matcher = self._matcher(state)
        except (EngineError, ValueError):
            return ()
        return () if matcher.ended else d[: matcher.valid_prefix(d)]

    def _apply_rejection_rule(
        self, logits: torch.Tensor, sampling_rows: list[SamplingRow],
        picked: Sequence[tuple[ScheduledChunk, RequestState]], verified: Sequence[tuple[int, ...]],
        drawn_rows: list[Any], drafted: dict[str, Proposal],
    ) -> None:
        """Replace, in ``drawn_rows``, the draws of the proposal rows of each chunk with a
        sampled draft model's proposal by the accept/resample rule's tokens (logprobs from
        the same adjusted logits as the draws'; top-N alternatives unchanged)."""
        assert self.drafter is not None
        at = 0
        for (c, s), d in zip(picked, verified, strict=True):
            k = len(d)  # the rows sampled: the whole proposal but under a grammar
            proposal = drafted.get(c.sample_id)
            if proposal is not None and k == len(proposal.token_ids) and not any(
                    isinstance(d, SamplingFailure) for d in drawn_rows[at : at + k]):
                index = torch.arange(at, at + k, device=logits.device)
                adjusted, p = self.sampler.distributions(
                    logits.index_select(0, index), sampling_rows[at : at + k])
                for j, (token, logprob) in enumerate(self.drafter.verify(proposal, p, adjusted, s)):
                    drawn_rows[at + j] = (token, logprob, drawn_rows[at + j][2])
            at += k + 1

    def _fill_bitmask(
        self, picked: Sequence[tuple[ScheduledChunk, RequestState, tuple[int, ...]]]
    ) -> tuple[TokenBitmask | None, list[RequestFailure]]:
        """The token bitmask of the step's constrained rows (row ``i`` of the mask for
        batch row ``rows[i]``), and the requests whose grammar could not be set up.

        Each row comes with the proposal tokens before it (speculative verification): a
        constrained row is masked with the grammar's state after them (the matcher
        advances over them and is rolled back after the request's last row; they are
        accepted for real only once drawn). A row whose thinking budget is spent allows
        only the next token of the reasoning's end marker (ahead of any grammar: the
        grammar takes the marker where reasoning may end). A matcher that already ended
        (it accepted EOS; with async scheduling the step after may still be planned) gets
        no mask: its token is dropped by the scheduler."""
        constrained: list[int] = []
        failed: list[RequestFailure] = []
        if len(picked) > len(self._bitmask):
            self._bitmask = torch.zeros((len(picked), self._bitmask.shape[1]), dtype=torch.int32)
        t0 = time.perf_counter()
        for b, (c, s, before) in enumerate(picked):
            if s.params.thinking_token_budget is not None:
                # (Such a request carries no proposal: one row, after its outputs.)
                forced = thinking_forced_token(s.params, s.outputs)
                if forced is not None:
                    _allow_only(self._bitmask[len(constrained)], forced)
                    constrained.append(b)
                    continue
            if s.params.structured_outputs is None:
                continue
            if before:  # the request's earlier rows advanced its matcher over before[:-1]
                matcher = s.matcher
                if matcher is None or not matcher.accept(before[-1]):  # _grammar_proposal checked it
                    raise StepPlanError("a proposal token the grammar took is refused")
            else:
                try:
                    matcher = self._matcher(s)
                except (EngineError, ValueError) as exc:
                    failed.append(RequestFailure(c.sample_id, f"structured output: {exc}"))
                    continue  # (_grammar_proposal gave it no proposal: one row)
            last = b + 1 == len(picked) or picked[b + 1][0] is not c
            if not matcher.ended:
                matcher.fill(self._bitmask, len(constrained))
                constrained.append(b)
            if last:
                matcher.rollback(len(before))
        if not constrained:
            return None, failed
        self.mask_fill_seconds += time.perf_counter() - t0
        self.mask_rows += len(constrained)
        return TokenBitmask(self._bitmask[: len(constrained)], tuple(constrained)), failed

    def _matcher(self, state: RequestState) -> Matcher:
        """The request's matcher, made on first use and fed the outputs it already has
        (none for a new request; all of them should one ever be rebuilt, e.g. after its
        state was recreated for a recompute)."""
        held = state.matcher
        if held is not None and (held.ended or held.accepted == len(state.outputs)):
            return held
        spec = state.params.structured_outputs
        if self.grammar is None or spec is None:
            raise StepPlanError("a structured-output request reached a runner without a "
                                "grammar backend")
        matcher = self.grammar.matcher(spec)
        for token in state.outputs:
            if matcher.ended:
                break  # tokens after EOS were planned ahead and are dropped
            if not matcher.accept(token):
                raise StepPlanError("the request's tokens do not fit its grammar")
        state.matcher = matcher
        return matcher


def _dead_end(state: RequestState) -> str | None:
    """Why a constrained sample has nothing to sample, when its grammar is the cause: the
    output is complete (only EOS may follow) while min_tokens still forbids EOS. Admission
    refuses this where it can know it (a bounded regex or choice); a JSON schema's length
    is found out here."""
    matcher = state.matcher
    wanted = state.params.min_tokens
    if matcher is None or len(state.outputs) >= wanted or not matcher.complete():
        return None
    return (f"structured output: the constrained output is complete after "
            f"{len(state.outputs)} tokens and can only end there, but min_tokens asks for "
            f"{wanted}; no token can be sampled")


def _allow_only(row: torch.Tensor, token_id: int) -> None:
    """Make one bitmask row allow ``token_id`` alone (xgrammar's layout: bit ``t % 32`` of
    int32 word ``t // 32`` set means allowed)."""
    row.zero_()
    bit = token_id % 32
    # Bit 31 is the int32 sign bit.
    row[token_id // 32] = -(1 << 31) if bit == 31 else 1 << bit
