"""What the hybrid (Mamba-2) families' tests share: drawing a model's per-head Mamba
parameters, and running prompts through the whole engine at once against transformers'
greedy decoding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import trio
from engine_helpers import greedy, token_ids, wait_idle
from test_parity import _hf_greedy

import engine

NEW_TOKENS = 8
# A step budget of 12 tokens (prompts prefill in chunks beside decode rows) and a pool of
# 12 blocks of 4 tokens: two requests of 20 to 30 tokens with their outputs do not fit at
# once, so the scheduler preempts and recomputes.
OPTIONS = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=12, block_size=4,
               num_gpu_blocks_override=12, max_model_len=48)


def draw_mamba_parameters(hf: Any) -> Any:
    """``hf`` with its Mamba layers' A_log and dt_bias drawn in [-1, 1) and D and the conv
    biases around 0 (transformers initialises them to constants, under which one read
    wrong would not show)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                p.copy_(torch.rand(p.shape, generator=g) * 2.0 - 1.0)
            elif name.endswith((".D", "conv1d.bias")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return hf


def prompts_of(lengths: tuple[int, ...], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


async def assert_engine_matches(hf: Any, folder: Path, prompts: list[list[int]], rounds: int = 1,
                                **options: Any) -> engine.EngineStatistics:
    """Every prompt submitted at once, ``rounds`` times over, through the engine (``OPTIONS``
    with ``options``), gives transformers' greedy tokens; returns the statistics once idle
    (every KV block free)."""
    expected = [_hf_greedy(hf, p, NEW_TOKENS)[0] for p in prompts]
    async with engine.open_engine(str(folder), **(OPTIONS | options)) as eng:
        for _ in range(rounds):
            results: dict[int, list[int]] = {}

            async def one(i: int, stream: Any, results=results) -> None:
                async with stream:
                    results[i] = token_ids([out async for out in stream])

            # Submitted in order, then read together: which requests the pool preempts
            # depends on the order they arrive in (trio starts tasks in either order).
            streams = [await eng.submit(prompt, greedy(NEW_TOKENS)) for prompt in prompts]
            async with trio.open_nursery() as nursery:
                for i, stream in enumerate(streams):
                    nursery.start_soon(one, i, stream)
            assert [results[i] for i in range(len(prompts))] == expected
        return await wait_idle(eng)
