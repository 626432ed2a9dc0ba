"""Cap glibc's malloc arenas in a long-lived server process.

glibc gives each thread that contends for the main heap an arena of its own, up to 8 per
core; memory freed in one arena is reused only by the threads that land on it, and a
heap inside an arena shrinks only from its top. A server whose threads come and go (trio's
worker threads for the model step, tokenizers, grammar compiles, torch's pool) ends up
with memory spread over many arenas, and its RSS climbs in steps for a long time after
the load has settled: a short hostile soak grew about 20 MiB a round, while tracemalloc
saw 0.1 MiB of Python objects. With two arenas it stayed flat.

``cap_arenas`` calls ``mallopt(M_ARENA_MAX, n)`` at start, before the threads exist.
``MALLOC_ARENA_MAX`` in the environment wins (glibc reads it itself), so a user can
measure or undo the cap without a code change; on a libc that is not glibc it does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

# From glibc's malloc.h: the mallopt parameter number of the arena cap.
M_ARENA_MAX = -8
# Two arenas: the event loop's thread and the model step's thread each get one, and the
# few other threads share them. That held RSS flat in the soak; more gave the steps back.
DEFAULT_ARENAS = 2


def cap_arenas(arenas: int = DEFAULT_ARENAS) -> bool:
    """Cap the arenas of this process; return True when the cap was set here."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # musl and others have no arenas
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    done = bool(mallopt(M_ARENA_MAX, arenas))
    if not done:
        logger.debug("mallopt(M_ARENA_MAX, %d) refused", arenas)
    return done
