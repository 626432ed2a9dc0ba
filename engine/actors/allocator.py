"""The KV-allocator actor: the one owner of the block pool, answering the scheduler."""

from __future__ import annotations

from typing import Protocol

import trio

from engine.messages import AllocatorCall, AllocatorReply, AllocatorStats, ReadAllocatorStats


class Pool(Protocol):
    """What the actor needs of :class:`engine.core.block_pool.BlockPool`."""

    def handle(self, call: AllocatorCall) -> AllocatorReply: ...


class KVAllocator:
    """Actor: answers each allocator call with exactly one reply, in the order received.

    Only the scheduler sends calls, one at a time (it waits for each reply), so the pool
    sees them in the scheduler's order and needs no locking.
    """

    def __init__(
        self,
        pool: Pool,
        calls: trio.MemoryReceiveChannel[AllocatorCall],
        replies: trio.MemorySendChannel[AllocatorReply],
    ) -> None:
        self._pool = pool
        self._calls = calls
        self._replies = replies

    def statistics(self) -> AllocatorStats:
        # A read of the pool's counters; safe between messages on the trio thread.
        stats = self._pool.handle(ReadAllocatorStats())
        assert isinstance(stats, AllocatorStats)  # the pool's protocol, not input validation
        return stats

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self._calls, self._replies:
            task_status.started()
            async for call in self._calls:
                await self._replies.send(self._pool.handle(call))
