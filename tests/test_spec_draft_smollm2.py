"""Speculative decoding with a draft model on the real SmolLM2 (its own module: the tiny
models' module runs torch on one thread, which would slow this one)."""

from __future__ import annotations

import pytest
from engine_helpers import greedy, token_ids, wait_idle
from test_spec_draft import _run_all

import engine


@pytest.mark.slow
async def test_smollm2_greedy_is_the_same_with_its_q4_1_gguf_as_draft() -> None:
    """SmolLM2-135M dequantized to fp32 as the target (the path the other SmolLM2 parity
    checks use: the kept-quantized path's several-row matmuls round differently from one
    row), its own Q4_1 GGUF kept in its blocks as the draft: 128 greedy tokens on two chats
    are the plain engine's, and the draft is right most of the time."""
    from engine.models.loader import resolve_model

    gguf = str(resolve_model(None))
    chats = [
        [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
        [{"role": "user", "content": "List ten fruits and say one thing about each."}],
    ]
    options = dict(kv_cache_memory=64 * 2**20, dtype="float32", quantization="none")
    params = [greedy(128), greedy(128)]
    async with engine.open_engine(None, **options) as eng:
        plain = await _run_all(eng, chats, params)
    draft = {"method": "draft_model", "model": gguf, "num_speculative_tokens": 4,
             "quantization": "gguf"}
    async with engine.open_engine(None, **options, speculative_config=draft) as eng:
        spec = await _run_all(eng, chats, params)
        stats = await wait_idle(eng)
    assert [token_ids(o) for o in spec] == [token_ids(o) for o in plain]
    assert stats.spec_accepted_tokens / stats.spec_draft_tokens > 0.5, stats
    assert stats.kv_blocks_free == stats.kv_blocks_total
