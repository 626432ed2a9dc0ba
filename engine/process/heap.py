"""Keep a server's startup heap out of Python's full garbage collections.

A loaded server holds some 280,000 objects that Python's cyclic collector tracks (torch's
and transformers' modules, the tokenizer, the model's Python side), nearly all made at
startup and alive until exit. Every full collection walks them all: 130-140 ms on the
dev machine's cores, a stop of the event loop about once a thousand requests under an
embeddings load (`docs/benchmarks.md`, the served path's tenth pass). ``gc.freeze()``
moves every object alive at that moment to a permanent generation the collector skips;
the objects the requests make are collected as before, and a full collection then takes
about 2 ms. vLLM's engine core and API server freeze their heaps after startup the same way.

The price: an object frozen here that later becomes part of unreachable cyclic garbage is
not reclaimed until ``gc.unfreeze()``. What startup leaves alive is the model, its
tokenizer and the server's fixed parts, which live as long as the process; garbage made
during startup is collected first.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def frozen_startup_heap() -> Iterator[int]:
    """Collect, then freeze every object alive now, for the life of the block; yields how
    many were frozen. On exit the frozen objects go back to the oldest generation, so a
    server run inside a longer-lived process (the tests' in-process ``serve``) gives them
    back to the collector when it stops; when something had frozen objects before, they
    stay frozen (``gc.unfreeze`` cannot tell them apart)."""
    t0 = time.perf_counter()
    gc.collect()
    before = gc.get_freeze_count()
    gc.freeze()
    frozen = gc.get_freeze_count() - before
    logger.debug("froze %d startup objects out of the garbage collector (%.0f ms)",
                 frozen, (time.perf_counter() - t0) * 1e3)
    try:
        yield frozen
    finally:
        if before == 0:
            gc.unfreeze()
