"""The scheduler's side of the KV store (``--kv-transfer-config``, :mod:`engine.runner.kv_store`).

A request the store concerns (not a pooling request, not a beam group, not under a LoRA
adapter, whose KV is the adapter's) gets a :class:`StoreState` when it is queued: the
digest of each full block of its prompt.

Reading, for an engine whose role reads. As the scheduler actor queues such a request, it
asks the pool how many leading blocks its prefix cache holds (:meth:`KVTier.lookup`,
``LookupPrefix``), and if the prompt has more full blocks (the block holding the last
prompt token never counts: its logits must be computed), it sends the store actor the
digests of those after the hit (:meth:`KVTier.fetch`). Until the answer comes
(:meth:`KVTier.fetched`) the request waits and others go first, as vLLM's
``WAITING_FOR_REMOTE_KVS``. Its first allocation then offers the blocks read
(``AllocateSlots.external``); the pool takes those that follow on from its hit, and the
plan carries their payloads (``StepPlan.kv_loads``) for the runner to copy in before the
chunk runs. They count as cached tokens (usage's ``cached_tokens``) and enter the prefix
cache once the step is done, as computed blocks do. A request read nothing more after:
one preempted later recomputes, from its own prefix cache where that still holds it.

Writing, for an engine whose role writes. Each step's plan lists the prompt blocks its
chunks complete that the request has not already found in (or written to) the folder
(``StepPlan.kv_saves``); the runner writes them after the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from engine.core.request import Request
from engine.messages import (
    BlocksFetched,
    FetchBlocks,
    LookupPrefix,
    ScheduledChunk,
    SlotsAllocated,
)


def offer(tier: KVTier | None, req: Request) -> tuple[int, int]:
    """``AllocateSlots.external`` for ``req``'s next allocation ((0, 0) without a store)."""
    return (0, 0) if tier is None else tier.offer(req)


@dataclasses.dataclass(slots=True)
class StoreState:
    """One request's part in the KV store."""

    digests: tuple[bytes, ...]  # every full prompt block's, from the first
    reads: bool  # it may start from blocks read (a first table that looks the cache up)
    fetching: bool = False  # waiting for the store actor's answer
    first: int = 0  # the index of the first block read
    epoch: int = 0  # the tier's epoch when it was read (KVTier.forget_reads)
    payloads: tuple[Any, ...] = ()  # the blocks read, until its first allocation
    saved: int = 0  # leading prompt blocks known to be in the folder


class KVTier:
    """The KV store as the scheduler uses it. ``store`` is the engine's
    :class:`~engine.runner.kv_store.KVStore` (its digests and role)."""

    def __init__(self, store: Any, block_size: int) -> None:
        self.store = store
        self.block_size = block_size
        self.queries = 0  # prompt tokens of the requests looked up in the folder
        # Counts the model's rebuilds from its checkpoint: blocks read before one were
        # computed with the weights before it, and are not taken.
        self.epoch = 0
        self.hits = 0  # tokens taken from blocks read

    def track(self, req: Request, *, reads: bool) -> None:
        """Give a queued request its state, where the store concerns it."""
        if req.lora is not None or req.beam is not None:
            return
        digests = self.store.digests(req.cache_prompt_ids, req.cache_salt, self.block_size)
        req.store = StoreState(digests, reads and self.store.loads and req.wait_for is None)

    def _readable(self, req: Request) -> int:
        """Its leading prompt blocks a hit may cover: never the last prompt token's."""
        return (req.num_prompt_tokens - 1) // self.block_size

    def lookup(self, req: Request) -> LookupPrefix | None:
        """The pool's lookup to send before reading, or None when it reads nothing."""
        state = req.store
        if state is None or not state.reads or req.block_ids or not self._readable(req):
            return None
        self.queries += req.num_prompt_tokens
        return LookupPrefix(req.cache_prompt_ids[:self._readable(req) * self.block_size],
                            req.cache_salt)

    def fetch(self, req: Request, cached_blocks: int) -> FetchBlocks | None:
        """What to read past the ``cached_blocks`` its prefix cache holds (None: nothing);
        the request waits for the answer from here on."""
        state = req.store
        end = self._readable(req)
        if state is None or cached_blocks >= end:
            return None
        state.fetching = True
        state.epoch = self.epoch
        return FetchBlocks(req.sample_id, cached_blocks, state.digests[cached_blocks:end])

    def fetched(self, req: Request, answer: BlocksFetched) -> None:
        """The store actor's answer for ``req``: it may be scheduled again."""
        state = req.store
        asked = state.digests[answer.start:answer.start + len(answer.digests)] if state else ()
        if state is None or not state.fetching or asked != answer.digests:
            return  # an answer for an earlier request of this sample id (aborted since)
        state.fetching = False
        state.first = answer.start
        state.payloads = tuple(answer.payloads)

    @staticmethod
    def waiting(req: Request) -> bool:
        """Whether ``req`` waits for blocks being read."""
        return req.store is not None and req.store.fetching

    def forget_reads(self) -> None:
        """The weights were read again (a level 2 wake-up, ``reload_weights``): blocks read
        or being read now are of the old weights, and none is taken."""
        self.epoch += 1

    def offer(self, req: Request) -> tuple[int, int]:
        """``AllocateSlots.external`` for ``req``'s next allocation."""
        state = req.store
        if state is None or not state.payloads or req.block_ids or state.epoch != self.epoch:
            return (0, 0)
        return (state.first, len(state.payloads))

    def took(self, req: Request, reply: SlotsAllocated, loads: list[tuple[int, Any]]) -> None:
        """After ``req``'s first allocation: the blocks read that it took, to copy in
        (appended to ``loads``); the rest are dropped."""
        state = req.store
        if state is None:
            return
        taken = reply.num_external_tokens // self.block_size
        cached = reply.num_cached_tokens // self.block_size
        for i in range(cached - taken, cached):
            loads.append((req.block_ids[i], state.payloads[i - state.first]))
        self.hits += taken * self.block_size
        state.payloads = ()
        state.saved = max(state.saved, cached)

    def saves(self, chunks: Sequence[ScheduledChunk],
              request_of: Callable[[str], Request | None]) -> list[tuple[str, int, bytes]]:
        """The prompt blocks ``chunks`` complete, not yet in the folder, to write after the
        step (none when the role does not write)."""
        if not self.store.saves:
            return []
        out = []
        for chunk in chunks:
            req = request_of(chunk.sample_id)
            if req is None or req.store is None or req.sample_id != chunk.sample_id:
                continue
            state = req.store
            # A block out of a sliding window is given back (never one this chunk completes).
            first = max(chunk.start // self.block_size, state.saved, req.num_released_blocks)
            last = min((chunk.start + chunk.num_tokens) // self.block_size, len(state.digests))
            out.extend((req.sample_id, req.block_ids[i], state.digests[i]) for i in range(first, last))
            state.saved = max(state.saved, last)
        return out
