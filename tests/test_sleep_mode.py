"""Sleep mode and pausing generation (vLLM's ``sleep`` / ``wake_up`` / ``is_sleeping``,
``pause_generation`` / ``resume_generation`` / ``is_paused``): the embedded API, the
offline ``LLM``, the dev-mode routes, every process layout.

What is checked: the memory comes back to the OS (``VmRSS``), a woken engine answers as
before it slept (its own tokens and logprobs, and transformers' greedy decoding), a level
2 sleep reads the checkpoint again (one rewritten while it slept is what it then serves,
on every tensor-parallel rank and pipeline stage), and each pause mode does with the
requests in flight what it says."""

from __future__ import annotations

import argparse
import json
import threading
import types
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import trio
from engine_helpers import collect, greedy, token_ids, wait_until
from http_server import ServerThread
from test_granite4_mamba import write_hybrid
from test_lora import write_peft_adapters
from test_parity import LOGPROB_ATOL, _hf_greedy, _hf_model

import engine
from engine import LLM, SamplingParams
from engine.cli.args import config_from_args
from engine.cli.serve import add_serve_arguments
from engine.errors import ConfigError, InvalidParamError, RequestError, RequestFailedError
from engine.http.errors import error_from_exception
from engine.models.config import ModelConfig
from engine.models.layers.linear import weight_bytes
from engine.models.testing import write_tiny_model
from engine.runner.kv_cache import (
    allocate_kv_caches,
    bytes_per_block,
    release_pages,
    resident_bytes,
)

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 16
PROMPT = [(7 * i + 3) % 200 + 3 for i in range(5 * BLOCK + 3)]
MiB = 2**20


def _options(**extra: Any) -> dict[str, Any]:
    return dict(block_size=BLOCK, dtype="float32", enable_sleep_mode=True) | extra


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("sleep") / "llama", "llama")


async def _answer(eng: Any, prompt: list[int], n: int = 12) -> tuple[list[int], list[float]]:
    outputs = await collect(eng, prompt, greedy(n, logprobs=0))
    return token_ids(outputs), [lp.logprob for out in outputs for lp in out.logprobs]


def _runner(eng: Any) -> Any:
    return eng._parts.runner  # the in-process engine's runner, to look at what sleeps


# -- the memory ------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_released_pages_go_back_to_the_os_and_read_as_zeros_at_the_same_address(
    folder: Path, kv_cache_dtype: str
) -> None:
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    blocks = (256 * MiB) // bytes_per_block(config, torch.float32, BLOCK, kv_cache_dtype=kv_cache_dtype)
    caches = allocate_kv_caches(config, blocks, BLOCK, torch.float32, "cpu", kv_cache_dtype=kv_cache_dtype)
    tensors = [t for k, v in caches for c in (k, v)
               for t in ((c.data, c.scale) if hasattr(c, "scale") else (c,))]
    for t in tensors:
        t.fill_(1)  # every page resident
    addresses = [t.data_ptr() for t in tensors]
    before = resident_bytes()
    released = release_pages(caches)
    after = resident_bytes()
    assert released >= 250 * MiB
    assert before - after >= 0.9 * released  # the kernel took the pages back
    assert [t.data_ptr() for t in tensors] == addresses
    assert all(int(t.count_nonzero()) == 0 for t in tensors)


