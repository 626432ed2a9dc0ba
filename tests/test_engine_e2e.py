"""End to end through the actor engine on a tiny float32 model."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import trio
from engine_helpers import (
    collect,
    greedy,
    random_prompts,
    text,
    tiny_model,
    token_ids,
    wait_idle,
)

import engine
from engine.chat.template import apply_chat_template
from engine.errors import InvalidParamError, PromptTooLongError
from engine.params import SamplingParams

# 16-token blocks and a 64-token step budget: prompts up to 90 tokens span several blocks
# and are prefilled in chunks over several steps.
# A 4 MiB pool (8192 tokens at 512 bytes a token) keeps start-up fast.
ENGINE_OPTIONS: dict[str, Any] = dict(
    dtype="float32", max_num_seqs=64, max_num_batched_tokens=64, block_size=16,
    kv_cache_memory=4 * 1024 * 1024,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory)


@pytest.fixture(autouse=True, params=["inprocess", "process"])
def engine_core(request: pytest.FixtureRequest) -> Any:
    """Every test here runs with the engine core in the test's process and in an
    engine-core process of its own (issue 20): the same behaviour through the wire."""
    ENGINE_OPTIONS["engine_core"] = request.param
    yield request.param
    ENGINE_OPTIONS.pop("engine_core")


async def _alone(eng: Any, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    return [token_ids(await collect(eng, p, greedy(m))) for p, m in zip(prompts, max_tokens, strict=True)]


async def _together(eng: Any, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    results: list[list[int]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        results[i] = token_ids(await collect(eng, prompts[i], greedy(max_tokens[i])))

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return results


@pytest.mark.parametrize("async_scheduling", [True, False])
async def test_64_concurrent_greedy_requests_give_the_tokens_each_gives_alone(
    model: Path, async_scheduling: bool
) -> None:
    prompts = random_prompts(64, vocab=300, lo=1, hi=70, seed=1)
    max_tokens = [1 + (5 * i) % 8 for i in range(64)]  # 1..8 new tokens, mixed
    options = dict(ENGINE_OPTIONS, async_scheduling=async_scheduling)
    async with engine.open_engine(str(model), **options) as eng:
        alone = await _alone(eng, prompts, max_tokens)
        together = await _together(eng, prompts, max_tokens)
        stats = await wait_idle(eng)
        planned_ahead = stats.planned_ahead
    assert together == alone
    assert [len(t) for t in together] == max_tokens
    assert stats.requests_finished == 128
    # Planning ahead happens exactly when it is asked for.
    assert (planned_ahead > 0) == async_scheduling


@pytest.mark.parametrize("async_scheduling", [True, False])
async def test_a_pool_too_small_for_all_preempts_and_still_gives_the_same_tokens(
    model: Path, async_scheduling: bool
) -> None:
    prompts = random_prompts(8, vocab=300, lo=60, hi=60, seed=2)
    max_tokens = [12] * 8
    async with engine.open_engine(str(model), **ENGINE_OPTIONS) as eng:
        alone = await _alone(eng, prompts, max_tokens)
    # 8 blocks of 16 tokens (512 bytes a token in fp32: 2 layers x 2 KV heads x 16 dims x
    # K and V x 4 bytes) hold one request of up to 128 tokens but not 8 of 72 at once. Every
    # prompt fills 4 blocks and needs a 5th at its 5th output, so whichever two requests run
    # together (arrival order is trio's, which varies from run to run), the first to cross
    # finds no block free and one is preempted: prompts of mixed lengths could pack without
    # a preemption in some orders, which made this test fail now and then.
    small = dict(ENGINE_OPTIONS, kv_cache_memory=8 * 16 * 512, async_scheduling=async_scheduling)
    async with engine.open_engine(str(model), **small) as eng:
        together = await _together(eng, prompts, max_tokens)
        stats = await wait_idle(eng)
    assert together == alone
    assert stats.preemptions > 0
    assert stats.kv_blocks_total == 8


async def test_a_shared_prefix_is_computed_once_and_gives_the_same_tokens(model: Path) -> None:
    prefix = random_prompts(1, vocab=300, lo=64, hi=64, seed=3)[0]  # four full blocks
    first, second = prefix + [5, 6, 7], prefix + [9, 10]
    async with engine.open_engine(str(model), **ENGINE_OPTIONS, enable_prefix_caching=False) as eng:
        expected = token_ids(await collect(eng, second, greedy(12)))
    async with engine.open_engine(str(model), **ENGINE_OPTIONS) as eng:
        await collect(eng, first, greedy(12))
        before = await wait_idle(eng)
        got = token_ids(await collect(eng, second, greedy(12)))
        after = await wait_idle(eng)
        computed = after.scheduled_tokens - before.scheduled_tokens
    assert got == expected
    assert after.prefix_cache_hits - before.prefix_cache_hits == 64
    assert after.prefix_cache_queries - before.prefix_cache_queries == len(second)
    # Only the 2 new prompt tokens, then one per output but the last (never fed back).
    assert computed == 2 + 11


async def test_bad_requests_raise_typed_errors_and_the_engine_keeps_serving(model: Path) -> None:
    with pytest.raises(InvalidParamError) as bad_temperature:
        SamplingParams(temperature=-0.5)
    assert bad_temperature.value.param == "temperature"
    with pytest.raises(InvalidParamError) as bad_top_p:
        SamplingParams(top_p=0.0)
    assert bad_top_p.value.param == "top_p"
    async with engine.open_engine(str(model), **ENGINE_OPTIONS, max_model_len=128) as eng:
        with pytest.raises(PromptTooLongError) as too_long:
            await eng.submit(list(range(3, 123)), greedy(16))
        assert (too_long.value.prompt_tokens, too_long.value.max_model_len) == (120, 128)
        with pytest.raises(InvalidParamError) as bad_token:
            await eng.submit([3, 4, 100_000], greedy(4))
        assert bad_token.value.param == "prompt"
        with pytest.raises(InvalidParamError) as empty:
            await eng.submit([], greedy(4))
        assert empty.value.param == "prompt"
        with pytest.raises(InvalidParamError):
            await eng.submit(object(), greedy(4))  # type: ignore[arg-type]
        # A lone surrogate (what JSON's "\ud800" decodes to) is the request's error; the
        # tokenizer's TypeError used to crash the processor actor (now gone) and kill the engine.
        with pytest.raises(InvalidParamError) as surrogate:
            await eng.submit("a\ud800b", greedy(4))
        assert surrogate.value.param == "prompt"
        with pytest.raises(InvalidParamError) as chat_surrogate:
            await eng.submit([{"role": "user", "content": "x\udfff"}], greedy(4))
        assert chat_surrogate.value.param == "messages"
        outputs = await collect(eng, [3, 4, 5], greedy(4))
        stats = await wait_idle(eng)
    assert len(token_ids(outputs)) == 4
    assert outputs[-1].finish_reason == "length"
    assert outputs[-1].usage == engine.Usage(prompt_tokens=3, completion_tokens=4)
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_max_tokens_none_runs_to_the_end_of_the_context(model: Path) -> None:
    async with engine.open_engine(str(model), **ENGINE_OPTIONS, max_model_len=40) as eng:
        outputs = await collect(eng, list(range(3, 33)), SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert len(token_ids(outputs)) == 10
    assert outputs[-1].finish_reason == "length"


async def test_a_stop_string_ends_the_text_before_it_and_frees_the_blocks(model: Path) -> None:
    prompt = "The quick brown fox"
    async with engine.open_engine(str(model), **ENGINE_OPTIONS) as eng:
        full = text(await collect(eng, prompt, greedy(24)))
        stop = full[len(full) // 2 : len(full) // 2 + 2]
        assert stop.strip(), f"pick a visible stop string from {full!r}"
        outputs = await collect(eng, prompt, greedy(24, stop=[stop]))
        # min_tokens covers every output: the stop string may not end any of their text.
        shielded = await collect(eng, prompt, greedy(24, stop=[stop], min_tokens=24))
        stats = await wait_idle(eng)
    assert text(outputs) == full[: full.index(stop)]
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", stop)
    assert text(shielded) == full and shielded[-1].finish_reason == "length"
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_a_stop_token_ends_the_request_and_its_text_is_left_out(model: Path) -> None:
    prompt = "The quick brown fox"
    async with engine.open_engine(str(model), **ENGINE_OPTIONS) as eng:
        full = await collect(eng, prompt, greedy(24))
        ids = token_ids(full)
        stop_id = ids[len(ids) // 2]
        first = ids.index(stop_id)
        outputs = await collect(eng, prompt, greedy(24, stop_token_ids=[stop_id]))
        kept = await collect(eng, prompt, greedy(24, stop_token_ids=[stop_id],
                                                 include_stop_str_in_output=True))
        before = text(await collect(eng, prompt, greedy(first))) if first else ""
        through = text(await collect(eng, prompt, greedy(first + 1)))
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", stop_id)
    # The id is an output (usage counts it); its text is not, as in vLLM, unless asked for.
    assert token_ids(outputs) == ids[: first + 1]
    assert outputs[-1].usage.completion_tokens == first + 1
    assert text(outputs) == before
    assert token_ids(kept) == ids[: first + 1] and text(kept) == through


async def test_n_samples_share_the_prompt_blocks_and_draw_distinct_seeded_streams(model: Path) -> None:
    prompt = random_prompts(1, vocab=300, lo=48, hi=48, seed=4)[0]  # three full blocks
    params = SamplingParams(n=3, temperature=1.0, max_tokens=16, seed=1234, ignore_eos=True)
    async with engine.open_engine(str(model), **ENGINE_OPTIONS) as eng:
        first = await collect(eng, prompt, params, request_id="many")
        stats = await wait_idle(eng)
        again = await collect(eng, prompt, params)
        single = [
            token_ids(await collect(eng, prompt, params.replace(n=1, seed=1234 + i)))
            for i in range(3)
        ]
    samples = [token_ids(first, i) for i in range(3)]
    assert {out.request_id for out in first} == {"many"}
    assert all(len(s) == 16 for s in samples)
    assert len({tuple(s) for s in samples}) == 3  # distinct streams
    assert samples == [token_ids(again, i) for i in range(3)] == single  # seed + i
    # Samples 1 and 2 take the first sample's three prompt blocks from the prefix cache.
    # (a hit never covers the last prompt token, whose logits must be computed: 2 blocks)
    assert stats.prefix_cache_hits == 2 * 32
    assert sum(out.finished for out in first) == 3


async def test_greedy_logprobs_rank_the_sampled_token_first(model: Path) -> None:
    async with engine.open_engine(str(model), **ENGINE_OPTIONS) as eng:
        outputs = await collect(eng, "Hello world", greedy(6, logprobs=3))
    logprobs = [lp for out in outputs for lp in (out.logprobs or ())]
    assert [lp.token_id for lp in logprobs] == token_ids(outputs)
    for lp in logprobs:
        assert len(lp.top) == 3
        assert lp.top[0][0] == lp.token_id
        assert lp.top[0][1] == pytest.approx(lp.logprob)
        assert lp.logprob <= 0.0


async def test_chat_messages_go_through_the_chat_template(model: Path) -> None:
    messages = [{"role": "user", "content": "Hello world!"}]
    async with engine.open_engine(str(model), **ENGINE_OPTIONS) as eng:
        stream = await eng.submit(messages, greedy(4))
        async with stream:
            outputs = [out async for out in stream]
        rendered = apply_chat_template(eng.tokenizer, messages, add_generation_prompt=True)
        expected = tuple(eng.tokenizer.encode(rendered, add_special_tokens=False))
    assert stream.prompt_token_ids == expected
    assert len(token_ids(outputs)) == 4


async def test_prompt_logprobs_equal_transformers_over_chunks_and_skip_the_prefix_cache(
    model: Path,
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    # 90 tokens: prefilled in two chunks (64-token budget); the first run caches its blocks,
    # which the prompt_logprobs runs must not reuse (cached positions are never scored).
    prompt = random_prompts(1, vocab=300, lo=90, hi=90, seed=7)[0]
    async with engine.open_engine(str(model), **ENGINE_OPTIONS) as eng:
        plain = await collect(eng, prompt, greedy(2))
        scored = await collect(eng, prompt, greedy(2, prompt_logprobs=3))
        pair = await collect(eng, prompt, SamplingParams(n=2, max_tokens=2, prompt_logprobs=0, seed=5))
    assert plain[0].prompt_logprobs is None
    assert token_ids(scored) == token_ids(plain)  # scoring the prompt changes no output
    got = scored[0].prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    assert all(out.prompt_logprobs is None for out in scored[1:])  # only the first output

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    for i in range(1, len(prompt)):
        entry = got[i]
        assert entry.token_id == prompt[i]
        assert abs(entry.logprob - want[i - 1, prompt[i]].item()) < 1e-4  # fp32 summation order
        values, ids = want[i - 1].topk(3)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert all(abs(v - w) < 1e-4 for (_, v), w in zip(entry.top, values.tolist(), strict=True))
    # Every sample of n > 1 scores the prompt itself (0 alternatives asked: none given).
    for index in (0, 1):
        first = next(out for out in pair if out.index == index)
        assert [e.logprob for e in first.prompt_logprobs[1:]] == pytest.approx(
            [e.logprob for e in got[1:]], abs=1e-5
        )
        assert all(e.top == () for e in first.prompt_logprobs[1:])


async def test_long_and_short_requests_on_a_windowed_model_with_preemption_give_their_solo_tokens(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The tiny Mistral slides an 8-token window over every layer: prompts 3 to 7 times
    the window, mixed with short ones, through a pool too small for all of them at once."""
    windowed = tiny_model(tmp_path_factory, "mistral")
    long = random_prompts(6, vocab=300, lo=24, hi=60, seed=7)
    short = random_prompts(3, vocab=300, lo=2, hi=7, seed=8)
    prompts = long[:3] + short + long[3:]
    max_tokens = [12] * len(prompts)
    async with engine.open_engine(str(windowed), **ENGINE_OPTIONS) as eng:
        alone = await _alone(eng, prompts, max_tokens)
    # 5 blocks of 16 tokens hold one long request (at most 72 tokens), not all nine, even
    # though each gives back the blocks that fall out of the window as it goes.
    # Whether a step runs out of blocks depends on how the nine submissions interleave with
    # the first steps (trio shuffles its run queue), so a run that happened to preempt
    # nothing is tried again; every run must give the solo tokens.
    small = dict(ENGINE_OPTIONS, kv_cache_memory=5 * 16 * 512)
    for _attempt in range(5):
        async with engine.open_engine(str(windowed), **small) as eng:
            together = await _together(eng, prompts, max_tokens)
            stats = await wait_idle(eng)
        assert together == alone
        if stats.preemptions:
            break
    assert stats.preemptions > 0
    assert stats.kv_blocks_total == 5


