"""Every message exchanged between actors: frozen, slotted dataclasses, one per event.

Closing a channel means end of stream; no message stands for "nothing". Every message is
made of primitives, tuples and other messages so it can be packed with msgpack (see
:func:`pack` / :func:`unpack`) and an actor can later move to another process.
"""

from __future__ import annotations

import dataclasses

from engine.params import SamplingParams

# --- scheduler -> executor -> model runner ------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class NewRequest:
    """A request the model runner has not seen: it keeps its tokens and sampling state."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]  # for min_tokens: EOS is masked until min_tokens is reached


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Compute ``num_tokens`` tokens of one request, starting at position ``start``.

    The runner reads the tokens from its own copy of the request (prompt plus the outputs
    it sampled), so a chunk can be planned before the previous step's token is known
    (async scheduling). ``block_ids`` is the request's whole block table. ``sample`` is true
    when the chunk reaches the end of the known tokens and a new token must be drawn.
    """

    request_id: str
    start: int
    num_tokens: int
    block_ids: tuple[int, ...]
    sample: bool


@dataclasses.dataclass(frozen=True, slots=True)
class StepPlan:
    """One engine step: what the runner must learn, compute and forget."""

    step_id: int
    new_requests: tuple[NewRequest, ...]
    chunks: tuple[ScheduledChunk, ...]
    finished_ids: tuple[str, ...]  # runner state to drop before running the chunks


@dataclasses.dataclass(frozen=True, slots=True)
class SampledToken:
    """The token drawn for one request in one step, with its logprobs when asked."""

    request_id: str
    token_id: int
    logprob: float
    # (token_id, logprob) of the top-N tokens when the request asked for logprobs=N.
    top_logprobs: tuple[tuple[int, float], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    step_id: int
    sampled: tuple[SampledToken, ...]
    forward_seconds: float  # model forward + sampling, for the per-step overhead figure