async def test_a_real_model_gives_back_its_kv_pages_then_its_weights() -> None:
    """SmolLM2 (the bundled GGUF): a level 1 sleep gives back about the KV bytes its two
    prompts wrote, a level 2 sleep the weights' resident bytes."""
    prompts = [[(7 * i + 3 + j) % 2000 + 3 for i in range(600)] for j in range(2)]
    async with engine.open_engine(enable_sleep_mode=True, kv_cache_memory=512 * MiB,
                                  max_num_seqs=2) as eng:
        runner = _runner(eng)
        async with trio.open_nursery() as nursery:
            for prompt in prompts:
                nursery.start_soon(collect, eng, prompt, greedy(4))
        alone = [(11 * i + 5) % 2000 + 3 for i in range(300)]
        first = await _answer(eng, alone, 6)  # computed whole, as it is after the wake
        kv_written = 2 * 608 * bytes_per_block(runner.config, runner.dtype, 1)
        weights = weight_bytes(runner.model)
        start = resident_bytes()
        await eng.sleep(1)
        asleep_1 = resident_bytes()
        assert start - asleep_1 >= 0.8 * kv_written
        assert runner.sleeping == {"kv_cache"} and runner.model is not None
        await eng.sleep(2)
        assert runner.model is None
        assert asleep_1 - resident_bytes() >= 0.8 * weights
        await eng.wake_up()
        assert runner.sleeping == set()
        assert await _answer(eng, alone, 6) == first


# -- the answers after a sleep ------------------------------------------------------------------


async def test_after_each_level_the_engine_answers_as_before(folder: Path) -> None:
    async with engine.open_engine(model=str(folder), **_options()) as eng:
        runner = _runner(eng)
        before = await _answer(eng, PROMPT)
        assert not await eng.is_sleeping()
        await eng.sleep(1)
        assert await eng.is_sleeping() and await eng.is_paused()
        assert eng.sleeping_tags() == ("kv_cache",)
        await eng.wake_up()
        assert not await eng.is_sleeping() and not await eng.is_paused()
        stats = eng.statistics()
        # The prefix cache went with the KV contents: the prompt is computed again.
        assert await _answer(eng, PROMPT) == before
        assert eng.statistics().prefix_cache_hits == stats.prefix_cache_hits
        await eng.sleep(2)
        assert runner.model is None and eng.sleeping_tags() == ("kv_cache", "weights")
        await eng.wake_up(["weights"])  # vLLM's RL order: weights first, then the cache
        assert eng.sleeping_tags() == ("kv_cache",) and await eng.is_paused()
        await eng.wake_up(["kv_cache"])
        assert await _answer(eng, PROMPT) == before
        await eng.sleep(0)  # level 0: paused, nothing given back
        assert await eng.is_sleeping() and runner.sleeping == set()
        await eng.wake_up()
        assert await _answer(eng, PROMPT) == before


