"""Speculative decoding (prompt lookup and Predicted Outputs): the output is the target
model's, greedy token for token and sampled in distribution, and no block is left behind."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import trio
from engine_helpers import collect, greedy, text, tiny_model, token_ids, wait_idle

import engine
from engine.config import EngineConfig
from engine.core.spec import propose
from engine.errors import ConfigError
from engine.params import SamplingParams

OPTIONS: dict[str, Any] = dict(
    dtype="float32", max_num_seqs=32, max_num_batched_tokens=96, block_size=16,
    kv_cache_memory=8 * 1024 * 1024,
)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory)


def _copying_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase (so prompt lookup has something to propose), some
    random ones, of lengths that cross block edges."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        phrase = [rng.randrange(3, 300) for _ in range(rng.randint(3, 12))]
        body = phrase * rng.randint(2, 5) if i % 4 else [rng.randrange(3, 300) for _ in range(40)]
        prompts.append(body[: rng.randint(5, 70)])
    return prompts


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match() -> None:
    ctx = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    # The suffix 1 2 3 last occurred at 5 (not the suffix itself): 7 8 5 follows.
    assert propose(ctx, None, 3, 3, 1) == (7, 8, 5)
    assert propose(ctx, None, 10, 3, 1) == (7, 8, 5, 1, 2, 3)
    assert propose([4, 5, 6], None, 3, 3, 1) == ()  # no earlier match
    assert propose([5, 6, 5], None, 2, 3, 2) == ()  # only n=1 would match; min is 2
    assert propose([5, 6, 5], None, 2, 3, 1) == (6, 5)
    # A prediction as the haystack: the continuation after the context's suffix in it.
    assert propose([1, 2, 3, 4], [9, 3, 4, 10, 11, 12], 2, 3, 1) == (10, 11)
    assert propose([1, 2], [2], 2, 3, 1) == ()  # matched at its end: nothing follows


def test_speculative_config_is_checked_at_config_time_naming_the_field() -> None:
    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert config.speculative is not None
    assert (config.speculative.num_speculative_tokens, config.speculative.prompt_lookup_max,
            config.speculative.prompt_lookup_min) == (3, 4, 1)
    assert EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 2, '
                        '"prompt_lookup_min": 2}').speculative.prompt_lookup_max == 2
    for bad in ("{", "[1]", '{"method": "medusa", "num_speculative_tokens": 2}',
                '{"method": "ngram"}', '{"method": "ngram", "num_speculative_tokens": 0}',
                '{"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}',
                '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, '
                '"prompt_lookup_max": 2}',
                '{"method": "draft_model", "model": "x", "num_speculative_tokens": 2}'):
        with pytest.raises(ConfigError) as info:
            EngineConfig(speculative_config=bad)
        assert info.value.field == "speculative_config"


async def _run_all(eng: Any, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[Any]]:
    results: list[list[Any]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        results[i] = await collect(eng, prompts[i], params[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return results


@pytest.mark.parametrize(("async_scheduling", "count", "max_tokens"), [(False, 6, 128), (True, 3, 32)])
async def test_greedy_output_is_the_same_with_and_without_prompt_lookup(
    model: Path, async_scheduling: bool, count: int, max_tokens: int
) -> None:
    prompts = _copying_prompts(count, seed=3)
    # Mixed in one batch: some requests speculate, a structured-output-free greedy one with
    # logprobs, one with penalties and min_tokens (applied per verified position).
    params = [greedy(max_tokens, logprobs=2) if i % 5 == 0 else
              greedy(max_tokens, repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=20)
              if i % 5 == 1 else greedy(max_tokens) for i in range(len(prompts))]
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        plain = await _run_all(eng, prompts, params)
    async with engine.open_engine(str(model), **OPTIONS, speculative_config=NGRAM,
                                  async_scheduling=async_scheduling) as eng:
        spec = await _run_all(eng, prompts, params)
        stats = await wait_idle(eng)
    for a, b in zip(plain, spec, strict=True):
        assert token_ids(b) == token_ids(a)
        lp_a = [(t.token_id, round(t.logprob, 3)) for o in a if o.logprobs for t in o.logprobs]
        lp_b = [(t.token_id, round(t.logprob, 3)) for o in b if o.logprobs for t in o.logprobs]
        assert lp_b == lp_a
    assert stats.spec_drafts > 0 and 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens
    assert sum(stats.spec_accepted_per_pos) == stats.spec_accepted_tokens
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_stop_strings_stop_tokens_and_aborts_mid_proposal_leave_no_block(model: Path) -> None:
    prompts = _copying_prompts(4, seed=5)
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        full = await _run_all(eng, prompts, [greedy(32)] * len(prompts))
    async with engine.open_engine(str(model), **OPTIONS, speculative_config=NGRAM) as eng:
        for p, f in zip(prompts, full, strict=True):
            ids, whole = token_ids(f), text(f)
            stop_id = ids[len(ids) // 2]
            out = await collect(eng, p, greedy(32, stop_token_ids=[stop_id]))
            assert token_ids(out) == ids[: ids.index(stop_id) + 1]
            stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
            if stop.strip():
                out = await collect(eng, p, greedy(32, stop=[stop]))
                assert text(out) == whole[: whole.index(stop)]
        # Aborts while proposals are in flight.
        with trio.move_on_after(0.3):
            await _run_all(eng, prompts[:2], [greedy(400)] * 2)
        stats = await wait_idle(eng)
    assert stats.spec_drafts > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_n_samples_and_a_grammar_request_beside_speculating_ones(model: Path) -> None:
    prompts = _copying_prompts(4, seed=7)
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        plain = await collect(eng, prompts[1], SamplingParams(n=3, temperature=1.0, seed=11,
                                                              max_tokens=32, ignore_eos=True))
    async with engine.open_engine(str(model), **OPTIONS, speculative_config=NGRAM) as eng:
        spec = await collect(eng, prompts[1], SamplingParams(n=3, temperature=1.0, seed=11,
                                                             max_tokens=32, ignore_eos=True))
        stats = await wait_idle(eng)
    # Seeded samples: each position draws with the same per-step seed as without speculation.
    for i in range(3):
        assert len(token_ids(spec, i)) == 32
        assert token_ids(spec, i) == token_ids(plain, i)
    assert stats.kv_blocks_free == stats.kv_blocks_total