async def test_a_request_far_longer_than_the_window_holds_few_blocks_and_matches_transformers(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Every layer of the tiny Mistral slides an 8-token window, so the scheduler gives back
    each block once no layer can read it: a 400-token prompt plus 32 tokens holds a handful
    of its 27 blocks at any time, and still decodes transformers' greedy tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    windowed = tiny_model(tmp_path_factory, "mistral")
    prompt = random_prompts(1, vocab=300, lo=400, hi=400, seed=9)[0]
    hf = AutoModelForCausalLM.from_pretrained(windowed, dtype=torch.float32).eval()
    want = hf.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0,
    )[0, len(prompt):].tolist()  # fmt: skip
    async with engine.open_engine(str(windowed), **ENGINE_OPTIONS) as eng:
        total = eng.statistics().kv_blocks_total
        most_held = 0
        stream = await eng.submit(prompt, greedy(32))
        got: list[int] = []
        async with stream:
            async for out in stream:
                got.extend(out.token_ids)
                most_held = max(most_held, total - eng.statistics().kv_blocks_free)
        await wait_idle(eng)
    assert got == want
    # A 64-token chunk sees its 7 keys before it: 71 tokens, at most 6 blocks of 16 (one
    # more while the next step's chunk is planned ahead); without release 27.
    assert 0 < most_held <= 7


async def test_enable_log_outputs_logs_each_samples_text_and_ids_as_it_finishes(
    model: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM's --enable-log-outputs: one line per finished sample, its ids the tokens it
    gave and its text what transformers' tokenizer decodes of them, cut to max_log_len."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    caplog.set_level(logging.INFO, logger="engine")
    async with engine.open_engine(model, **ENGINE_OPTIONS, enable_log_outputs=True,
                                  max_log_len=5) as eng:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=2)
        stream = await eng.submit([5, 17, 42, 99], params, request_id="logged")
        async with stream:
            outs = [out async for out in stream]
    ids = [t for o in outs if o.index == 0 for t in o.token_ids]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Generated response logged")]
    assert len(lines) == 2  # a line per sample
    first = next(line for line in lines if "(sample" not in line)
    assert f"output: {tok.decode(ids, skip_special_tokens=True)[:5]!r}" in first
    assert f"output_token_ids: {ids[:5]}, finish_reason: length" in first
