"""How prompts are cut into prefill chunks: vLLM's ``--no-enable-chunked-prefill`` (every
prompt whole in one step) and ``--long-prefill-token-threshold`` (no request's chunk past
N tokens).

Whole prompts: the policy (a prompt that does not fit what is left of a step waits for
the next, where it goes first; a preempted request recomputes its prompt and outputs
whole) against the same requests with chunking on; the engine's answers against
transformers'; the step budget raised to hold the longest input, or a budget set lower
refused. The threshold: each prefill chunk capped, decodes never; the answers against
transformers'. And the flags."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import trio
from engine_helpers import collect, greedy, token_ids
from test_parity import _hf_greedy, _hf_model
from test_scheduler import _add, _chunks, _plan, _update

import engine
from engine.cli.args import config_from_args
from engine.cli.serve import add_serve_arguments
from engine.config import EngineConfig
from engine.core import BlockPool, Scheduler, SchedulerConfig
from engine.errors import ConfigError
from engine.models.testing import write_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _scheduler(whole: bool, caching: bool = True, threshold: int = 0) -> tuple[Scheduler, BlockPool]:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, block_size=4,
                             max_model_len=16, num_kv_blocks=64, whole_prompts=whole,
                             enable_prefix_caching=caching, long_prefill_token_threshold=threshold)
    return Scheduler(config), BlockPool(64, 4, enable_prefix_caching=caching)


def test_a_prompt_that_does_not_fit_the_step_waits_whole_for_the_next() -> None:
    plans = {}
    for whole in (False, True):
        sched, pool = _scheduler(whole)
        _add(sched, "a", 10, max_tokens=4)
        _add(sched, "b", 10, max_tokens=4)
        first = _plan(sched, pool)
        _update(sched, pool, first)
        plans[whole] = (_chunks(first), _chunks(_plan(sched, pool)))
    # Chunked: b takes the 6 tokens left of the first step, then its last 4.
    assert plans[False] == ([("a", 0, 10, True), ("b", 0, 6, False)],
                            [("a", 10, 1, True), ("b", 6, 4, True)])
    # Whole: b waits, then runs all 10 at once beside a's decode.
    assert plans[True] == ([("a", 0, 10, True)], [("a", 10, 1, True), ("b", 0, 10, True)])


def test_a_preempted_request_recomputes_its_prompt_and_outputs_whole() -> None:
    # No prefix cache: with one, the recompute would start past the prompt's cached blocks.
    sched, pool = _scheduler(True, caching=False)
    _add(sched, "a", 8, max_tokens=8)
    for _ in range(3):  # the prompt, then two decodes: 8 prompt tokens and 3 outputs
        _update(sched, pool, _plan(sched, pool))
    preempt = sched.preempt_running()
    try:
        call = next(preempt)
        while True:
            call = preempt.send(pool.handle(call))
    except StopIteration as done:
        assert done.value == 1
    _add(sched, "b", 6, max_tokens=2)  # arrives after: a goes first, whole
    plan = _plan(sched, pool)
    assert _chunks(plan) == [("a", 0, 11, True)]  # 11 of 16: b's 6 do not fit, b waits
    _update(sched, pool, plan)
    assert _chunks(_plan(sched, pool)) == [("a", 11, 1, True), ("b", 0, 6, True)]


def test_the_threshold_caps_each_prefill_chunk_and_never_a_decode() -> None:
    sched, pool = _scheduler(False, threshold=4)
    _add(sched, "a", 10, max_tokens=4)
    plans = []
    for _ in range(3):
        plan = _plan(sched, pool)
        plans.append(_chunks(plan))
        _update(sched, pool, plan)
        if len(plans) == 1:
            _add(sched, "b", 7, max_tokens=4)  # arrives while a prefills
    assert plans == [[("a", 0, 4, False)],
                     [("a", 4, 4, False), ("b", 0, 4, False)],
                     [("a", 8, 2, True), ("b", 4, 3, True)]]  # 2 and 3 left: under the cap
    assert _chunks(_plan(sched, pool)) == [("a", 10, 1, True), ("b", 7, 1, True)]


async def test_answers_match_transformers_and_the_budget_holds_the_longest_input(tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "llama", "llama")
    hf = _hf_model(folder)
    prompts = [[(7 * i + 3 + j) % 200 + 3 for i in range(90 + 5 * j)] for j in range(3)]
    async with engine.open_engine(model=str(folder), dtype="float32", max_model_len=128,
                                  max_num_batched_tokens=128, enable_chunked_prefill=False) as eng:
        answers: dict[int, list[int]] = {}
        async with trio.open_nursery() as nursery:
            for j, prompt in enumerate(prompts):
                async def one(j: int = j, prompt: list[int] = prompt) -> None:
                    answers[j] = token_ids(await collect(eng, prompt, greedy(6)))
                nursery.start_soon(one)
    for j, prompt in enumerate(prompts):
        assert answers[j] == _hf_greedy(hf, prompt, 6)[0]
    # Prefill chunks of at most 16 tokens (prompts of 90 to 100): the same answers.
    async with engine.open_engine(model=str(folder), dtype="float32",
                                  long_prefill_token_threshold=16) as eng:
        before = eng.statistics().steps
        assert token_ids(await collect(eng, prompts[2], greedy(6))) == _hf_greedy(hf, prompts[2], 6)[0]
        # 7 prefill steps (one without the threshold), then 5 decodes.
        assert eng.statistics().steps - before >= -(-len(prompts[2]) // 16) + 5
    # Left at its default (2048), the budget grows to the context (as vLLM's).
    async with engine.open_engine(model=str(folder), max_model_len=3000, enable_chunked_prefill=False,
                                  hf_overrides={"max_position_embeddings": 4096}) as eng:
        assert eng.config.max_num_batched_tokens == 3000
    with pytest.raises(ConfigError, match="no-enable-chunked-prefill") as info:
        async with engine.open_engine(model=str(folder), max_model_len=256, max_num_batched_tokens=128,
                                      enable_chunked_prefill=False):
            pass
    assert info.value.field == "max_num_batched_tokens"


def test_the_flags_parse() -> None:
    for bad in ({"long_prefill_token_threshold": -1},
                {"long_prefill_token_threshold": 64, "enable_chunked_prefill": False}):
        with pytest.raises(ConfigError) as info:
            EngineConfig(**bad)
        assert info.value.field == "long_prefill_token_threshold"
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert config_from_args(parser.parse_args(["--long-prefill-token-threshold", "256"])
                            ).long_prefill_token_threshold == 256
    assert not config_from_args(parser.parse_args(["--no-enable-chunked-prefill"])).enable_chunked_prefill
    assert config_from_args(parser.parse_args(["--enable-chunked-prefill"])).enable_chunked_prefill
    args = parser.parse_args(["--calculate-kv-scales", "--kv-cache-dtype", "int8"])
    assert config_from_args(args).kv_cache_dtype == "int8"
    assert [n.split(":")[0] for n in args.vllm_no_ops] == ["--calculate-kv-scales"]
