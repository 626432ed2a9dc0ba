"""Offline throughput: the actor engine against transformers' static batches, same prompts.

    .venv/bin/python bench/throughput.py [--model PATH] [--dtype float32] [--num-prompts 32]
    .venv/bin/python bench/throughput.py --tiny-moe mixtral   # a random 8-expert MoE model

Two workloads, both with ``ignore_eos`` so every request makes exactly its output length:

* ``fixed``: 32 requests x 64-token prompts x 128 output tokens (the issue's target case);
* ``random``: ``--num-prompts`` requests, input lengths uniform in [16, 256], output
  lengths uniform in [16, 192] (seeded).

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
    lo, hi = min(1000, vocab // 4), min(vocab, 40000) - 1

    def prompt(n: int) -> list[int]:
        return [rng.randint(lo, hi) for _ in range(n)]

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


async def _drain(eng: Any, prompt: list[int], n: int) -> int:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    count = 0
    async for out in eng.generate(prompt, params):
        count += len(out.token_ids)
    assert count == n, (count, n)
    return count


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
    parser.add_argument("--only", choices=("fixed", "random"), default=None)
    parser.add_argument("--repeat", type=int, default=1, help="alternate async on/off this many times")
    parser.add_argument(
        "--tiny-moe", choices=sorted(TINY_MOE_SHAPES), default=None,
        help="write a random-weight mixture-of-experts model (see TINY_MOE_SHAPES) and use it",
    )
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
