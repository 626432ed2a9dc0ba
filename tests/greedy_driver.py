"""Greedy decoding straight through a :class:`engine.runner.model_runner.ModelRunner`, with
no scheduler: the driver of the runner and parity tests (and bench/greedy_compare.py)."""

from __future__ import annotations

from typing import Any

from engine.messages import NewRequest, SampledToken, ScheduledChunk, StepPlan
from engine.params import SamplingParams


def generate_greedy(
    runner: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    chunk_size: int | None = None,
    block_size: int,
) -> list[list[int]]:
    """Greedy-decode every prompt for exactly ``max_new_tokens`` tokens (EOS ignored).

    A tiny synchronous driver with no scheduler: request ``i`` gets a
    contiguous run of blocks, all requests run together, and with ``chunk_size`` each
    prompt is prefilled ``chunk_size`` tokens a step. Returns the new tokens per prompt.
    """
    runs = run_greedy(runner, prompts, max_new_tokens, chunk_size=chunk_size, block_size=block_size)
    return [[s.token_id for s in run] for run in runs]


def run_greedy(
    runner: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    chunk_size: int | None = None,
    block_size: int,
    loras: list[Any] | None = None,
) -> list[list[SampledToken]]:
    """:func:`generate_greedy`, returning each token with its logprob; ``loras`` gives
    each prompt's LoRA adapter (an ``engine.messages.LoraAdapter``, None for the base)."""
    if block_size != runner.block_size:
        raise ValueError(f"block_size {block_size} differs from the runner's {runner.block_size}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    ids = [f"greedy-{i}" for i in range(len(prompts))]
    tables, offset = [], 0
    for p in prompts:
        n = -(-(len(p) + max_new_tokens) // block_size)
        tables.append(tuple(range(offset, offset + n)))
        offset += n
    if offset > runner.num_blocks:
        raise ValueError(f"the prompts need {offset} KV blocks; the runner has {runner.num_blocks}")
    loras = loras or [None] * len(prompts)
    new = tuple(NewRequest(r, tuple(p), params, (), lora=a) for r, p, a in zip(ids, prompts, loras, strict=True))
    outputs: list[list[SampledToken]] = [[] for _ in prompts]
    computed = [0] * len(prompts)
    step = 0
    while any(len(o) < max_new_tokens for o in outputs):
        chunks = []
        for i, p in enumerate(prompts):
            if len(outputs[i]) >= max_new_tokens:
                continue
            known = len(p) + len(outputs[i])
            n = known - computed[i] if chunk_size is None else min(chunk_size, known - computed[i])
            chunks.append(ScheduledChunk(ids[i], computed[i], n, tables[i], computed[i] + n == known))
            computed[i] += n
        result = runner.execute(StepPlan(step, new if step == 0 else (), tuple(chunks), ()))
        if result.failed:
            # execute() logged the cause; a driver with no scheduler cannot go on (the
            # failed requests are gone).
            runner.execute(StepPlan(step + 1, (), (), tuple(ids)))
            raise RuntimeError(f"greedy step {step} failed: {result.failed[0].reason}")
        for s in result.sampled:
            outputs[int(s.sample_id.rsplit("-", 1)[1])].append(s)
        step += 1
    runner.execute(StepPlan(step, (), (), tuple(ids)))
    return outputs
