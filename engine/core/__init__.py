"""Pure, synchronous policy: no I/O, no trio, unit-tested on its own.

* :class:`Scheduler` plans each engine step (continuous batching, chunked prefill,
  preemption by recompute, async scheduling); its ``schedule()`` is a sans-IO generator of
  allocator calls.
* :class:`BlockPool` owns the KV blocks and the prefix cache and answers those calls.
* ``engine.core.detokenizer`` turns token ids into text with stop strings.
"""

from engine.core.block_pool import BlockPool, block_hash
from engine.core.request import ProtocolError, Request, RequestStatus
from engine.core.scheduler import (
    Scheduler,
    SchedulerConfig,
    SchedulerStats,
    SchedulerUpdate,
    run_with_pool,
)

__all__ = [
    "BlockPool",
    "ProtocolError",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "SchedulerUpdate",
    "block_hash",
    "run_with_pool",
]
