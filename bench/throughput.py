"""Offline throughput: the actor engine against transformers' static batches, same prompts.

    .venv/bin/python bench/throughput.py [--model PATH] [--dtype float32] [--num-prompts 32]
    .venv/bin/python bench/throughput.py --tiny-moe mixtral   # a random 8-expert MoE model
    .venv/bin/python bench/throughput.py --structured json --dtype bfloat16  # JSON schema vs free

Two workloads, both with ``ignore_eos`` so every request makes exactly its output length:

* ``fixed``: 32 requests x 64-token prompts x 128 output tokens (the issue's target case);
* ``random``: ``--num-prompts`` requests, input lengths uniform in [16, 256], output
  lengths uniform in [16, 192] (seeded).

``--structured json`` runs a third instead: ``--num-prompts`` chat requests (default 32,
all at once) for 128 tokens each, once free (``ignore_eos``) and once under a JSON schema
too long to close in 128 tokens (so both make exactly 128 tokens a request), alternating
``--repeat`` times, with a second schema that bounds its strings' lengths; it prints the throughputs, the per-token cost of the grammar (filling
the bitmask from each sample's matcher, applying it to the logits) and a schema's compile
time cold and from the cache.

For the engine it prints output tok/s and total (prompt + output) tok/s, with async
scheduling on and off, and the per-step overhead: the share of wall time per step not
spent in the model forward (``StepResult.forward_seconds``), split into the runner's own
input preparation (inside ``runner.execute``) and everything on the trio side. For
transformers it runs ``generate`` in static batches of ``--hf-batch`` prompts, left-padded
to the longest prompt and generating the longest output of the batch, which is what a user
without continuous batching would do; only the requested tokens count as output.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import random
import sys
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine  # noqa: E402
from engine.cli.bench import drain, token_range  # noqa: E402 - `python -m engine bench`'s
from engine.params import SamplingParams  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def workloads(vocab: int, num_prompts: int, seed: int) -> list[Workload]:
    rng = random.Random(seed)
    # Ids from the middle of the vocabulary: ordinary tokens, no specials at the start
    # (a tiny test vocabulary of a few hundred ids: its upper three quarters).
    lo, hi = token_range(vocab)

    def prompt(n: int) -> list[int]:
        return [rng.randint(lo, hi - 1) for _ in range(n)]

    fixed = Workload("fixed 32x64->128", [prompt(64) for _ in range(32)], [128] * 32)
    lens = [(rng.randint(16, 256), rng.randint(16, 192)) for _ in range(num_prompts)]
    rand = Workload(
        f"random {num_prompts}x[16,256]->[16,192]", [prompt(i) for i, _ in lens], [o for _, o in lens]
    )
    return [fixed, rand]


async def run_engine(model: str | None, options: dict[str, Any], work: Workload) -> dict[str, float]:
    async with engine.open_engine(model, **options) as eng:
        # Warm-up: first forwards allocate and fill caches inside torch.
        await _drain(eng, work.prompts[0][:16], 4)
        sched0 = eng._handles.actors["scheduler"].statistics()
        exec0 = eng._handles.actors["executor"].statistics()
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for p, n in zip(work.prompts, work.output_lens, strict=True):
                nursery.start_soon(_drain, eng, p, n)
        wall = time.perf_counter() - t0
        sched = eng._handles.actors["scheduler"].statistics()
        ex = eng._handles.actors["executor"].statistics()
        stats = eng.statistics()
    steps = sched.steps - sched0.steps
    forward = ex.forward_seconds - exec0.forward_seconds
    execute = ex.execute_seconds - exec0.execute_seconds
    return {
        "wall": wall,
        "output_tps": work.output_tokens / wall,
        "total_tps": (work.output_tokens + work.prompt_tokens) / wall,
        "steps": steps,
        "step_ms": 1000 * wall / max(steps, 1),
        "overhead": 1 - forward / wall,
        "runner_prep": (execute - forward) / wall,
        "trio_side": 1 - execute / wall,
        "planned_ahead": (sched.planned_ahead - sched0.planned_ahead) / max(steps, 1),
        "preemptions": stats.preemptions,
    }


async def _drain(eng: Any, prompt: Any, n: int, params: SamplingParams | None = None) -> int:
    count = await drain(eng, prompt, n, params)
    assert count == n, (count, n)
    return count


# --------------------------------------------------------------------------------------
# --structured json: the same chat requests free and under a JSON schema

# At least 24 people of at least ~12 tokens each: no output closes within 128 tokens, so a
# constrained request ends by length exactly as a free one with ignore_eos does, and both
# runs make the same number of tokens. Two variants: free-length strings (a plain pydantic
# model) and the same with maxLength on the strings, which xgrammar masks far more slowly.
def _people_schema(max_length: int | None) -> dict[str, Any]:
    text: dict[str, Any] = {"type": "string"}
    if max_length is not None:
        text["maxLength"] = max_length
    return {
        "type": "object",
        "properties": {"people": {
            "type": "array", "minItems": 24,
            "items": {"type": "object",
                      "properties": {"name": text, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                     "city": text},
                      "required": ["name", "age", "city"], "additionalProperties": False}}},
        "required": ["people"], "additionalProperties": False,
    }


SCHEMAS = {"free": None, "json schema": _people_schema(None), "json, maxLength 16": _people_schema(16)}
CITIES = ("Lisbon", "Osaka", "Lagos", "Quito", "Oslo", "Perth", "Pune", "Tunis")


def _people_prompts(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"List {24 + i} people who live in {CITIES[i % len(CITIES)]}, "
              "with their name, age and city, as JSON."}] for i in range(n)]


async def run_structured(model: str | None, options: dict[str, Any], n: int, out_len: int,
                         schema: dict[str, Any] | None) -> dict[str, float]:
    from engine.structured import StructuredOutputs

    constrained = schema is not None
    spec = StructuredOutputs(json=schema) if constrained else None
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=not constrained,
                            structured_outputs=spec)
    prompts = _people_prompts(n)
    async with engine.open_engine(model, **options) as eng:
        grammar = eng._parts.grammar
        runner = eng._parts.runner
        compile_cold = compile_cached = float("nan")
        if constrained:
            # A schema this engine has not seen compiles; the same spec again is a cache hit.
            t0 = time.perf_counter()
            await trio.to_thread.run_sync(grammar.compile, spec)
            compile_cold = time.perf_counter() - t0
            t0 = time.perf_counter()
            await trio.to_thread.run_sync(grammar.compile, spec)
            compile_cached = time.perf_counter() - t0
        await _drain(eng, prompts[0], 4, params.replace(max_tokens=4))  # warm-up
        fill0, apply0, rows0 = runner.mask_fill_seconds, runner.sampler.mask_apply_seconds, runner.mask_rows
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for p in prompts:
                nursery.start_soon(_drain, eng, p, out_len, params)
        wall = time.perf_counter() - t0
        rows = runner.mask_rows - rows0
    return {
        "wall": wall, "output_tps": n * out_len / wall,
        "fill_us": 1e6 * (runner.mask_fill_seconds - fill0) / max(rows, 1),
        "apply_us": 1e6 * (runner.sampler.mask_apply_seconds - apply0) / max(rows, 1),
        "rows": rows, "compile_cold": compile_cold, "compile_cached": compile_cached,
    }


def structured_main(args: argparse.Namespace, base: dict[str, Any]) -> None:
    out_len = 128
    print(f"\n== structured json: {args.num_prompts} chat requests x {out_len} tokens, greedy; "
          "free (ignore_eos) vs under a schema of 24+ people", flush=True)
    tps: dict[str, list[float]] = {label: [] for label in SCHEMAS}
    for _ in range(args.repeat):
        for label, schema in SCHEMAS.items():
            r = trio.run(run_structured, args.model, base, args.num_prompts, out_len, schema)
            tps[label].append(r["output_tps"])
            line = f"{label:18}: {r['output_tps']:7.1f} out tok/s ({r['wall']:.1f} s)"
            if schema is not None:
                line += (f"; per constrained token: mask fill {r['fill_us']:.1f} us + apply "
                         f"{r['apply_us']:.1f} us ({r['rows']} rows); compile {1e3 * r['compile_cold']:.1f} ms "
                         f"cold, {1e3 * r['compile_cached']:.3f} ms cached")
            print(line, flush=True)
    free = sum(tps["free"])
    for label in list(SCHEMAS)[1:]:
        print(f"{label} / free: {sum(tps[label]) / free:.3f} (over {args.repeat} rounds)", flush=True)


def run_transformers(folder: Path, dtype: str, work: Workload, batch: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
    hf.generation_config.eos_token_id = None  # ignore_eos
    pad = 0
    order = list(range(len(work.prompts)))
    t0 = time.perf_counter()
    for start in range(0, len(order), batch):
        idx = order[start : start + batch]
        longest = max(len(work.prompts[i]) for i in idx)
        ids = torch.full((len(idx), longest), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(idx):
            p = work.prompts[i]
            ids[row, longest - len(p) :] = torch.tensor(p)
            mask[row, longest - len(p) :] = 1
        new = max(work.output_lens[i] for i in idx)
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=pad)
    wall = time.perf_counter() - t0
    return {
        "wall": wall,
        "output_tps": work.output_tokens / wall,
        "total_tps": (work.output_tokens + work.prompt_tokens) / wall,
    }


def _in_own_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a fresh thread that ends with the call."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args, **kwargs).result()


# Tiny but not trivial: 8 layers of 8 experts, top 2 (Qwen3-MoE: top 4 of 16, as its
# family routes more experts), hidden 256, experts of 512 (Mixtral) / 256 (Qwen3-MoE).
# Random weights; the tokenizer is the test models' 384-token BPE.
_MOE_COMMON = {
    "hidden_size": 256, "num_hidden_layers": 8, "num_attention_heads": 8,
    "num_key_value_heads": 4, "max_position_embeddings": 1024,
}
TINY_MOE_SHAPES: dict[str, dict[str, Any]] = {
    "mixtral": _MOE_COMMON | {"intermediate_size": 512, "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen3_moe": _MOE_COMMON | {
        "head_dim": 32, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 256,
        "intermediate_size": 1024, "mlp_only_layers": [],
    },
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--quantization", default=None, choices=("auto", "gguf", "none"),
                        help="the engine's --quantization (default: the engine's own, auto)")
    parser.add_argument("--only", choices=("fixed", "random"), default=None)
    parser.add_argument("--repeat", type=int, default=1, help="alternate async on/off this many times")
    parser.add_argument(
        "--tiny-moe", choices=sorted(TINY_MOE_SHAPES), default=None,
        help="write a random-weight mixture-of-experts model (see TINY_MOE_SHAPES) and use it",
    )
    parser.add_argument("--structured", choices=("json",), default=None,
                        help="compare chat requests under a JSON schema with the same free")
    args = parser.parse_args()
    if args.tiny_moe:
        import tempfile

        from engine.models.testing import write_tiny_model

        folder = Path(tempfile.mkdtemp(prefix=f"bench-{args.tiny_moe}-"))
        args.model = str(write_tiny_model(folder, args.tiny_moe, overrides=TINY_MOE_SHAPES[args.tiny_moe]))

    import torch

    from engine.models.loader import load_model, resolve_model

    # torch's CPU ops use an OpenMP thread team per calling thread. The engine runs its model
    # in a worker thread; torch work in this main thread as well would leave a second team
    # contending for the same cores (measured: engine steps up to 2x slower). So every
    # torch call of this script runs in a short-lived thread of its own.
    loaded = _in_own_thread(load_model, resolve_model(args.model), dtype=args.dtype)
    print(f"model {loaded.source} ({loaded.config.architecture}, {args.dtype}); torch threads "
          f"{torch.get_num_threads()}", flush=True)
    base = dict(
        dtype=args.dtype, max_num_seqs=64, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=512 * 1024**2,  # ample for 64 x 448 tokens of SmolLM2 (~46 KB/token fp32)
    )
    if args.quantization:
        base["quantization"] = args.quantization
    if args.structured:
        structured_main(args, base)
        return 0
    for work in workloads(loaded.config.vocab_size, args.num_prompts, args.seed):
        if args.only and not work.name.startswith(args.only):
            continue
        print(f"\n== {work.name}: {len(work.prompts)} requests, {work.prompt_tokens} prompt + "
              f"{work.output_tokens} output tokens", flush=True)
        # On and off alternate (--repeat times) so that load drifting on a shared machine
        # hits both alike.
        runs = [("engine async on ", {"async_scheduling": True}),
                ("engine async off", {"async_scheduling": False})]
        for label, extra in runs * args.repeat:
            r = trio.run(run_engine, args.model, dict(base, **extra), work)
            print(
                f"{label}: {r['output_tps']:7.1f} out tok/s {r['total_tps']:7.1f} total tok/s "
                f"({r['wall']:.1f} s, {r['steps']:.0f} steps, {r['step_ms']:.1f} ms/step; overhead "
                f"{100 * r['overhead']:.1f}% = runner prep {100 * r['runner_prep']:.1f}% + trio side "
                f"{100 * r['trio_side']:.1f}%; planned ahead {100 * r['planned_ahead']:.0f}% of steps; "
                f"preemptions {r['preemptions']})",
                flush=True,
            )
        if not args.skip_transformers:
            r = _in_own_thread(run_transformers, loaded.folder, args.dtype, work, args.hf_batch)
            print(
                f"transformers b{args.hf_batch}: {r['output_tps']:7.1f} out tok/s {r['total_tps']:7.1f} "
                f"total tok/s ({r['wall']:.1f} s, static padded batches)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
