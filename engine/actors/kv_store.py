"""The KV-store actor: reads prompt blocks from the shared folder (``--kv-transfer-config``).

The scheduler sends it :class:`~engine.messages.FetchBlocks` for each new request whose
prompt has blocks past its prefix cache's hit (engine.core.kv_tier); it reads them in a
worker thread, so that the steps go on meanwhile, and answers in the scheduler's inbox
with :class:`~engine.messages.BlocksFetched`. Reads run side by side, a few at a time.
Writing is the model runner's, after each step (engine.runner.kv_store).
"""

from __future__ import annotations

from typing import Any

import trio

from engine.messages import BlocksFetched, FetchBlocks

# Reads at once: a few files side by side keep a disk busy; more only queue in the kernel.
READS_AT_ONCE = 4


class KVStoreActor:
    """Actor: answers each :class:`FetchBlocks` with one :class:`BlocksFetched`."""

    def __init__(self, store: Any, inbox: trio.MemoryReceiveChannel[FetchBlocks],
                 to_scheduler: trio.MemorySendChannel[Any]) -> None:
        self._store = store  # engine.runner.kv_store.KVStore
        self._inbox = inbox
        self._to_scheduler = to_scheduler
        self._limiter = trio.CapacityLimiter(READS_AT_ONCE)
        self.fetches = 0
        self.blocks_found = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self._inbox, self._to_scheduler:
            async with trio.open_nursery() as nursery:
                task_status.started()
                async for message in self._inbox:
                    nursery.start_soon(self._read, message)

    async def _read(self, message: FetchBlocks) -> None:
        payloads = await trio.to_thread.run_sync(
            self._store.read_prefix, message.digests, limiter=self._limiter, abandon_on_cancel=True)
        self.fetches += 1
        self.blocks_found += len(payloads)
        try:
            await self._to_scheduler.send(BlocksFetched(message.sample_id, message.start, tuple(payloads),
                                                      message.digests))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # the engine stops
