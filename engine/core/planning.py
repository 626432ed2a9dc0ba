"""One step's plan as the scheduler builds it, and the steps that plan one request's chunk.

A chunk is planned in this order: give back the blocks out of the sliding window
(:func:`release_out_of_window`), take the slots the request's table already holds
(:func:`fits_table`) or ask the allocator for more (:func:`allocate_call`), then record
the chunk the reply allows (:func:`add_chunk`). Which requests get a chunk, and who is
preempted when the allocator refuses, is the scheduler's (``engine.core.scheduler``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from typing import Any

from engine.core.encoder_budget import EncoderBudget
from engine.core.request import ProtocolError, Request
from engine.messages import (
    NULL_BLOCK,
    AllocateSlots,
    AllocatorCall,
    AllocatorReply,
    BlocksReleased,
    NewRequest,
    ReleaseBlocks,
    ScheduledChunk,
    SlotsAllocated,
    StepPlan,
)


@dataclasses.dataclass(slots=True)
class StepDraft:
    """A plan being built: what is left of the token budget, and the images' encoder
    budget."""

    step_id: int
    budget: int
    encoder: EncoderBudget
    new_requests: list[NewRequest] = dataclasses.field(default_factory=list)
    chunks: list[ScheduledChunk] = dataclasses.field(default_factory=list)
    epochs: dict[str, int] = dataclasses.field(default_factory=dict)
    block_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    kv_loads: list[tuple[int, Any]] = dataclasses.field(default_factory=list)
    kv_saves: list[tuple[str, int, bytes]] = dataclasses.field(default_factory=list)

    def plan(self, finished_ids: list[str], preempted_ids: list[str]) -> StepPlan:
        return StepPlan(self.step_id, tuple(self.new_requests), tuple(self.chunks),
                        tuple(finished_ids), tuple(self.block_copies), tuple(preempted_ids),
                        tuple(self.kv_loads), tuple(self.kv_saves))


def release_out_of_window(
    req: Request, window: int, block_size: int
) -> Generator[AllocatorCall, AllocatorReply, None]:
    """Give back the blocks no layer will read again. The next chunk's first query sits
    at ``num_computed_tokens`` and sees keys from ``num_computed_tokens - window + 1``
    on; later queries see later keys. Chunks planned earlier and still in flight run
    before any step that could reuse a released block, so they still read it intact."""
    if not window:
        return
    first_seen = max(0, req.num_computed_tokens - window + 1)
    releasable = min(first_seen // block_size, len(req.block_ids))
    if releasable <= req.num_released_blocks:
        return
    reply = yield ReleaseBlocks(req.sample_id, releasable)
    if not isinstance(reply, BlocksReleased) or reply.num_released_blocks != releasable:
        raise ProtocolError(f"expected {releasable} blocks of {req.sample_id!r} released, got {reply!r}")
    for i in range(req.num_released_blocks, releasable):
        req.block_ids[i] = NULL_BLOCK
    req.num_released_blocks = releasable


def fits_table(req: Request, budget: int, n_drafts: int, block_size: int,
               state_checkpoints: bool = False) -> SlotsAllocated | None:
    """The chunk when the request's blocks already hold it (most decode steps): no
    allocator round trip; ``None`` when blocks must be allocated, or (``state_checkpoints``)
    when the chunk crosses a block boundary, where the pool keeps the states."""
    count = min(req.num_known_tokens + n_drafts - req.num_computed_tokens, budget)
    end = req.num_computed_tokens + count
    if end > len(req.block_ids) * block_size:
        return None
    if state_checkpoints and end // block_size * block_size > req.num_computed_tokens:
        return None
    return SlotsAllocated(req.sample_id, 0, count, ())


def prefill_cap(req: Request, budget: int, threshold: int) -> int:
    """What of ``budget`` ``req``'s chunk may take: at most ``threshold`` tokens (vLLM's
    ``long_prefill_token_threshold``; 0: all) where it has more than that to compute (a
    prefill; a decode, a speculative step's few tokens, are never cut)."""
    if threshold and req.num_known_tokens - req.num_computed_tokens > threshold:
        return min(budget, threshold)
    return budget


def allocate_call(req: Request, budget: int, *, lookup: bool, n_drafts: int = 0,
                  external: tuple[int, int] = (0, 0)) -> AllocateSlots:
    """Ask for the slots of ``req``'s next chunk (and ``n_drafts`` proposal positions); a
    first table looks its known tokens up in the prefix cache when ``lookup``, and may
    take the ``external`` blocks it read from the KV store (engine.core.kv_tier)."""
    first = not req.block_ids
    return AllocateSlots(
        req.sample_id,
        req.num_computed_tokens,
        req.num_known_tokens + n_drafts,
        budget,
        req.known_token_ids() if lookup and first else (),
        req.cache_salt if first else None,
        req.num_computed_tokens >= req.num_prompt_tokens,
        external if first else (0, 0),
    )


def add_chunk(
    step: StepDraft, req: Request, reply: AllocatorReply, drafts: tuple[int, ...], n_drafts: int,
    block_size: int,
) -> None:
    """Plan ``req``'s chunk: ``n_drafts`` positions past its known tokens verify a
    proposal, ``drafts`` (from prompt lookup or a prediction) or, where that is empty,
    the runner's draft model's."""
    got = _take_slots(req, reply, block_size)
    count = got.num_new_tokens
    start = req.num_computed_tokens  # past the cached prefix of a new table
    known = req.num_known_tokens + n_drafts
    if not 0 < count <= step.budget or start + count > known:
        raise ProtocolError(f"{reply!r} does not fit {req!r} with budget {step.budget}")
    if req.images:
        # A new request's start is known only now (its prefix-cache hit): the blocks of
        # tokens cut here stay in its table for its next chunk.
        count = step.encoder.cut(req, start, count, commit=True)
        if count == 0:
            return
    sample = start + count == known
    if n_drafts and not sample:
        raise ProtocolError(f"{reply!r} cuts the proposal of {req!r}")
    req.draft_token_ids = drafts
    model_drafts = 0 if drafts else n_drafts
    req.num_model_drafts = model_drafts
    if any(offset > count for offset, _ in got.state_save):
        raise ProtocolError(f"{got!r}: the state checkpoint lies past the chunk of {count}")
    step.chunks.append(ScheduledChunk(req.sample_id, start, count, tuple(req.block_ids), sample,
                                      drafts, model_drafts, got.state_load, got.state_save))
    step.epochs[req.sample_id] = req.num_preemptions
    step.budget -= count
    req.num_computed_tokens += count
    req.last_chunk_end = req.num_computed_tokens
    if sample:
        req.num_pending_tokens += 1


def _take_slots(req: Request, reply: AllocatorReply, block_size: int) -> SlotsAllocated:
    """Append the reply's blocks to ``req``'s table; a new table starts after its cached
    prefix, which is what the pool shared."""
    if not isinstance(reply, SlotsAllocated) or reply.sample_id != req.sample_id:
        raise ProtocolError(f"expected SlotsAllocated for {req.sample_id!r}, got {reply!r}")
    if not req.block_ids:  # a new table: its cached prefix is what the pool shared
        req.num_computed_tokens += reply.num_cached_tokens
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = reply.num_cached_tokens
        # Blocks read from the KV store are cached once the step that copies them in is done.
        req.num_cached_blocks = (reply.num_cached_tokens - reply.num_external_tokens) // block_size
    req.block_ids.extend(reply.block_ids)
    return reply


def too_small(req: Request, reply: AllocatorReply) -> ProtocolError:
    """The error when ``req`` alone is refused blocks: the pool and the config disagree."""
    return ProtocolError(
        f"{req!r} alone does not fit the KV pool ({reply!r}): SchedulerConfig.num_kv_blocks "
        "must equal the pool's size"
    )
