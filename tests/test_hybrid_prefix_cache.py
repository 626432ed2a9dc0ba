"""The prefix cache of a hybrid model (Mamba-2: Granite 4.0 H, Nemotron-H; Gated DeltaNet:
Qwen3.5): its recurrent layers' states kept at block boundaries ("state checkpoints",
engine.core.block_pool), so a later prompt sharing the prefix resumes from them. Each
answer is compared with transformers' greedy tokens on the whole prompt: a resumed
request whose states were not the prefix's would draw other tokens. The pool's side (which
boundary is kept, the hit cut to the deepest kept one, reuse) is in tests/test_block_pool.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from engine_helpers import collect, greedy, tiny_model, token_ids, wait_idle
from hybrid_helpers import prompts_of
from test_granite4_mamba import write_hybrid
from test_nemotron_h import write_nemotron_h
from test_parity import LOGPROB_ATOL, _hf_greedy
from test_qwen3_5 import write_qwen3_5

import engine
from engine.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 6
BLOCK = 4
WRITERS = {"granite4h": write_hybrid, "nemotron_h": write_nemotron_h, "qwen3_5": write_qwen3_5}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def model(request, tmp_path_factory) -> tuple[Any, Path]:
    folder = tmp_path_factory.mktemp(request.param) / "m"
    return WRITERS[request.param](folder), folder


def _options(**extra: Any) -> dict[str, Any]:
    return dict(dtype="float32", max_num_seqs=4, block_size=BLOCK, max_model_len=96) | extra


# transformers' greedy answer to each prompt, per model: the tests ask several engines the
# same prompt (the hybrid models' torch paths take seconds an answer). Each entry holds its
# model too: keyed by id(), a model collected after its module's parameter (the fixture's
# scope) could leave its id to the next family's model, which would then be handed the
# first one's answers (a fresh-clone run failed every Qwen3.5 case so).
_HF_ANSWERS: dict[tuple[int, tuple[int, ...]], tuple[Any, list[int], list[float]]] = {}


async def _answer(eng: Any, hf: Any, prompt: list[int]) -> int:
    """One request's tokens and their logprobs against transformers'; the prompt tokens it
    took from the cache."""
    outputs = await collect(eng, prompt, greedy(NEW_TOKENS, logprobs=0))
    key = (id(hf), tuple(prompt))
    if key not in _HF_ANSWERS:
        _HF_ANSWERS[key] = (hf, *_hf_greedy(hf, prompt, NEW_TOKENS))
    _, tokens, logprobs = _HF_ANSWERS[key]
    assert token_ids(outputs) == tokens
    got = torch.tensor([lp.logprob for out in outputs for lp in out.logprobs], dtype=torch.float64)
    torch.testing.assert_close(got, torch.tensor(logprobs, dtype=torch.float64), atol=LOGPROB_ATOL, rtol=0)
    return outputs[-1].usage.cached_tokens


async def test_a_longer_prompt_resumes_from_the_states_kept_inside_a_chunk(model) -> None:
    """The first prompt runs in one chunk: its states are kept at its last block boundary,
    inside the chunk (which runs in two parts around the copy), and the second prompt,
    the first with a turn added, resumes there."""
    hf, folder = model
    first = prompts_of((23,), 384, seed=3)[0]
    second = first + prompts_of((10,), 384, seed=4)[0]
    async with engine.open_engine(str(folder), **_options(max_num_batched_tokens=64)) as eng:
        assert await _answer(eng, hf, first) == 0
        assert await _answer(eng, hf, second) == len(first) // BLOCK * BLOCK
        # The first again: its whole prompt but the last token is cached, its states
        # only at the boundary before it.
        assert await _answer(eng, hf, first) == (len(first) - 1) // BLOCK * BLOCK
        await wait_idle(eng)


async def test_prompts_in_chunks_resume_from_the_last_boundary_kept(model) -> None:
    """A 12-token step budget cuts the 23-token prompt at 12: its chunks keep the states at
    12, then at 20 (inside the second chunk), and the longer prompt resumes at 20."""
    hf, folder = model
    first = prompts_of((23,), 384, seed=5)[0]
    second = first + prompts_of((9,), 384, seed=6)[0]
    async with engine.open_engine(str(folder), **_options(max_num_batched_tokens=12)) as eng:
        assert await _answer(eng, hf, first) == 0
        assert await _answer(eng, hf, second) == len(first) // BLOCK * BLOCK
        await wait_idle(eng)


async def test_the_next_turn_resumes_at_the_answers_last_block(model) -> None:
    """Decode steps keep the states too, each request its latest boundary only: a
    conversation's next turn (the prompt, the answer and more) resumes at the last full
    block of what the first turn computed. With one checkpoint, another prompt in
    between takes it, and the same turn again resumes nothing."""
    hf, folder = model
    first = prompts_of((23,), 384, seed=5)[0]
    other = prompts_of((14,), 384, seed=7)[0]
    more = prompts_of((5,), 384, seed=6)[0]
    computed = len(first) + NEW_TOKENS - 1  # the last output is drawn, never computed
    for checkpoints in (4, 1):
        async with engine.open_engine(str(folder), **_options(max_num_batched_tokens=64,
                                                              state_checkpoints=checkpoints)) as eng:
            answer = token_ids(await collect(eng, first, greedy(NEW_TOKENS)))
            turn = first + answer + more
            assert await _answer(eng, hf, turn) == computed // BLOCK * BLOCK
            assert await _answer(eng, hf, other) == 0
            # With room, the turn's own prompt kept its last boundary (all but its last token).
            resumed = await _answer(eng, hf, turn)
            assert resumed == (0 if checkpoints == 1 else (len(turn) - 1) // BLOCK * BLOCK)
            await wait_idle(eng)


async def test_a_shared_system_prompt_is_resumed_from_the_third_request_on(model) -> None:
    """Prompts sharing their first 15 tokens, then each its own: the first keeps its
    states past the shared part only; the second matches its cached blocks but no kept
    states, so it recomputes them and keeps the states at the junction (12, the shared
    part's last full block); the third and fourth resume there."""
    hf, folder = model
    shared = prompts_of((15,), 384, seed=13)[0]
    prompts = [shared + q for q in prompts_of((6, 9, 7, 8), 384, seed=14)]
    async with engine.open_engine(str(folder), **_options(max_num_batched_tokens=64)) as eng:
        cached = [await _answer(eng, hf, p) for p in prompts]
        await wait_idle(eng)
    junction = len(shared) // BLOCK * BLOCK
    assert cached == [0, 0, junction, junction]


async def test_requests_sharing_a_prefix_side_by_side(model) -> None:
    """Four requests at once, two of them the first two's prompts with more after: the
    longer ones, arriving later, resume where the shorter ones' states were kept."""
    hf, folder = model
    base = prompts_of((13, 18), 384, seed=8)
    prompts = base + [p + q for p, q in zip(base, prompts_of((7, 5), 384, seed=9), strict=True)]
    expected = [_hf_greedy(hf, p, NEW_TOKENS)[0] for p in prompts]
    async with engine.open_engine(str(folder), **_options(max_num_batched_tokens=64, state_checkpoints=8)) as eng:
        for offset in (0, 2):
            got: dict[int, list[int]] = {}
            streams = [await eng.submit(p, greedy(NEW_TOKENS)) for p in prompts[offset:offset + 2]]

            async def one(i: int, stream: Any, got=got) -> None:
                async with stream:
                    got[i] = [out async for out in stream]

            async with trio.open_nursery() as nursery:
                for i, stream in enumerate(streams):
                    nursery.start_soon(one, i, stream)
            for i, outputs in got.items():
                assert token_ids(outputs) == expected[offset + i]
                cached = outputs[-1].usage.cached_tokens
                assert cached == (0 if offset == 0 else len(base[i]) // BLOCK * BLOCK)
        stats = await wait_idle(eng)
    assert stats.prefix_cache_hits == sum(len(p) // BLOCK * BLOCK for p in base)


async def test_behind_an_engine_core_process(model) -> None:
    """The core process builds its pool with the checkpoints its runner keeps."""
    hf, folder = model
    first = prompts_of((22,), 384, seed=11)[0]
    second = first + prompts_of((6,), 384, seed=12)[0]
    async with engine.open_engine(str(folder), **_options(max_num_batched_tokens=64, engine_core="process")) as eng:
        assert await _answer(eng, hf, first) == 0
        assert await _answer(eng, hf, second) == len(first) // BLOCK * BLOCK
        await wait_idle(eng)


async def test_no_checkpoints_turns_the_cache_off(model) -> None:
    hf, folder = model
    first = prompts_of((21,), 384, seed=10)[0]
    for options in (dict(state_checkpoints=0), dict(enable_prefix_caching=False)):
        async with engine.open_engine(str(folder), **_options(max_num_batched_tokens=64, **options)) as eng:
            assert await _answer(eng, hf, first) == 0
            assert await _answer(eng, hf, first) == 0
            assert (await wait_idle(eng)).prefix_cache_queries == 0


async def test_checkpoints_are_refused_for_a_model_without_recurrent_layers(tmp_path_factory) -> None:
    with pytest.raises(ConfigError, match="state_checkpoints"):
        async with engine.open_engine(str(tiny_model(tmp_path_factory)), state_checkpoints=2):
            pass
