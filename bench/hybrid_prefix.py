"""A hybrid model's prefix cache on a conversation: the time to the next turn's first token
with the recurrent layers' states kept at block boundaries (state checkpoints), beside the
same engine with prefix caching off, on bench/moe_families.py's random models
(``granite4h``, ``nemotron_h``, ``qwen3_5``), bf16, through the embedded API.

    .venv/bin/python bench/hybrid_prefix.py [--families qwen3_5] [--prompt-len 2048] [--rounds 3]

A conversation: turn 1 is a prompt of ``--prompt-len`` tokens answered with
``--answer-len`` tokens; turn 2 is turn 1's prompt, its answer and ``--turn-len`` more
tokens. Each round runs the conversation on two engines, one with the cache (the default)
and one with ``enable_prefix_caching=False``, in alternating order, and times each
turn's first token (TTFT: submit to the first output). Printed: the medians of the rounds
and their ratios (off / on: above 1 is the cache's gain); turn 1 shows what keeping the
states costs a prompt that finds nothing cached. Each engine's first conversation is a
warm-up on other tokens and is not counted.

Then a shared system prompt: four requests, one after another, each the same
``--prompt-len`` tokens then ``--turn-len`` of its own; the first two find no states kept
in the shared part (the second keeps them at its end, the junction), the third and fourth
resume there. Printed: each request's TTFT, cache on and off.

Then what keeping the states costs decoding (each request copies its states into a
checkpoint at every block boundary it crosses): ``--batch`` requests of 64-token prompts
decoding ``--decode-len`` tokens each, output tok/s of the batch, on both engines in the
same alternating rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_families import write  # noqa: E402

import engine  # noqa: E402
from engine.params import SamplingParams  # noqa: E402


async def _turn(eng: Any, prompt: list[int], answer_len: int) -> tuple[float, list[int], int]:
    """TTFT in seconds, the answer's tokens, and the prompt tokens served from the cache."""
    t0 = time.perf_counter()
    ttft = None
    tokens: list[int] = []
    last = None
    stream = await eng.submit(prompt, SamplingParams(temperature=0.0, max_tokens=answer_len, ignore_eos=True))
    async with stream:
        async for out in stream:
            if ttft is None:
                ttft = time.perf_counter() - t0
            tokens += out.token_ids
            last = out
    return ttft, tokens, last.usage.cached_tokens


async def _conversation(eng: Any, first: list[int], turn: list[int], answer_len: int) -> list[tuple[float, int]]:
    t1, answer, c1 = await _turn(eng, first, answer_len)
    t2, _, c2 = await _turn(eng, first + answer + turn, answer_len)
    return [(t1, c1), (t2, c2)]


async def _decode_rate(eng: Any, prompts: list[list[int]], n: int) -> float:
    """Output tokens a second of ``prompts`` decoded together, ``n`` tokens each."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    t0 = time.perf_counter()
    streams = [await eng.submit(p, params) for p in prompts]

    async def drain(stream: Any) -> None:
        async with stream:
            async for _ in stream:
                pass

    async with trio.open_nursery() as nursery:
        for stream in streams:
            nursery.start_soon(drain, stream)
    return len(prompts) * n / (time.perf_counter() - t0)


async def _rounds(folder: Path, args: Any) -> dict[str, list[Any]]:
    """Each round's conversation on both engines, in alternating order."""
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    max_len = args.prompt_len + args.answer_len * 2 + args.turn_len + 16
    max_len = max(max_len, 64 + args.decode_len)
    options = dict(dtype="bfloat16", max_model_len=max_len, max_num_seqs=max(4, args.batch))
    times: dict[str, list[Any]] = {"on": [], "off": [], "decode on": [], "decode off": [],
                                   "shared on": [], "shared off": []}
    async with engine.open_engine(str(folder), **options) as on, \
            engine.open_engine(str(folder), enable_prefix_caching=False, **options) as off:
        engines = {"on": on, "off": off}
        warm = (tokens(args.prompt_len), tokens(args.turn_len))
        for eng in engines.values():
            await _conversation(eng, *warm, args.answer_len)
        for r in range(args.rounds):
            first, turn = tokens(args.prompt_len), tokens(args.turn_len)
            batch = [tokens(64) for _ in range(args.batch)]
            system = tokens(args.prompt_len)
            questions = [tokens(args.turn_len) for _ in range(4)]
            for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
                times[name].append(await _conversation(engines[name], first, turn, args.answer_len))
                times[f"shared {name}"].append(
                    [(await _turn(engines[name], system + q, args.answer_len))[::2] for q in questions])
                times[f"decode {name}"].append(await _decode_rate(engines[name], batch, args.decode_len))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="qwen3_5,granite4h,nemotron_h")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--answer-len", type=int, default=32)
    ap.add_argument("--turn-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--decode-len", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(2)
    print("| family | turn | TTFT, cache on (s) | cached tokens | TTFT, cache off (s) | off / on |")
    print("|---|---|---|---|---|---|")
    decode, shared = [], []
    for family in args.families.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / family
            write(family, folder)
            times = trio.run(_rounds, folder, args)
            for t in (0, 1):
                on = statistics.median(c[t][0] for c in times["on"])
                off = statistics.median(c[t][0] for c in times["off"])
                cached = {c[t][1] for c in times["on"]}
                print(f"| {family} | {t + 1} | {on:.3f} | {', '.join(map(str, sorted(cached)))} | {off:.3f} | "
                      f"**{off / on:.2f}x** |")
            on, off = (statistics.median(times[f"decode {k}"]) for k in ("on", "off"))
            decode.append(f"| {family} | {args.batch} | {on:.1f} | {off:.1f} | {on / off:.3f} |")
            for i in range(4):
                on = statistics.median(c[i][0] for c in times["shared on"])
                off = statistics.median(c[i][0] for c in times["shared off"])
                cached = sorted({c[i][1] for c in times["shared on"]})
                shared.append(f"| {family} | {i + 1} | {on:.3f} | {', '.join(map(str, cached))} | {off:.3f} | "
                              f"**{off / on:.2f}x** |")
    print()
    print("| family | request (shared prompt) | TTFT, cache on (s) | cached tokens | TTFT, cache off (s) | off / on |")
    print("|---|---|---|---|---|---|")
    print("\n".join(shared))
    print()
    print("| family | batch | decode tok/s, cache on | cache off | on / off |")
    print("|---|---|---|---|---|")
    print("\n".join(decode))


if __name__ == "__main__":
    main()
