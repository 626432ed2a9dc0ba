"""Shared helpers for the actor and end-to-end engine tests (tiny float32 models)."""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

import engine
from engine.params import SamplingParams

# Polling interval while waiting for the engine to reach a state: short enough not to
# slow tests, long enough not to spin the 2 shared cores.
POLL_SECONDS = 0.002
# Safety net so a broken engine fails a test instead of hanging the suite.
WAIT_LIMIT_SECONDS = 60


def greedy(max_tokens: int, **extra: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


def random_prompts(count: int, *, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """Prompts of token ids with lengths in [lo, hi]; ids avoid the 3 special tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


async def collect(eng: Any, prompt: Any, params: SamplingParams, **kwargs: Any) -> list[Any]:
    """Every output of one request, read to the end."""
    stream = await eng.submit(prompt, params, **kwargs)
    async with stream:
        return [out async for out in stream]


def token_ids(outputs: list[Any], index: int = 0) -> list[int]:
    return [t for out in outputs if out.index == index for t in out.token_ids]


def text(outputs: list[Any], index: int = 0) -> str:
    return "".join(out.text for out in outputs if out.index == index)


async def wait_until(predicate: Callable[[], bool]) -> None:
    with trio.fail_after(WAIT_LIMIT_SECONDS):
        while not predicate():  # noqa: ASYNC110 - engine state has no event to wait on
            await trio.sleep(POLL_SECONDS)


async def wait_idle(eng: Any) -> engine.EngineStatistics:
    """Wait until no request runs or waits and every KV block is free again."""

    def idle() -> bool:
        s = eng.statistics()
        return s.running == 0 and s.waiting == 0 and s.kv_blocks_free == s.kv_blocks_total

    try:
        await wait_until(idle)
    except trio.TooSlowError:
        raise AssertionError(f"the engine never went idle: {eng.statistics()}") from None
    return eng.statistics()


def native_threads() -> set[int]:
    """The process's threads that are not Python's (libgomp's team workers among them)."""
    python = {t.native_id for t in threading.enumerate()}
    return {int(tid) for tid in os.listdir("/proc/self/task")} - python


def tiny_model(tmp_path_factory: Any, arch: str = "llama") -> Path:
    from engine.models.testing import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch)
