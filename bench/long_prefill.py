"""``--long-prefill-token-threshold`` (vLLM's): what a long prompt arriving does to the
requests already decoding, with its prefill chunks capped and without, in the same process
and minutes.

    .venv/bin/python bench/long_prefill.py [--model PATH] [--thresholds 0 256 512]
        [--streams 4] [--long 4096] [--rounds 2]

Without ``--model``: the bundled SmolLM2-135M GGUF. One engine per threshold is open side
by side (steps never overlap: they share the process's model thread). Each round, for each
threshold in turn: ``--streams`` requests decode (short prompts, many tokens); once each has
given its first tokens, a ``--long``-token prompt arrives, and the round ends at its first
token. Printed per threshold (medians over the rounds): the long prompt's time to first
token, and the decoding streams' gaps between tokens while it prefilled (the largest, and
their mean), beside the gaps before it arrived.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import trio

import engine
from engine.params import SamplingParams


async def round_(eng: Any, args: argparse.Namespace, rng: random.Random) -> dict[str, float]:
    stamps: list[list[float]] = [[] for _ in range(args.streams)]
    started = trio.Event()
    done = trio.Event()
    result: dict[str, float] = {}

    async def stream(i: int) -> None:
        prompt = [rng.randrange(3, 30000) for _ in range(32)]
        s = await eng.submit(prompt, SamplingParams(temperature=0, max_tokens=args.long, ignore_eos=True))
        async with s:
            async for _ in s:
                stamps[i].append(time.perf_counter())
                if all(len(t) >= 8 for t in stamps):
                    started.set()
                if done.is_set():
                    return

    async def long_prompt() -> None:
        await started.wait()
        prompt = [rng.randrange(3, 30000) for _ in range(args.long)]
        t0 = time.perf_counter()
        s = await eng.submit(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        async with s:
            async for _ in s:
                break
        t1 = time.perf_counter()
        await trio.sleep(0.5)  # each stream's token after the prefill's step comes in
        # Every gap between two tokens of a stream that overlaps the prefill [t0, t1].
        during = [b - a for t in stamps for a, b in zip(t, t[1:], strict=False) if a < t1 and b > t0]
        before = [b - a for t in stamps for a, b in zip(t[4:], t[5:], strict=False) if b < t0]
        result.update(ttft=t1 - t0, max_gap=max(during), mean_gap=statistics.mean(during),
                      before=statistics.mean(before))
        done.set()

    async with trio.open_nursery() as nursery:
        for i in range(args.streams):
            nursery.start_soon(stream, i)
        nursery.start_soon(long_prompt)
    return result


async def main(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    results: dict[int, list[dict[str, float]]] = {t: [] for t in args.thresholds}
    async with trio.open_nursery() as nursery:
        engines: dict[int, Any] = {}
        for t in args.thresholds:
            engines[t] = await nursery.start(_serve, args, t)
        for r in range(args.rounds):
            for t in args.thresholds:
                res = await round_(engines[t], args, rng)
                results[t].append(res)
                print(f"round {r + 1} threshold {t:5d}: TTFT {res['ttft']:6.2f} s  max gap "
                      f"{res['max_gap'] * 1e3:7.1f} ms  mean gap {res['mean_gap'] * 1e3:6.1f} ms  "
                      f"(before: {res['before'] * 1e3:5.1f} ms)", flush=True)
        nursery.cancel_scope.cancel()
    print(f"\n{'threshold':>9} {'TTFT s':>7} {'max gap ms':>11} {'mean gap ms':>12} {'gap before ms':>14}")
    for t in args.thresholds:
        med = {k: statistics.median(r[k] for r in results[t]) for k in results[t][0]}
        print(f"{t:9d} {med['ttft']:7.2f} {med['max_gap'] * 1e3:11.1f} {med['mean_gap'] * 1e3:12.1f} "
              f"{med['before'] * 1e3:14.1f}")


async def _serve(args: argparse.Namespace, threshold: int, *, task_status: Any) -> None:
    async with engine.open_engine(model=args.model, max_model_len=args.long + 1024,
                                  long_prefill_token_threshold=threshold) as eng:
        task_status.started(eng)
        await trio.sleep_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a folder or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--thresholds", type=int, nargs="+", default=[0, 256, 512])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--long", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=2)
    trio.run(main, parser.parse_args())
