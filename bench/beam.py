"""Beam search of width W against W independent samples of the same prompt (issue 38).

    .venv/bin/python bench/beam.py [--model PATH] [--width 4] [--prompt-tokens 512]
                                   [--max-tokens 128] [--repeat 3] [--dtype float32]
                                   [--quantization none] [--json out.json]

One engine (the bundled SmolLM2 GGUF by default), one request at a time, in the same run:
``beam`` is ``use_beam_search`` with W beams, ``samples`` is ``n = W`` at temperature 1
(seeded). Both run ``--max-tokens`` steps of W rows (``ignore_eos``, no stop), so their
rows/s compare the same work. Each mode runs with the prefix cache on (the default: the W
samples share the prompt through it) and off (each sample holds its own prompt blocks),
alternated run by run. Printed per row: rows/s (W tokens per step, over the request's
wall time), the peak of KV blocks held during the request (sampled every millisecond from
the engine's statistics: blocks no request holds, cached ones included, are free), and
the ratios beam / samples (targets: rows/s >= 0.9x, peak blocks <= 0.5x). With the prefix
cache on, the W samples already share the prompt's full blocks (a sample after the first
waits for them), so the beams can save only what their common history shares beyond the
prompt: the 0.5x target is the prefix-cache-off comparison (W private prompts). Time it on
an idle machine only.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import trio

import engine
from engine.params import SamplingParams

POLL_SECONDS = 0.001  # fine enough to see a block table grow by one block a step


async def _one(eng: Any, prompt: list[int], params: SamplingParams) -> tuple[float, int, int]:
    """Seconds, output tokens and the peak of held KV blocks of one request."""
    total = eng.statistics().kv_blocks_total
    peak = 0
    done = trio.Event()

    async def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, total - eng.statistics().kv_blocks_free)
            await trio.sleep(POLL_SECONDS)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        t0 = time.perf_counter()
        tokens = 0
        async for out in eng.generate(prompt, params):
            tokens += len(out.token_ids)
        seconds = time.perf_counter() - t0
        done.set()
    return seconds, tokens, peak


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(0)
    options: dict[str, Any] = {"max_model_len": args.prompt_tokens + args.max_tokens + 16,
                               "max_num_seqs": max(16, args.width)}
    if args.dtype:
        options["dtype"] = args.dtype
    if args.quantization:
        options["quantization"] = args.quantization
    modes = {
        "beam": SamplingParams(beam_width=args.width, n=args.width, max_tokens=args.max_tokens,
                               ignore_eos=True),
        "samples": SamplingParams(n=args.width, temperature=1.0, seed=0,
                                  max_tokens=args.max_tokens, ignore_eos=True),
    }
    rows: list[dict[str, Any]] = []
    for caching in (True, False):
        async with engine.open_engine(args.model, enable_prefix_caching=caching, **options) as eng:
            results: dict[str, list[tuple[float, int, int]]] = {m: [] for m in modes}
            for r in range(args.repeat):
                order = list(modes) if r % 2 == 0 else list(reversed(modes))
                for mode in order:
                    # A fresh prompt per run: no run reuses another's cached prefix. Ids
                    # below 300 are in every vocabulary here (the tiny test models' is 384).
                    prompt = [rng.randrange(3, 300) for _ in range(args.prompt_tokens)]
                    results[mode].append(await _one(eng, prompt, modes[mode]))
        for mode, runs in results.items():
            seconds = sum(s for s, _, _ in runs)
            rows.append({
                "prefix_caching": caching, "mode": mode, "width": args.width,
                "rows_per_s": args.width * args.max_tokens * len(runs) / seconds,
                "output_tokens": sum(t for _, t, _ in runs) // len(runs),
                "peak_blocks": max(p for _, _, p in runs),
            })
    for caching in (True, False):
        beam, samples = (next(r for r in rows if r["prefix_caching"] == caching and r["mode"] == m)
                         for m in ("beam", "samples"))
        rows.append({"prefix_caching": caching, "mode": "beam/samples",
                     "throughput_ratio": beam["rows_per_s"] / samples["rows_per_s"],
                     "blocks_ratio": beam["peak_blocks"] / samples["peak_blocks"]})
    return rows


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dtype", default=None)
    p.add_argument("--quantization", default=None)
    p.add_argument("--json", default=None)
    return p.parse_args()


if __name__ == "__main__":
    args = _parse()
    rows = trio.run(main, args)
    for row in rows:
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
