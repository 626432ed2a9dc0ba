"""Data-parallel engine cores placed as Ray actors (``--data-parallel-backend ray``, issue
39): on a local Ray the engine starts and stops, two core actors give the in-process
engine's greedy answers, and a core actor killed mid-stream is handled as a killed core
process is (its started requests fail naming the core, the slot restarts within the
budget, and the next request is served)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio
from engine_helpers import collect, greedy, random_prompts, tiny_model, token_ids, wait_until

import engine
from engine.errors import EngineDeadError
from engine.params import SamplingParams

OPTIONS: dict[str, Any] = dict(dtype="float32", max_num_seqs=16, max_num_batched_tokens=64,
                               block_size=16, kv_cache_memory=4 * 1024 * 1024)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory)


async def _greedy_all(eng: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    results: list[list[int]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        results[i] = token_ids(await collect(eng, prompts[i], greedy(max_tokens)))

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return results


async def test_two_core_actors_answer_as_one_core_and_a_killed_actor_is_a_killed_core(model: Path) -> None:
    ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")
    from engine.process.ray_cores import RayCoreHandle

    prompts = random_prompts(8, vocab=300, lo=2, hi=40, seed=11)
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        want = await _greedy_all(eng, prompts, 16)
    env_address = os.environ.pop("RAY_ADDRESS", None)
    # Short: Ray's socket paths under it must fit a Unix socket's 107 bytes.
    root = tempfile.mkdtemp(prefix="rt-")
    try:
        async with engine.open_engine(str(model), **OPTIONS, data_parallel_size=2,
                                      data_parallel_backend="ray", runtime_dir=root,
                                      max_engine_restarts=1) as eng:
            assert ray.is_initialized()
            cores = eng._pool._cores
            assert all(isinstance(c.process, RayCoreHandle) for c in cores)
            # Ray's workers, not this process's children, run the cores.
            children = {p.pid for p in psutil.Process().children()}
            assert all(c.hello.pid not in children for c in cores)
            assert await _greedy_all(eng, prompts, 16) == want
            assert all(state == "serving" for _, state, _ in eng._pool.statistics().cores)

            errors: list[BaseException] = []
            got_tokens = trio.Event()

            async def stream() -> None:
                try:
                    async for _ in eng.generate([5, 6, 7], SamplingParams(
                            max_tokens=400, temperature=0, ignore_eos=True)):
                        got_tokens.set()
                except EngineDeadError as exc:
                    errors.append(exc)

            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    # Affinity routing keeps one prompt on one core: core 0 takes the first.
                    eng._pool.routing = "round-robin"
                    nursery.start_soon(stream)
                    await got_tokens.wait()
                    owner = next(c for c in cores if c.live)
                    pid = owner.hello.pid
                    ray.kill(owner.process.actor, no_restart=True)
            assert len(errors) == 1 and f"engine core {owner.index} died" in str(errors[0])
            with trio.fail_after(120):
                await wait_until(lambda: eng._pool.serving == 2)
            assert eng.restarts == 1 and owner.hello.pid != pid
            assert await _greedy_all(eng, prompts[:2], 16) == want[:2]
        assert not ray.is_initialized()  # the engine stopped the Ray it started
    finally:
        if env_address is not None:
            os.environ["RAY_ADDRESS"] = env_address
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
