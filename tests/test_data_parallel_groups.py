"""Data-parallel engine cores each with a tensor-parallel or pipeline group of its own
(issue 39): ``--data-parallel-size 2 -tp 2`` (and ``-pp 2``) with the cores as Ray actors,
each in a placement group holding it and its worker, or as spawned processes.

The oracle is the same engine at one core and one rank (itself checked against
transformers in test_parity.py): every layout must give its greedy tokens. The fault: a
worker of one core killed mid-stream fails that core's stream with the worker named, the
other core keeps serving, and the lost core comes back (with its group) within the
engine's restart budget."""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio
from engine_helpers import collect, greedy, random_prompts, token_ids, wait_until

import engine
from engine.errors import EngineDeadError
from engine.params import SamplingParams

OPTIONS: dict[str, Any] = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64,
                               block_size=16, kv_cache_memory=2**22)
# Round-robin: the prompts are spread over both cores whatever their prefixes.
DP: dict[str, Any] = dict(data_parallel_size=2, data_parallel_routing="round-robin")
PROMPTS = random_prompts(4, vocab=300, lo=3, hi=30, seed=39)
TOKENS = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.models.testing import write_tiny_model

    # 4 layers: two stages of two at -pp 2.
    return write_tiny_model(tmp_path_factory.mktemp("dp-groups"), "llama",
                            overrides={"num_hidden_layers": 4})


@pytest.fixture(scope="module")
def want(model: Path) -> list[list[int]]:
    async def one_rank() -> list[list[int]]:
        async with engine.open_engine(str(model), **OPTIONS) as eng:
            return await _greedy_all(eng)

    return trio.run(one_rank)


async def _greedy_all(eng: Any) -> list[list[int]]:
    results: list[list[int]] = [[] for _ in PROMPTS]

    async def one(i: int) -> None:
        results[i] = token_ids(await collect(eng, PROMPTS[i], greedy(TOKENS)))

    async with trio.open_nursery() as nursery:
        for i in range(len(PROMPTS)):
            nursery.start_soon(one, i)
    return results


def _finished(eng: Any) -> list[int]:
    return [stats.requests_finished if stats else 0 for _, stats in eng._pool.core_statistics()]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def local_ray() -> Any:
    """A local Ray started by the engine, its session in a short runtime folder."""
    ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")
    env_address = os.environ.pop("RAY_ADDRESS", None)
    # Short: Ray's socket paths under it must fit a Unix socket's 107 bytes.
    root = tempfile.mkdtemp(prefix="rt-")
    try:
        yield ray, root
    finally:
        if env_address is not None:
            os.environ["RAY_ADDRESS"] = env_address
    assert not ray.is_initialized()  # the engine stopped the Ray it started


async def test_two_ray_cores_of_two_tensor_ranks_answer_as_one_rank_and_survive_a_lost_worker(
        model: Path, want: list[list[int]], local_ray: Any) -> None:
    ray, root = local_ray
    async with engine.open_engine(str(model), **OPTIONS, **DP, tensor_parallel_size=2,
                                  data_parallel_backend="ray", runtime_dir=root,
                                  max_engine_restarts=1) as eng:
        cores = eng._pool._cores
        for core in cores:
            # Each core actor sits in a placement group of its own with a bundle for its
            # worker, and started that worker (a Ray actor: not this process's child).
            table = ray.util.placement_group_table(core.process.group)
            assert table["bundles"] == {0: {"CPU": 1.0}, 1: {"CPU": 1.0}}
            assert table["state"] == "CREATED"
            (worker,) = core.hello.worker_pids
            assert psutil.Process(worker).ppid() not in (core.hello.pid, os.getpid())
        assert await _greedy_all(eng) == want
        assert all(n > 0 for n in _finished(eng))  # both cores answered some

        errors: list[BaseException] = []
        got_tokens = trio.Event()

        async def stream() -> None:
            try:
                async for _ in eng.generate(PROMPTS[0], SamplingParams(
                        max_tokens=400, temperature=0, ignore_eos=True)):
                    got_tokens.set()
            except EngineDeadError as exc:
                errors.append(exc)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream)
                await got_tokens.wait()
                owner = next(c for c in cores if c.live)
                (victim,) = owner.hello.worker_pids
                lost_core, lost_group = owner.hello.pid, owner.process.group
                os.kill(victim, signal.SIGKILL)
        (error,) = errors
        assert f"engine core {owner.index} died while serving this request" in str(error)
        assert "tensor-parallel worker rank 1" in str(error)
        # The other core kept serving meanwhile.
        other = cores[1 - owner.index]
        assert other.state.value == "serving"
        served = token_ids(await collect(eng, PROMPTS[1], greedy(TOKENS)))
        assert served == want[1]
        with trio.fail_after(120):
            await wait_until(lambda: eng._pool.serving == 2)
        assert eng.restarts == 1 and victim not in owner.hello.worker_pids
        # The lost core's actor exited and its placement group was given back.
        assert ray.util.placement_group_table(lost_group)["state"] == "REMOVED"
        assert owner.hello.pid != lost_core
        await wait_until(lambda: _gone(lost_core))
        assert await _greedy_all(eng) == want


async def test_two_ray_cores_of_two_pipeline_stages_answer_as_one_rank(
        model: Path, want: list[list[int]], local_ray: Any) -> None:
    ray, root = local_ray
    async with engine.open_engine(str(model), **OPTIONS, **DP, pipeline_parallel_size=2,
                                  data_parallel_backend="ray", runtime_dir=root) as eng:
        assert all(len(c.hello.worker_pids) == 1 for c in eng._pool._cores)
        assert await _greedy_all(eng) == want
        assert all(n > 0 for n in _finished(eng))


async def test_two_spawned_cores_of_two_tensor_ranks_answer_as_one_rank(
        model: Path, want: list[list[int]]) -> None:
    async with engine.open_engine(str(model), **OPTIONS, **DP, tensor_parallel_size=2) as eng:
        cores = eng._pool._cores
        for core in cores:
            # Each core process started its own worker process.
            (worker,) = core.hello.worker_pids
            assert psutil.Process(worker).ppid() == core.hello.pid
        assert await _greedy_all(eng) == want
        assert all(n > 0 for n in _finished(eng))
