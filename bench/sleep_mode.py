"""Sleep mode (``--enable-sleep-mode``): the memory a sleeping engine gives back and how long
it takes to serve again, beside opening the engine afresh (what a server without sleep
mode does to free the memory and take it back), in the same process and minutes.

    .venv/bin/python bench/sleep_mode.py [--model PATH] [--rounds 3]

Without ``--model``: the bundled SmolLM2-135M GGUF (its Q4_1 blocks kept), and a random
model of Qwen2.5-0.5B's shape in bf16 written to a temporary folder (``--no-large`` skips
it). Each round, per model:

1. ``open_engine`` to the first token of a short prompt (the cold start, weights read and
   built, KV pool sized, warm-up), then four 1,000-token prompts so the pool holds about
   4,000 tokens' KV;
2. ``sleep(1)``: seconds, and the resident memory (``VmRSS``) given back; ``wake_up()``
   and the first token again;
3. ``sleep(2)``: seconds and memory; ``wake_up()`` (the checkpoint read again, the model
   rebuilt) and the first token.

The resident memory is printed before the sleeps and after each wake-up: a level 2 sleep
also trims glibc's heap (``malloc_trim``), which gives back what loading left free there,
so its figure can exceed the weights'; after the wake-up the process should hold no more
than before it slept. Each round trims the heap before it opens its engine, so that what
the previous round's engine left free is not counted again.

Printed: medians over the rounds of each time, the memory given back next to the KV bytes
the prompts wrote and the weights' resident bytes, and the cold start over each wake-up
(above 1: the wake-up is that much sooner than opening the engine again).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

import engine
from engine.models.layers.linear import weight_bytes
from engine.models.testing import write_tiny_model
from engine.params import SamplingParams
from engine.runner.kv_cache import bytes_per_block, resident_bytes
from engine.runner.sleep import trim_heap

MiB = 2**20
PROMPTS = [[(7 * i + 3 + j) % 300 + 3 for i in range(1000)] for j in range(4)]
SHORT = [(11 * i + 5) % 300 + 3 for i in range(32)]


async def first_token(eng: Any, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    stream = await eng.submit(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    async with stream:
        async for _ in stream:
            pass
    return time.perf_counter() - t0


async def one_round(model: str | None, options: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    trim_heap()  # what earlier rounds' engines left free in the heap goes back first
    t0 = time.perf_counter()
    async with engine.open_engine(model=model, enable_sleep_mode=True, **options) as eng:
        await first_token(eng, SHORT)
        out["cold start"] = time.perf_counter() - t0
        async with trio.open_nursery() as nursery:
            for prompt in PROMPTS:
                nursery.start_soon(first_token, eng, prompt)
        runner = eng._parts.runner
        out["kv written MiB"] = sum(len(p) + 1 for p in PROMPTS) * bytes_per_block(
            runner.config, runner.dtype, 1) / MiB
        out["weights MiB"] = weight_bytes(runner.model) / MiB
        out["resident before the sleeps MiB"] = resident_bytes() / MiB
        for level in (1, 2):
            before = resident_bytes()
            t1 = time.perf_counter()
            await eng.sleep(level)
            out[f"sleep({level}) s"] = time.perf_counter() - t1
            out[f"level {level} given back MiB"] = (before - resident_bytes()) / MiB
            t2 = time.perf_counter()
            await eng.wake_up()
            out[f"wake after {level} s"] = time.perf_counter() - t2
            out[f"wake after {level}, first token s"] = time.perf_counter() - t2 + await first_token(eng, SHORT)
            out[f"resident after wake {level} MiB"] = resident_bytes() / MiB
            if level == 1:  # refill the pool for the level 2 figure
                async with trio.open_nursery() as nursery:
                    for prompt in PROMPTS:
                        nursery.start_soon(first_token, eng, prompt)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model folder or GGUF (default: SmolLM2 and a 0.5B shape)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-large", action="store_true", help="skip the random 0.5B-shape model")
    args = parser.parse_args()
    options = dict(kv_cache_memory=512 * MiB, max_num_seqs=4)
    models: list[tuple[str, str | None]] = [(args.model or "SmolLM2-135M Q4_1 GGUF", args.model)]
    tmp = tempfile.TemporaryDirectory()
    if args.model is None and not args.no_large:
        folder = write_tiny_model(Path(tmp.name) / "qwen05", "qwen2", overrides=dict(
            hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
            num_key_value_heads=2, head_dim=64, torch_dtype="bfloat16",
            max_position_embeddings=4096))
        models.append(("random Qwen2.5-0.5B shape, bf16", str(folder)))
    for name, model in models:
        rounds = [trio.run(one_round, model, options) for _ in range(args.rounds)]
        print(f"\n{name} ({args.rounds} rounds, medians)")
        for key in rounds[0]:
            print(f"  {key:32s} {statistics.median(r[key] for r in rounds):10.3f}")
        cold = statistics.median(r["cold start"] for r in rounds)
        for level in (1, 2):
            wake = statistics.median(r[f"wake after {level}, first token s"] for r in rounds)
            print(f"  cold start / wake after level {level} to the first token: {cold / wake:.1f}x")
        sys.stdout.flush()
    tmp.cleanup()


if __name__ == "__main__":
    main()
