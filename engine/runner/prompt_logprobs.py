"""Prompt logprobs: what a ``prompt_logprobs`` request's chunks score of its prompt.

Position ``p`` of a chunk scores prompt token ``p + 1``: the raw log-softmax of the logits
there (no sampling adjustment), the token's rank and the top-N alternatives. A request
reports each prompt token once (``RequestState.prompt_logprobs_next``), even when a chunk is
recomputed after preemption.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.messages import PromptLogprobs, ScheduledChunk, TokenLogprob
from engine.runner.request_state import RequestState

# Hidden rows turned into full-vocabulary logits at once for prompt logprobs: 256 rows of
# a 150k vocabulary are 150 MB of fp32, the most one step should add for a rare request.
_PROMPT_LOGITS_ROWS = 256


def collect_prompt_logprobs(
    model: Any, hidden: torch.Tensor, chunks: Sequence[ScheduledChunk], states: Sequence[RequestState],
    device: torch.device,
) -> tuple[PromptLogprobs, ...]:
    """What each ``prompt_logprobs`` request's chunk scores: the raw log-softmax of the
    logits at its positions, at the next prompt token and for the top-N."""
    out = []
    row = 0
    for chunk, state in zip(chunks, states, strict=True):
        top_n = state.params.prompt_logprobs
        if top_n is not None and state.prompt_logprobs_next < len(state.prompt):
            first, end, rows = _prompt_logprob_rows(chunk, state, row)
            if rows:
                entries = _score(model, hidden, rows, state.prompt[first:end], top_n, device)
                out.append(PromptLogprobs(chunk.sample_id, first, entries))
                state.prompt_logprobs_next = end
        row += chunk.num_tokens
    return tuple(out)


def _score(
    model: Any, hidden: torch.Tensor, rows: list[int], targets: Sequence[int], top_n: int,
    device: torch.device,
) -> tuple[TokenLogprob, ...]:
    entries: list[TokenLogprob] = []
    for at in range(0, len(rows), _PROMPT_LOGITS_ROWS):
        index = torch.tensor(rows[at : at + _PROMPT_LOGITS_ROWS], device=device)
        logprobs = torch.log_softmax(model.compute_logits(hidden.index_select(0, index)), -1)
        want = torch.tensor(targets[at : at + _PROMPT_LOGITS_ROWS], device=device)
        chosen_t = logprobs.gather(1, want.unsqueeze(1))
        # 1 + how many tokens are more likely (ties share the better rank).
        ranks = ((logprobs > chosen_t).sum(-1) + 1).tolist()
        chosen = chosen_t.squeeze(1).tolist()
        if top_n:
            values, ids = logprobs.topk(top_n, dim=-1)
            tops = [tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
        else:
            tops = [()] * len(chosen)
        entries.extend(
            TokenLogprob(t, lp, top, rank)
            for t, lp, top, rank in zip(targets[at : at + _PROMPT_LOGITS_ROWS], chosen, tops,
                                        ranks, strict=True)
        )
    return tuple(entries)


def _prompt_logprob_rows(
    chunk: ScheduledChunk, state: RequestState, row: int
) -> tuple[int, int, list[int]]:
    """``(first, end, rows)``: the prompt tokens ``first .. end - 1`` this chunk scores and
    the hidden rows whose logits score them (position ``p`` scores prompt token ``p + 1``)."""
    first = max(state.prompt_logprobs_next, chunk.start + 1)
    end = min(chunk.start + chunk.num_tokens + 1, len(state.prompt))
    return first, end, [row + t - 1 - chunk.start for t in range(first, end)]
