"""vLLM's ``reset_prefix_cache``: ``LLM.reset_prefix_cache()``, ``Engine.reset_prefix_cache()``
and the dev-mode route ``POST /reset_prefix_cache`` (with vLLM's other dev-mode routes
built here, ``GET /server_info`` and ``GET /is_sleeping``).

After a reset a prompt seen before finds no cached block (the pool's hit counter stays
where it was while its query counter grows) and still gives the tokens it gave with the
cache; while a request holds KV blocks the reset is refused and nothing is dropped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_helpers import collect, greedy, token_ids
from http_server import ServerThread

import engine
from engine import LLM, SamplingParams
from engine.core.block_pool import BlockPool
from engine.messages import (
    AllocateSlots,
    CacheBlocks,
    ClearPrefixCache,
    FreeRequest,
    PrefixCacheCleared,
)
from engine.models.testing import write_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 16
PROMPT = [(7 * i + 3) % 200 + 3 for i in range(5 * BLOCK + 3)]  # five full blocks, and a part


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("reset") / "llama", "llama")


def test_the_pool_forgets_its_cached_blocks_only_while_no_request_holds_one() -> None:
    pool = BlockPool(16, 4)
    tokens = tuple(range(10, 22))  # three full blocks
    pool.allocate_slots(AllocateSlots("a", num_computed_tokens=0, num_known_tokens=12,
                                      token_budget=12, prefix_token_ids=tokens))
    pool.cache_blocks("a", tokens)
    cached = pool.lookup(tokens)
    assert len(cached) == 3
    # A request holds them: refused, the cache unchanged.
    assert pool.handle(ClearPrefixCache()) == PrefixCacheCleared(False)
    assert pool.lookup(tokens) == cached
    pool.handle(FreeRequest("a"))
    assert pool.lookup(tokens) == cached  # freed, still cached
    assert pool.handle(ClearPrefixCache()) == PrefixCacheCleared(True)
    assert pool.lookup(tokens) == ()
    stats = pool.statistics()
    assert (stats.num_cached_blocks, stats.num_free_blocks) == (0, 16)
    # The pool caches again afterwards.
    pool.allocate_slots(AllocateSlots("b", num_computed_tokens=0, num_known_tokens=12,
                                      token_budget=12, prefix_token_ids=tokens))
    pool.handle(CacheBlocks("b", tokens))
    assert len(pool.lookup(tokens)) == 3


LAYOUTS = {"in-process": {}, "process": {"engine_core": "process"},
           "two-cores": {"engine_core": "process", "data_parallel_size": 2}}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_llm_reset_prefix_cache_makes_a_seen_prompt_compute_its_prefix_again(folder: Path, layout: str) -> None:
    options: dict[str, Any] = LAYOUTS[layout]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(folder), block_size=BLOCK, **options) as llm:
        (first,) = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
        before = llm.statistics()
        (cached,) = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
        hit = llm.statistics()
        assert hit.prefix_cache_hits - before.prefix_cache_hits == 5 * BLOCK
        assert llm.reset_prefix_cache() is True
        (again,) = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
        after = llm.statistics()
        assert after.prefix_cache_hits == hit.prefix_cache_hits  # nothing found
        assert after.prefix_cache_queries > hit.prefix_cache_queries  # though it looked
        assert first.outputs[0].token_ids == cached.outputs[0].token_ids == again.outputs[0].token_ids


async def test_a_reset_while_a_request_holds_blocks_is_refused_and_drops_nothing(folder: Path) -> None:
    async with engine.open_engine(model=str(folder), block_size=BLOCK) as eng:
        await collect(eng, PROMPT, greedy(2))  # PROMPT's blocks are cached
        stream = await eng.submit([3] * (2 * BLOCK), greedy(200))
        async with stream:
            first = await stream.__anext__()  # it runs: it holds blocks
            assert await eng.reset_prefix_cache() is False
            rest = [out async for out in stream]
        assert len(token_ids([first, *rest])) == 200
        before = eng.statistics()
        await collect(eng, PROMPT, greedy(2))
        assert eng.statistics().prefix_cache_hits - before.prefix_cache_hits == 5 * BLOCK
        assert await eng.reset_prefix_cache() is True


def test_the_dev_mode_route_resets_and_says_when_it_cannot(folder: Path) -> None:
    def opened() -> Any:
        return engine.open_engine(model=str(folder), block_size=BLOCK)

    with ServerThread(opened, server_dev_mode=True) as server:
        url = server.base_url
        body = {"model": server.engine.model_name, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
        httpx.post(f"{url}/v1/completions", json=body, timeout=60).raise_for_status()
        reply = httpx.post(f"{url}/reset_prefix_cache", timeout=60)
        assert (reply.status_code, reply.content) == (200, b"")
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          json=body | {"prompt": [3] * 40, "max_tokens": 460, "n": 8,
                                       "stream": True, "ignore_eos": True}) as streaming:
            # The first chunk: the request holds blocks, and will for its 3,680 tokens'
            # steps (a few hundred), where the reset below takes one round trip. (The
            # iterator is kept: closing it would close the stream, and the request with it.)
            lines = streaming.iter_lines()
            next(lines)
            busy = httpx.post(f"{url}/reset_prefix_cache", timeout=60)
            assert busy.status_code == 409
            assert busy.json()["error"]["code"] == "prefix_cache_in_use"
            finished = [json.loads(line[6:]) for line in lines if '"finish_reason":"length"' in line]
            assert len(finished) == 8  # every sample ran to its end
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          json=body | {"prompt": [3] * 40, "max_tokens": 200, "n": 4,
                                       "stream": True, "ignore_eos": True}) as streaming:
            lines = streaming.iter_lines()
            next(lines)
            # vLLM's reset_running_requests: the samples are preempted, the reset happens.
            reset = httpx.post(f"{url}/reset_prefix_cache?reset_running_requests=true",
                               timeout=60)
            assert (reset.status_code, reset.content) == (200, b"")
            finished = [json.loads(line[6:]) for line in lines if '"finish_reason":"length"' in line]
            assert len(finished) == 4
        refused = httpx.post(f"{url}/reset_prefix_cache?reset_running_requests=maybe", timeout=60)
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "reset_running_requests"
        # vLLM's other development routes built here: the configuration, and no sleep.
        info = httpx.get(f"{url}/server_info", timeout=60).json()
        assert info["engine_config"] == json.loads(server.engine.config.to_json())
        assert json.loads(info["vllm_config"]) == info["engine_config"]
        assert info["engine_config"]["block_size"] == BLOCK
        assert httpx.get(f"{url}/is_sleeping", timeout=60).json() == {"is_sleeping": False}
    with ServerThread(opened) as server:  # vLLM's default: no development routes
        assert httpx.post(f"{server.base_url}/reset_prefix_cache", timeout=60).status_code == 404
        assert httpx.get(f"{server.base_url}/server_info", timeout=60).status_code == 404


@pytest.mark.parametrize("layout", ["in-process", "process"])
async def test_reset_running_requests_preempts_them_and_they_finish_as_they_would_have(
    folder: Path, layout: str
) -> None:
    """vLLM's reset_running_requests: the running request is preempted (its blocks
    freed), the cache is dropped, and the request recomputes and ends with the tokens it
    gives when nothing interrupts it."""
    async with engine.open_engine(model=str(folder), block_size=BLOCK, **LAYOUTS[layout]) as eng:
        alone = token_ids(await collect(eng, PROMPT, greedy(120)))
        await collect(eng, PROMPT, greedy(2))  # PROMPT's blocks are cached
        before = eng.statistics()
        stream = await eng.submit(PROMPT, greedy(120))
        async with stream:
            outs = [await stream.__anext__() for _ in range(3)]  # it runs: it holds blocks
            assert await eng.reset_prefix_cache(reset_running_requests=True) is True
            outs += [out async for out in stream]
        after = eng.statistics()
        assert token_ids(outs) == alone
        assert after.preemptions == before.preemptions + 1
        assert after.kv_blocks_free == after.kv_blocks_total  # nothing held afterwards


async def test_an_engine_that_is_gone_refuses_the_reset(folder: Path) -> None:
    async with engine.open_engine(model=str(folder)) as eng:
        pass
    with pytest.raises(engine.EngineDeadError):
        await eng.reset_prefix_cache()
