"""Load generator for an OpenAI-compatible server, in the manner of vLLM's serving benchmark.

    python bench/serve.py --base-url http://127.0.0.1:8000 --concurrency 8 \\
        --num-prompts 64 --input-len 64 --output-len 128

Each request streams /v1/completions with ``ignore_eos`` so it produces exactly
``--output-len`` tokens. Arrivals are either a fixed number of clients in a closed loop
(``--concurrency``) or a Poisson process (``--request-rate`` per second). Prompts are
``--input-len`` token ids, random per request (``--random-range-ratio`` widens input and
output lengths around their means) so the prefix cache cannot help. Reports request
throughput, output tokens/s, TTFT and inter-token latency percentiles; with
``--baseline transformers`` it then times transformers' ``generate`` on the same prompts in
static batches of the same size, and prints the ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)


async def one_request(http: httpx.AsyncClient, model: str, prompt: list[int], output_len: int
                      ) -> Result:
    """Stream one completion; time its first token and the gaps between chunks."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "stream": True,
            "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
    result = Result()
    start = last = time.perf_counter()
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk["choices"] or not chunk["choices"][0]["text"]:
                    continue
                now = time.perf_counter()
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
    except httpx.HTTPError as exc:
        result.error = repr(exc)
        return result
    result.latency = time.perf_counter() - start
    result.ok = True
    return result


def _lengths(mean: int, ratio: float, rng: random.Random) -> int:
    return max(1, rng.randint(int(mean * (1 - ratio)), int(mean * (1 + ratio))))


def make_jobs(args: argparse.Namespace, rng: random.Random) -> list[tuple[list[int], int]]:
    # Token ids from a middle band of the vocabulary: ordinary text tokens, no specials.
    vocab_lo, vocab_hi = 1000, 20000
    return [([rng.randint(vocab_lo, vocab_hi) for _ in range(
                _lengths(args.input_len, args.random_range_ratio, rng))],
             _lengths(args.output_len, args.random_range_ratio, rng))
            for _ in range(args.num_prompts)]


async def run(args: argparse.Namespace, jobs: list[tuple[list[int], int]], rng: random.Random) -> dict:
    async with httpx.AsyncClient(base_url=args.base_url, timeout=None,
                                 limits=httpx.Limits(max_connections=None)) as http:
        model = args.model or (await http.get("/v1/models")).json()["data"][0]["id"]
        if args.warmup:
            await one_request(http, model, jobs[0][0], 4)
        results: list[Result] = []
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            if args.request_rate:
                for prompt, out_len in jobs:
                    nursery.start_soon(_record, results, http, model, prompt, out_len)
                    await trio.sleep(rng.expovariate(args.request_rate))
            else:
                queue = iter(jobs)
                for _ in range(args.concurrency):
                    nursery.start_soon(_client_loop, results, http, model, queue)
        duration = time.perf_counter() - start
    return summarize(results, duration, args)


async def _record(results, http, model, prompt, out_len) -> None:
    results.append(await one_request(http, model, prompt, out_len))


async def _client_loop(results, http, model, queue) -> None:
    for prompt, out_len in queue:  # a shared iterator: each job is taken once
        await _record(results, http, model, prompt, out_len)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summarize(results: list[Result], duration: float, args: argparse.Namespace) -> dict:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok]
    itls = [x for r in ok for x in r.itls]
    out_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "concurrency": None if args.request_rate else args.concurrency,
        "request_rate": args.request_rate or None,
        "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_tokens_per_s": out_tokens / duration,
        "mean_ttft_s": statistics.fmean(ttfts) if ttfts else float("nan"),
    }
    for q in (50, 90, 99):
        summary[f"p{q}_ttft_s"] = _pct(ttfts, q)
    for q in (50, 90, 99):
        summary[f"p{q}_itl_s"] = _pct(itls, q)
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def print_summary(s: dict) -> None:
    print(f"{'completed / failed':28} {s['completed']} / {s['failed']}")
    print(f"{'duration (s)':28} {s['duration_s']:.2f}")
    print(f"{'request throughput (req/s)':28} {s['request_throughput']:.3f}")
    print(f"{'output throughput (tok/s)':28} {s['output_tokens_per_s']:.1f}")
    for kind in ("ttft", "itl"):
        line = "  ".join(f"p{q} {s[f'p{q}_{kind}_s'] * 1000:.1f}" for q in (50, 90, 99))
        print(f"{kind.upper() + ' (ms)':28} {line}")
    base = s.get("baseline")
    if base:
        print(f"{'baseline':28} {base['name']}: {base['output_tokens_per_s']:.1f} output tok/s "
              f"({base['duration_s']:.2f} s); engine / baseline = "
              f"{s['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x")
    for error in s.get("errors", []):
        print("error:", error, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=1, help="closed-loop clients")
    p.add_argument("--request-rate", type=float, default=0.0,
                   help="Poisson arrivals per second instead of --concurrency")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from mean*(1-r)..mean*(1+r); 0 = fixed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--baseline", choices=("none", "transformers"), default="none",
                   help="after the run, time transformers' generate on the same prompts in "
                        "static batches of --concurrency (the server should be idle by then)")
    p.add_argument("--baseline-model", default=None,
                   help="the model the server runs (default: the engine's default model)")
    p.add_argument("--baseline-dtype", default="auto",
                   help="as the server's --dtype (auto resolves as the engine does)")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    jobs = make_jobs(args, rng)
    summary = trio.run(run, args, jobs, rng)
    if args.baseline == "transformers":
        summary["baseline"] = run_transformers(args, jobs)
    print(json.dumps(summary) if args.json else "", end="\n" if args.json else "")
    if not args.json:
        print_summary(summary)
    return 0 if summary["failed"] == 0 else 1


def run_transformers(args: argparse.Namespace, jobs: list[tuple[list[int], int]]) -> dict:
    """transformers' greedy ``generate`` over the same prompts, ``--concurrency`` at a time,
    left-padded, each batch running to its longest output; only requested tokens count."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from engine.models.loader import load_model, resolve_model

    loaded = load_model(resolve_model(args.baseline_model), dtype=args.baseline_dtype)
    hf = AutoModelForCausalLM.from_pretrained(loaded.folder, dtype=loaded.dtype)
    hf.generation_config.eos_token_id = None  # ignore_eos, as the requests ask
    batch = max(1, args.concurrency)
    start = time.perf_counter()
    for i in range(0, len(jobs), batch):
        group = jobs[i : i + batch]
        width = max(len(prompt) for prompt, _ in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(group):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, max_new_tokens=max(n for _, n in group),
                        do_sample=False, pad_token_id=0)
    duration = time.perf_counter() - start
    return {"name": f"transformers generate, static batches of {batch} ({loaded.dtype})",
            "duration_s": duration,
            "output_tokens_per_s": sum(n for _, n in jobs) / duration}


if __name__ == "__main__":
    sys.exit(main())
