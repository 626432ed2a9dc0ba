"""The MoE families transformers writes (gpt-oss, GLM-4.5, DeepSeek-V3) through the whole
engine rather than the model runner alone: requests batched together, prompts prefilled in
chunks of a small step budget, a second round whose prompts share a cached prefix, and
every KV block free after. The oracle is transformers' greedy decoding of the same prompts
from the same folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio
from engine_helpers import collect, greedy, token_ids, wait_idle
from hf_written import write_deepseek_v3, write_glm
from test_parity import _hf_greedy, _prompts
from transformers import AutoModelForCausalLM

import engine
from engine.models.testing_gpt_oss import write_gpt_oss

NEW_TOKENS = 8
# A step budget of 12 tokens: the second round's prompts (up to 16 tokens) prefill in
# chunks, beside other requests' decode rows.
OPTIONS = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=12, block_size=4,
               kv_cache_memory=4 * 1024 * 1024, max_model_len=256)
WRITERS = {
    "gpt_oss": lambda folder: write_gpt_oss(folder),
    "glm4_moe": lambda folder: write_glm(folder),
    "deepseek_v3": lambda folder: write_deepseek_v3(folder),
}


@pytest.fixture(scope="module", params=list(WRITERS))
def family(request, tmp_path_factory) -> tuple[Path, list[list[int]], list[list[int]]]:
    folder = tmp_path_factory.mktemp(request.param) / "m"
    WRITERS[request.param](folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    prompts = _prompts(hf.config.vocab_size)[:3]
    # The second round: each prompt after the longest one's tokens (8: two whole blocks,
    # cached by the first round).
    longest = max(prompts, key=len)
    assert len(longest) >= 2 * OPTIONS["block_size"]
    shared = [longest + p for p in prompts]
    expected = [_hf_greedy(hf, p, NEW_TOKENS)[0] for p in prompts + shared]
    return folder, prompts + shared, expected


async def test_batched_chunked_and_prefix_cached_requests_match_transformers(family) -> None:
    folder, prompts, expected = family
    async with engine.open_engine(str(folder), **OPTIONS) as eng:
        first, second = prompts[:3], prompts[3:]
        assert len(second) == 3
        for batch, offset in ((first, 0), (second, 3)):
            results: dict[int, list[int]] = {}

            async def one(i: int, prompt: list[int], results=results) -> None:
                results[i] = token_ids(await collect(eng, prompt, greedy(NEW_TOKENS)))

            async with trio.open_nursery() as nursery:
                for i, prompt in enumerate(batch):
                    nursery.start_soon(one, offset + i, prompt)
            assert [results[offset + i] for i in range(len(batch))] == expected[offset:offset + len(batch)]
        stats = await wait_idle(eng)
        assert stats.prefix_cache_hits > 0  # the second round read the first prompt's blocks
