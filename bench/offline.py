"""Offline batch throughput: ``engine.LLM.generate`` against the embedded trio API on the
same prompts, in the same process and minutes.

    .venv/bin/python bench/offline.py [--model PATH] [--dtype auto] [--num-prompts 1000]
        [--input-len 32] [--output-len 32] [--repeat 2]
    .venv/bin/python bench/offline.py --tiny --num-prompts 200 --output-len 4   # a smoke run

Both sides get ``--num-prompts`` text prompts (sentences cut from the test corpus, so
tokenizing them is part of the work, as it is for a user's list) for ``--output-len``
tokens each, greedy with EOS ignored, all at once:

* embedded: ``open_engine``, one task per prompt in a nursery, each ``submit`` and read to
  the end (what an async application writes by hand);
* LLM: ``LLM(...)`` then one ``generate(prompts, params, use_tqdm=False)`` call.

Each side loads the model outside the clock and warms up on a few prompts; the clock runs
from the first submit (the ``generate`` call) to the last output. The runs alternate
``--repeat`` times (embedded, LLM, embedded, LLM, ...) so drifting machine load hits both.
The target (issue 37) is an LLM at least 0.95x the embedded API's output tokens/s.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine  # noqa: E402
from engine.params import SamplingParams  # noqa: E402

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "perplexity_en.txt"
# Prompts a warm-up runs before the clock: the first steps allocate torch's buffers.
WARMUP_PROMPTS = 4


def make_prompts(count: int, words: int) -> list[str]:
    """``count`` distinct prompts of about ``words`` words, cut from the corpus in turn."""
    text = re.sub(r"\s+", " ", CORPUS.read_text(encoding="utf-8"))
    vocab = text.split(" ")
    return [" ".join(vocab[(i * 7) % (len(vocab) - words):][:words]) + f" ({i})"
            for i in range(count)]


def params(output_len: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


async def run_embedded(model: str | None, options: dict[str, Any], prompts: list[str],
                       output_len: int) -> float:
    async with engine.open_engine(model, **options) as eng:

        async def one(prompt: str, sp: SamplingParams) -> None:
            async with await eng.submit(prompt, sp) as stream:
                async for _ in stream:
                    pass

        async with trio.open_nursery() as nursery:
            for p in prompts[:WARMUP_PROMPTS]:
                nursery.start_soon(one, p, params(4))
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for p in prompts:
                nursery.start_soon(one, p, params(output_len))
        return time.perf_counter() - t0


def run_llm(model: str | None, options: dict[str, Any], prompts: list[str],
            output_len: int) -> float:
    with engine.LLM(model, **options) as llm:
        llm.generate(prompts[:WARMUP_PROMPTS], params(4), use_tqdm=False)
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params(output_len), use_tqdm=False)
        wall = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model (smoke run)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=32, help="words per prompt")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()

    model = args.model
    if args.tiny:
        import tempfile

        from engine.models.testing import write_tiny_model

        model = str(write_tiny_model(Path(tempfile.mkdtemp()) / "tiny", "llama"))
    options: dict[str, Any] = {"dtype": args.dtype, "max_num_seqs": args.max_num_seqs}
    prompts = make_prompts(args.num_prompts, args.input_len)
    out_tokens = args.num_prompts * args.output_len
    print(f"{args.num_prompts} prompts of ~{args.input_len} words -> {args.output_len} tokens "
          f"each; model {model or 'SmolLM2-135M-Instruct'}, {options}", flush=True)
    rates: dict[str, list[float]] = {"embedded": [], "LLM": []}
    for _ in range(args.repeat):
        wall = trio.run(run_embedded, model, options, prompts, args.output_len)
        rates["embedded"].append(out_tokens / wall)
        print(f"embedded API: {out_tokens / wall:8.1f} out tok/s ({wall:.2f} s)", flush=True)
        wall = run_llm(model, options, prompts, args.output_len)
        rates["LLM"].append(out_tokens / wall)
        print(f"engine.LLM  : {out_tokens / wall:8.1f} out tok/s ({wall:.2f} s)", flush=True)
    embedded, llm = (statistics.median(rates[k]) for k in ("embedded", "LLM"))
    print(f"median: embedded {embedded:.1f}, LLM {llm:.1f} out tok/s; "
          f"LLM / embedded = {llm / embedded:.3f} (target >= 0.95)")


if __name__ == "__main__":
    main()
