"""The server's periodic stats line, as vLLM's ``--disable-log-stats`` turns off: every
``--log-stats-interval`` seconds, the prompt and generation tokens per second since the
last line, the requests running and waiting, how full the KV cache is and the prefix
cache's hit rate.

    Avg prompt throughput: 412.0 tokens/s, Avg generation throughput: 96.3 tokens/s,
    Running: 4 reqs, Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 33.0%

Tokens are counted as the HTTP routes count them for ``/metrics`` (a request's prompt when
it is submitted, each output token as it is sent). An idle server logs at debug level,
as vLLM's does, so the log stays quiet: a line is at info level when this interval or the
one before moved tokens, or when requests are running or waiting.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from engine.api import EngineLike
    from engine.api.metrics import Metrics

logger = logging.getLogger("engine.stats")

DEFAULT_INTERVAL_SECONDS = 10.0  # vLLM's VLLM_LOG_STATS_INTERVAL


class StatsLog:
    """Turns the engine's statistics and the server's token counts into the stats line."""

    def __init__(self, engine: EngineLike, metrics: Metrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._engine = engine
        self._metrics = metrics
        self._clock = clock
        self._since = clock()
        self._prompt = metrics.prompt_token_count
        self._generated = metrics.generation_token_count
        self._moved_before = False

    def line(self) -> tuple[str, bool]:
        """The line for the time since the last call, and whether it is worth info level."""
        now = self._clock()
        seconds = max(now - self._since, 1e-9)
        m = self._metrics
        prompt = (m.prompt_token_count - self._prompt) / seconds
        generated = (m.generation_token_count - self._generated) / seconds
        self._since, self._prompt, self._generated = now, m.prompt_token_count, m.generation_token_count
        stats = self._engine.statistics()
        used = stats.kv_blocks_total - stats.kv_blocks_free
        usage = 100.0 * used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
        hits = (100.0 * stats.prefix_cache_hits / stats.prefix_cache_queries
                if stats.prefix_cache_queries else 0.0)
        moved = bool(prompt or generated)
        busy = moved or self._moved_before or stats.running > 0 or stats.waiting > 0
        self._moved_before = moved
        text = (f"Avg prompt throughput: {prompt:.1f} tokens/s, Avg generation throughput: "
                f"{generated:.1f} tokens/s, Running: {stats.running} reqs, Waiting: "
                f"{stats.waiting} reqs, KV cache usage: {usage:.1f}%, Prefix cache hit rate: "
                f"{hits:.1f}%")
        return text, busy

    async def run(self, interval: float) -> None:
        """Log the line every ``interval`` seconds until cancelled."""
        while True:
            await trio.sleep(interval)
            text, busy = self.line()
            logger.log(logging.INFO if busy else logging.DEBUG, "%s", text)
