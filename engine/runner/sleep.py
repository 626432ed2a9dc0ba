"""Sleep mode's memory (vLLM's ``--enable-sleep-mode``): what a runner gives back while
it sleeps, and how it takes it again.

Two tags, as vLLM names them:

* ``"kv_cache"`` (levels 1 and 2): the KV pool, its scales and a hybrid model's state
  slots. On CPU they are private anonymous maps (``kv_cache._lazy_zeros``): their pages go
  back to the OS with ``madvise(MADV_DONTNEED)`` and the addresses stay, so the fused
  decode step's plan, which points into them, stays valid. Waking costs nothing: a page
  reads as zeros when next touched, as a fresh pool's does. Their contents are forgotten,
  so the scheduler drops its prefix cache before the runner sleeps.
* ``"weights"`` (level 2): the model is let go (every tensor it built, the packed copies
  of its projections included) and rebuilt on waking from the checkpoint, read again as at
  startup (``reload``: the rank's own slices, with tensor or pipeline parallelism), so the
  rebuilt model is the one startup built; a speculative draft model's likewise. At level
  1 the weights stay where they are: on a CPU they are in host memory already, which is
  where vLLM's level 1 moves a GPU's.

Only the CPU path is built: a CUDA engine refuses ``enable_sleep_mode`` at startup (giving
CUDA memory back while keeping its addresses needs CUDA's virtual memory API, as vLLM's
``CuMemAllocator`` does).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

logger = logging.getLogger(__name__)

# What sleeps, in vLLM's names (its ``wake_up(tags=...)``).
SLEEP_TAGS = ("weights", "kv_cache")
# What each level puts to sleep.
LEVEL_TAGS = {0: (), 1: ("kv_cache",), 2: ("weights", "kv_cache")}


def check_tags(tags: tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """``tags`` as given to ``wake_up`` (None or empty: all of them); raises ValueError
    naming one that is not a tag."""
    if not tags:
        return SLEEP_TAGS
    for tag in tags:
        if tag not in SLEEP_TAGS:
            raise ValueError(f"unknown sleep tag {tag!r}: the tags are {', '.join(SLEEP_TAGS)}")
    return tuple(dict.fromkeys(tags))


def trim_heap() -> None:
    """Collect garbage, then have glibc's malloc give its free pages back to the OS
    (``malloc_trim(0)``): a weight smaller than malloc's map threshold lies in a heap,
    whose free middle stays resident otherwise. Nothing on another libc."""
    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


__all__ = ["LEVEL_TAGS", "SLEEP_TAGS", "check_tags", "trim_heap"]
