"""The KV pool's memory is resident only where blocks have been used (CPU)."""

from __future__ import annotations

import types

import torch
from engine_helpers import collect, greedy, random_prompts, tiny_model, token_ids

import engine
from engine.runner.kv_cache import allocate_kv_caches, resident_bytes

GIB = 1024**3


async def test_a_large_pool_with_a_small_workload_stays_far_below_the_pool_size(tmp_path_factory) -> None:
    model = tiny_model(tmp_path_factory)
    before = resident_bytes()
    # 1 GiB of pool (2M tokens of the tiny model) against a workload of a few hundred.
    async with engine.open_engine(
        str(model), dtype="float32", block_size=16, kv_cache_memory=GIB, max_num_batched_tokens=64
    ) as eng:
        stats = eng.statistics()
        prompts = random_prompts(8, vocab=300, lo=5, hi=60, seed=3)
        outs = [token_ids(await collect(eng, p, greedy(8))) for p in prompts]
        grown = resident_bytes() - before
    assert stats.kv_blocks_total * 16 * 512 >= GIB - 16 * 512  # the pool is the budget
    assert all(len(o) == 8 for o in outs)
    # torch.zeros made this 1 GiB and more; what remains is the model, the allocator's
    # per-block bookkeeping (~30 MB for 131k blocks) and the pages the workload touched.
    assert grown < GIB // 4, f"resident memory grew by {grown / 2**20:.0f} MiB"


def test_a_lazily_mapped_pool_reads_as_zeros_and_keeps_each_layers_writes_apart() -> None:
    cfg = types.SimpleNamespace(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=8)
    before = resident_bytes()
    caches = allocate_kv_caches(cfg, 100_000, 16, torch.bfloat16, "cpu")  # ~293 MiB
    assert resident_bytes() - before < 32 * 2**20  # nothing touched yet
    assert len(caches) == 3
    for i, (k, v) in enumerate(caches):
        assert k.shape == v.shape == (100_000, 16, 2, 8) and k.dtype == torch.bfloat16
        k[7].fill_(i + 1)
        v[99_999].fill_(-(i + 1))
    for i, (k, v) in enumerate(caches):
        assert bool((k[7] == i + 1).all()) and bool((v[99_999] == -(i + 1)).all())
        assert not k[8].any() and not v[99_998].any() and not k[50_000].any()