# Every core's scheduler gets the call as ResetPrefixCache's (messages.CORE_CONTROLS), whose
# tests cover two cores; a worker rank and a pipeline stage each sleep on their own here.
LAYOUTS = {"in-process": {}, "process": {"engine_core": "process"},
           "tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}


@pytest.mark.parametrize("layout", list(LAYOUTS))
async def test_a_level_2_sleep_serves_the_checkpoint_written_while_it_slept(
    tmp_path: Path, layout: str
) -> None:
    """vLLM's RL weight update: sleep at level 2, the trainer writes new weights, wake up.
    Every rank (and every core) reads the new checkpoint: the answers are transformers' on
    the new weights."""
    path = write_tiny_model(tmp_path / "llama", "llama", seed=0)
    old = _hf_model(path)
    async with engine.open_engine(model=str(path), **_options(**LAYOUTS[layout])) as eng:
        tokens, logprobs = await _answer(eng, PROMPT, 8)
        assert (tokens, pytest.approx(logprobs, abs=LOGPROB_ATOL)) == _hf_greedy(old, PROMPT, 8)
        await eng.sleep(2)
        write_tiny_model(path, "llama", seed=1)  # new weights in the same folder
        await eng.wake_up()
        new_tokens, new_logprobs = await _answer(eng, PROMPT, 8)
    expected_tokens, expected_logprobs = _hf_greedy(_hf_model(path), PROMPT, 8)
    assert new_tokens == expected_tokens and new_tokens != tokens
    torch.testing.assert_close(torch.tensor(new_logprobs, dtype=torch.float64),
                               torch.tensor(expected_logprobs, dtype=torch.float64),
                               atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("layout", ["in-process", "tp2"])
async def test_reload_weights_serves_the_checkpoint_rewritten_while_it_served(
    tmp_path: Path, layout: str
) -> None:
    """vLLM's collective_rpc("reload_weights") without a sleep: the trainer rewrites the
    checkpoint and the engine reads it again between two steps. A request running then is
    preempted and recomputed with the new weights; it ends with all its tokens."""
    path = write_tiny_model(tmp_path / "llama", "llama", seed=0)
    async with engine.open_engine(model=str(path), **_options(**LAYOUTS[layout])) as eng:
        old = await _answer(eng, PROMPT, 8)
        write_tiny_model(path, "llama", seed=1)
        before = eng.statistics()
        stream = await eng.submit(PROMPT[:40], greedy(300))
        async with stream:
            outs = [await stream.__anext__()]
            assert await eng.collective_rpc("reload_weights") == [None] * (2 if layout == "tp2" else 1)
            outs += [out async for out in stream]
        assert len(token_ids(outs)) == 300 and outs[-1].finish_reason == "length"
        assert eng.statistics().preemptions == before.preemptions + 1
        assert not await eng.is_paused() and not await eng.is_sleeping()
        new = await _answer(eng, PROMPT, 8)
    expected = _hf_greedy(_hf_model(path), PROMPT, 8)
    assert new[0] == expected[0] != old[0]
    assert new[1] == pytest.approx(expected[1], abs=LOGPROB_ATOL)


def test_vllms_rl_sequence_on_the_llm(tmp_path: Path) -> None:
    """vLLM's documented RL order: sleep at level 2, wake the weights, reload them, wake
    the KV cache; the LLM then runs the checkpoint written meanwhile."""
    path = write_tiny_model(tmp_path / "llama", "llama", seed=0)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(path), **_options()) as llm:
        llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
        llm.sleep(level=2)
        write_tiny_model(path, "llama", seed=2)
        llm.wake_up(tags=["weights"])
        assert llm.collective_rpc("reload_weights") == [None]
        llm.wake_up(tags=["kv_cache"])
        (out,) = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
        with pytest.raises(InvalidParamError, match="reload_weights") as info:
            llm.collective_rpc("execute_model")
        assert info.value.param == "method"
    assert list(out.outputs[0].token_ids) == _hf_greedy(_hf_model(path), PROMPT, 8)[0]


async def test_a_checkpoint_that_does_not_load_leaves_the_weights_asleep_until_it_does(
    tmp_path: Path
) -> None:
    path = write_tiny_model(tmp_path / "llama", "llama", seed=0)
    async with engine.open_engine(model=str(path), **_options()) as eng:
        before = await _answer(eng, PROMPT)
        good = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(b"not a checkpoint")
        with pytest.raises(RequestFailedError, match="reloading the weights failed"):
            await eng.reload_weights()
        assert await eng.is_sleeping() and eng.sleeping_tags() == ("weights",)
        assert _runner(eng).model is None
        (path / "model.safetensors").write_bytes(good)
        await eng.wake_up()
        assert not await eng.is_sleeping() and not await eng.is_paused()
        assert await _answer(eng, PROMPT) == before


async def test_a_hybrid_model_forgets_its_state_checkpoints_and_answers_as_transformers(
    tmp_path: Path
) -> None:
    path = tmp_path / "granite4h"
    hf = write_hybrid(path)
    prompt = [(5 * i + 1) % 300 + 3 for i in range(23)]
    async with engine.open_engine(model=str(path), **_options(block_size=4, max_num_seqs=4,
                                                             max_model_len=96)) as eng:
        expected = _hf_greedy(hf, prompt, 6)
        outputs = await collect(eng, prompt, greedy(6, logprobs=0))
        outputs = await collect(eng, prompt, greedy(6, logprobs=0))
        assert outputs[-1].usage.cached_tokens > 0  # resumed from a state checkpoint
        await eng.sleep(2)
        await eng.wake_up()
        outputs = await collect(eng, prompt, greedy(6, logprobs=0))
        assert outputs[-1].usage.cached_tokens == 0  # the checkpoints went with the pool
        assert token_ids(outputs) == expected[0]
        got = [lp.logprob for out in outputs for lp in out.logprobs]
        assert got == pytest.approx(expected[1], abs=LOGPROB_ATOL)


# -- pausing ------------------------------------------------------------------------------------


async def test_pause_abort_ends_the_running_requests_and_new_ones_wait_for_the_resume(folder: Path) -> None:
    async with engine.open_engine(model=str(folder), **_options()) as eng:
        alone = await _answer(eng, PROMPT, 20)
        stream = await eng.submit(PROMPT, greedy(400))
        async with stream:
            first = await stream.__anext__()
            await eng.pause_generation(mode="abort")
            rest = [out async for out in stream]
        assert [first, *rest][-1].finish_reason == "abort"
        assert len(token_ids([first, *rest])) < 400
        assert await eng.is_paused() and not await eng.is_sleeping()
        late = await eng.submit(PROMPT, greedy(20, logprobs=0))
        async with late:
            with trio.move_on_after(0.5):
                await late.__anext__()
                raise AssertionError("a request ran while generation was paused")
            assert eng.statistics().waiting == 1
            await eng.resume_generation()
            outputs = [out async for out in late]
        assert token_ids(outputs) == alone[0]
        assert [lp.logprob for o in outputs for lp in o.logprobs] == pytest.approx(alone[1], abs=LOGPROB_ATOL)
        assert eng.statistics().kv_blocks_free == eng.statistics().kv_blocks_total


async def test_pause_wait_returns_once_the_running_requests_have_finished(folder: Path) -> None:
    async with engine.open_engine(model=str(folder), **_options()) as eng:
        stream = await eng.submit(PROMPT, greedy(60))
        seen: list[Any] = []
        async with stream:
            seen.append(await stream.__anext__())

            async def drain() -> None:
                async for out in stream:
                    seen.append(out)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(drain)
                await eng.pause_generation(mode="wait")
                # The pause is done: the request before it has run to its end.
                assert seen[-1].finish_reason == "length"
                assert len(token_ids(seen)) == 60
        late = await eng.submit(PROMPT, greedy(5))
        async with late:
            with trio.move_on_after(0.5):
                await late.__anext__()
                raise AssertionError("a request ran while generation was paused")
            await eng.resume_generation()
            assert len(token_ids([out async for out in late])) == 5


@pytest.mark.parametrize("layout", ["in-process", "process"])
@pytest.mark.parametrize("level", [-1, 1])
async def test_kept_requests_go_on_after_the_resume_with_the_tokens_they_would_have_given(
    folder: Path, layout: str, level: int
) -> None:
    """mode "keep": the request is frozen where it is; after a sleep (its KV forgotten) it
    is preempted and recomputes. Either way it ends with its uninterrupted tokens."""
    async with engine.open_engine(model=str(folder), **_options(**LAYOUTS[layout])) as eng:
        alone = await _answer(eng, PROMPT, 80)
        stream = await eng.submit(PROMPT, greedy(80, logprobs=0))
        async with stream:
            outs = [await stream.__anext__() for _ in range(3)]
            if level < 0:
                await eng.pause_generation(mode="keep")
            else:
                await eng.sleep(level, mode="keep")
            with trio.move_on_after(0.3):
                while not outs[-1].finished:  # what the last step in flight gave
                    outs.append(await stream.__anext__())
            count = len(outs)
            await (eng.resume_generation() if level < 0 else eng.wake_up())
            outs += [out async for out in stream]
        assert count < len(outs)
        # The prompt was cached from the first answer: the same tokens, logprobs to rounding.
        assert token_ids(outs) == alone[0]
        assert [lp.logprob for o in outs for lp in o.logprobs] == pytest.approx(alone[1], abs=LOGPROB_ATOL)


async def test_a_pause_meeting_another_under_way_is_a_conflict(folder: Path) -> None:
    """A second pause while one waits for its requests is refused (409 through HTTP, as
    vLLM's transition lock answers); a resume overtakes the waiting pause, whose caller
    hears it as a conflict too, and the request it waited for runs to its end."""
    async with engine.open_engine(model=str(folder), **_options()) as eng:
        stream = await eng.submit(PROMPT, greedy(400))
        got: list[Any] = []
        async with stream:
            got.append(await stream.__anext__())

            async def pause_waiting() -> None:
                with pytest.raises(engine.PauseConflictError, match="resume came before"):
                    await eng.pause_generation(mode="wait")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(pause_waiting)
                scheduler = eng._handles.actors["scheduler"]
                await wait_until(lambda: scheduler._pausing is not None)  # it drains now
                with pytest.raises(engine.PauseConflictError, match="another pause") as info:
                    await eng.sleep(0)
                assert error_from_exception(info.value).status == 409
                await eng.resume_generation()
            got += [out async for out in stream]
        assert got[-1].finish_reason == "length" and len(token_ids(got)) == 400
        assert not await eng.is_paused()


async def test_wrong_calls_are_refused_and_change_nothing(folder: Path, tmp_path: Path) -> None:
    async with engine.open_engine(model=str(folder), **_options()) as eng:
        with pytest.raises(InvalidParamError, match="level"):
            await eng.sleep(3)
        with pytest.raises(InvalidParamError, match="mode"):
            await eng.pause_generation(mode="later")
        with pytest.raises(InvalidParamError, match="tags"):
            await eng.wake_up(["gpu"])
        await eng.sleep(1)
        with pytest.raises(InvalidParamError, match="wake_up"):
            await eng.resume_generation()
        await eng.sleep(1)  # no deeper: nothing to do
        await eng.wake_up()
        assert not await eng.is_paused()
        before = await _answer(eng, PROMPT)
        with pytest.raises(RequestFailedError, match="did not finish within"):
            await eng.collective_rpc("reload_weights", timeout=1e-6)
        assert await _answer(eng, PROMPT) == before  # the reload went on; the engine serves
    async with engine.open_engine(model=str(folder), block_size=BLOCK) as eng:
        with pytest.raises(InvalidParamError, match="enable_sleep_mode"):
            await eng.sleep(1)
        await eng.sleep(0)  # pausing needs no sleep mode
        await eng.wake_up()
        assert len(token_ids(await collect(eng, PROMPT, greedy(3)))) == 3
    with pytest.raises(ConfigError, match="enable_sleep_mode"):
        async with engine.open_engine(model=str(folder), device="cuda", enable_sleep_mode=True):
            pass


# -- the offline LLM and the routes --------------------------------------------------------------


def test_llm_sleeps_refuses_to_generate_asleep_and_wakes_to_the_same_answer(folder: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(folder), **_options()) as llm:
        (before,) = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
        llm.sleep(level=2)
        assert llm.is_sleeping()
        with pytest.raises(RequestError, match="wake_up"):
            llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
        llm.wake_up()
        assert not llm.is_sleeping()
        (after,) = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    assert after.outputs[0].token_ids == before.outputs[0].token_ids


async def test_a_draft_model_proposes_again_after_a_level_2_sleep(folder: Path, tmp_path: Path) -> None:
    """The draft model sleeps with the target (its KV cache, and at level 2 its weights,
    read again on waking): after the wake-up its proposals are accepted as before (a draft
    equal to the target: every one), and the answer is the target's own."""
    spec = {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 3}
    async with engine.open_engine(model=str(folder), **_options(speculative_config=spec)) as eng:
        before = await _answer(eng, PROMPT, 24)
        await eng.sleep(2)
        assert _runner(eng).drafter.model is None and _runner(eng).model is None
        await eng.wake_up()
        stats = eng.statistics()
        after = await _answer(eng, PROMPT, 24)
        accepted = eng.statistics().spec_accepted_tokens - stats.spec_accepted_tokens
        drafted = eng.statistics().spec_draft_tokens - stats.spec_draft_tokens
    assert after[0] == before[0]
    assert after[1] == pytest.approx(before[1], abs=LOGPROB_ATOL)
    assert drafted > 0 and accepted == drafted


def test_adapters_are_served_again_after_a_level_2_sleep(tmp_path: Path) -> None:
    """The LoRA slots go with the model; the adapters read stay, and fill the rebuilt
    model's slots again: each answer is the one it gave before the sleep, and differs
    from the base model's."""
    base = write_tiny_model(tmp_path / "base", "llama")
    write_peft_adapters(base, tmp_path, {"aa": dict(r=8, lora_alpha=16)}, seed=9)
    adapter = types.SimpleNamespace(lora_name="aa", lora_int_id=1, lora_path=str(tmp_path / "aa"))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": PROMPT}
    with LLM(str(base), **_options(enable_lora=True)) as llm:
        (tuned,) = llm.generate(prompt, params, lora_request=adapter, use_tqdm=False)
        (plain,) = llm.generate(prompt, params, use_tqdm=False)
        llm.sleep(level=2)
        llm.wake_up()
        (tuned_after,) = llm.generate(prompt, params, lora_request=adapter, use_tqdm=False)
        (plain_after,) = llm.generate(prompt, params, use_tqdm=False)
    assert tuned.outputs[0].token_ids != plain.outputs[0].token_ids
    assert tuned_after.outputs[0].token_ids == tuned.outputs[0].token_ids
    assert plain_after.outputs[0].token_ids == plain.outputs[0].token_ids


def test_the_dev_mode_routes_sleep_wake_pause_and_resume(folder: Path) -> None:
    def opened() -> Any:
        return engine.open_engine(model=str(folder), **_options())

    with ServerThread(opened, server_dev_mode=True) as server:
        url = server.base_url
        body = {"model": server.engine.model_name, "prompt": PROMPT, "max_tokens": 6,
                "temperature": 0}
        awake = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        reply = httpx.post(f"{url}/sleep?level=2", timeout=60)
        assert (reply.status_code, reply.content) == (200, b"")
        assert httpx.get(f"{url}/is_sleeping", timeout=60).json() == {"is_sleeping": True}
        assert _sleep_state(url) == "discard_all"
        # A request sent while it sleeps waits for the wake-up, then is answered.
        answered: list[Any] = []
        thread = threading.Thread(target=lambda: answered.append(
            httpx.post(f"{url}/v1/completions", json=body, timeout=120)))
        thread.start()
        thread.join(0.5)
        assert not answered
        assert httpx.post(f"{url}/resume", timeout=60).status_code == 400  # asleep: wake it
        assert httpx.post(f"{url}/wake_up?tags=weights", timeout=60).status_code == 200
        assert httpx.get(f"{url}/is_sleeping", timeout=60).json() == {"is_sleeping": True}
        assert _sleep_state(url) == "weights_offloaded"  # only the KV cache sleeps now
        assert httpx.post(f"{url}/wake_up?tags=kv_cache", timeout=60).status_code == 200
        thread.join(60)
        assert answered[0].status_code == 200
        assert answered[0].json()["choices"][0]["text"] == awake["choices"][0]["text"]
        assert httpx.get(f"{url}/is_sleeping", timeout=60).json() == {"is_sleeping": False}
        assert _sleep_state(url) == "awake"
        paused = httpx.post(f"{url}/pause?mode=keep", timeout=60)
        assert paused.json() == {"status": "paused"}
        assert httpx.get(f"{url}/is_paused", timeout=60).json() == {"is_paused": True}
        assert httpx.post(f"{url}/resume", timeout=60).json() == {"status": "resumed"}
        assert httpx.get(f"{url}/is_paused", timeout=60).json() == {"is_paused": False}
        for bad, param in [("/sleep?level=3", "level"), ("/sleep?level=one", "level"),
                           ("/sleep?level=1&mode=soon", "mode"), ("/wake_up?tags=gpu", "tags"),
                           ("/pause?clear_cache=maybe", "clear_cache"),
                           ("/pause?mode=abort&wait_for_inflight_requests=true", "wait_for_inflight_requests")]:
            refused = httpx.post(f"{url}{bad}", timeout=60)
            assert refused.status_code == 400, bad
            assert refused.json()["error"]["param"] == param
        reloaded = httpx.post(f"{url}/collective_rpc", json={"method": "reload_weights"}, timeout=60)
        assert reloaded.json() == {"results": [None]}
        for bad_body in ({"method": "execute_model"}, {"method": "reload_weights", "args": ["x"]}, {}):
            refused = httpx.post(f"{url}/collective_rpc", json=bad_body, timeout=60)
            assert refused.status_code == 400 and refused.json()["error"]["param"] in ("method", "args")
        again = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert again["choices"][0]["text"] == awake["choices"][0]["text"]
    with ServerThread(lambda: engine.open_engine(model=str(folder), block_size=BLOCK)) as server:
        for route in ("/sleep", "/wake_up", "/pause", "/resume", "/collective_rpc"):
            assert httpx.post(f"{server.base_url}{route}", timeout=60).status_code == 404
        assert httpx.get(f"{server.base_url}/is_paused", timeout=60).status_code == 404


def _sleep_state(url: str) -> str:
    """The state vLLM's engine_sleep_state gauge gives 1 (read with prometheus_client's
    parser); every other state must be 0."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=60).text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "engine:engine_sleep_state"]
    on = [s.labels["sleep_state"] for s in family.samples if s.value == 1.0]
    assert len(on) == 1 and len(family.samples) == 3
    return on[0]


def test_serve_takes_enable_sleep_mode() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    config = config_from_args(parser.parse_args(["--enable-sleep-mode"]))
    assert config.enable_sleep_mode is True
    assert config_from_args(parser.parse_args([])).enable_sleep_mode is False
    assert json.loads(config.to_json())["enable_sleep_mode"] is True


async def test_a_pause_goes_on_across_an_in_place_restart(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An actor that crashes while the engine is paused restarts paused: a request sent
    then waits for the resume, as it would have without the crash."""
    from engine.core.scheduler import Scheduler

    original = Scheduler.add_request

    def add_request(self: Any, request: Any) -> Any:
        if request.sample_id.startswith("victim"):
            raise RuntimeError("injected scheduler crash")
        return original(self, request)

    async with engine.open_engine(model=str(folder), max_engine_restarts=1, **_options()) as eng:
        before = await _answer(eng, PROMPT)
        await eng.pause_generation(mode="keep")
        monkeypatch.setattr(Scheduler, "add_request", add_request)
        with pytest.raises(engine.EngineDeadError):
            await collect(eng, PROMPT, greedy(2), request_id="victim")
        await wait_until(lambda: eng.restarts == 1 and not eng.restarting)
        assert await eng.is_paused()
        steps = eng.statistics().steps
        async with trio.open_nursery() as nursery:
            answer: list[Any] = []

            async def ask() -> None:
                answer.append(await _answer(eng, PROMPT))

            nursery.start_soon(ask)
            await wait_until(lambda: eng.statistics().waiting == 1)
            await trio.sleep(0.2)  # time for a step, had the new scheduler not been paused
            assert eng.statistics().steps == steps and not answer
            await eng.resume_generation()
        assert answer == [before]
