"""Pipeline parallelism: whether the stages work at once (batches in flight), each stage's
busy fraction, and what passing the hidden states costs per step.

    .venv/bin/python bench/pp.py [--model PATH] [--sizes 1,2] [--requests 16]
                                 [--prompt-len 64] [--max-tokens 32] [--hidden 512]
                                 [--layers 8] [--heads 8] [--kv-heads 4] [--dtype float32]
                                 [--trace-steps 12] [--json out.json]

Without ``--model`` a random Llama of ``--hidden``/``--layers``/``--heads`` is written to a
temporary folder. Every size runs the same greedy requests, all in flight at once
(``--requests``, 16 by default), through the embedded engine at
``--pipeline-parallel-size N`` (``mp`` workers), and must give the same tokens as the first.

Printed per size above 1, from the pipeline's step trace (``PipelineRunner.trace``: each
stage's wall-clock start and end of every step, and its seconds in recv and send):

* each stage's busy fraction over the run: its steps' time less its waits (a later stage's
  recv, which includes waiting for the previous stage; stage 0's send, which includes
  waiting for the next stage to take the previous batch);
* the overlap: the fraction of the run in which stages 0 and 1 were busy at once (batches
  in flight give overlap; stages taking turns give none);
* per step: stage 0's send time and bytes, the later stages' recv time;
* the first ``--trace-steps`` steps as a timeline, one row per stage.

On a machine whose cores the stages share, more stages are not faster: the busy fractions,
the overlap and the per-step transfer costs are the figures to carry to a machine with a
device per stage. Not timed here: run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

import engine
from engine.params import SamplingParams


def _busy_intervals(trace: list[tuple[Any, ...]], stages: int) -> dict[int, list[tuple[int, float, float]]]:
    """Per stage: (step, busy start, busy end) of each step, waits taken off (see the
    module docstring)."""
    out: dict[int, list[tuple[int, float, float]]] = {s: [] for s in range(stages)}
    for step, rank, start, end, recv, send in trace:
        if rank >= stages:
            continue  # a tensor-parallel peer of a stage: not traced apart
        if rank == 0:
            out[0].append((step, start, max(start, end - send)))
        else:
            out[rank].append((step, min(end, start + recv), end))
    return out


def _overlap(a: list[tuple[int, float, float]], b: list[tuple[int, float, float]]) -> float:
    total = 0.0
    for _, s0, e0 in a:
        for _, s1, e1 in b:
            total += max(0.0, min(e0, e1) - max(s0, s1))
    return total


def _timeline(busy: dict[int, list[tuple[int, float, float]]], steps: int, width: int = 96) -> list[str]:
    """The first ``steps`` steps as rows of characters: a step's id (mod 10) where a stage
    is busy with it, ``.`` where it is idle."""
    first = sorted({s for rows in busy.values() for s, _, _ in rows})[:steps]
    keep = {s: [(s_, a, b) for s_, a, b in rows if s_ in first] for s, rows in busy.items()}
    t0 = min(a for rows in keep.values() for _, a, _ in rows)
    t1 = max(b for rows in keep.values() for _, _, b in rows)
    scale = width / max(t1 - t0, 1e-9)
    lines = []
    for stage, rows in keep.items():
        line = ["."] * width
        for step, a, b in rows:
            for i in range(int((a - t0) * scale), max(int((a - t0) * scale) + 1, int((b - t0) * scale))):
                line[min(i, width - 1)] = str(step % 10)
        lines.append(f"stage {stage} |{''.join(line)}|")
    lines.append(f"          {1e3 * (t1 - t0):.1f} ms across")
    return lines


async def _run(model: str, size: int, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    async with engine.open_engine(model, pipeline_parallel_size=size, dtype=args.dtype,
                                  kv_cache_memory=args.kv_cache_memory,
                                  max_num_seqs=len(prompts)) as eng:
        runner = eng._parts.runner
        trace = getattr(runner, "trace", None)
        if trace is not None:
            trace.clear()  # the warm-up is not the workload
            times = runner.group.place.stage.times
            sent0, send0 = times.bytes_sent, times.send_seconds
        steps0 = eng.statistics().steps
        outputs: dict[int, list[int]] = {}

        async def one(i: int) -> None:
            stream = await eng.submit(prompts[i], params)
            async with stream:
                outputs[i] = [t async for out in stream for t in out.token_ids]

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        wall = time.perf_counter() - t0
        stats = eng.statistics()
        row: dict[str, Any] = {
            "pp": size, "seconds": wall, "tokens": sum(len(v) for v in outputs.values()),
            "steps": stats.steps - steps0, "planned_ahead": stats.planned_ahead,
            "tokens_list": [outputs[i] for i in range(len(prompts))],
        }
        row["tokens_per_s"] = row["tokens"] / wall
        if trace is None:
            return row
        traced = list(trace)
        busy = _busy_intervals(traced, size)
        span = (max(e for _, r, _, e, _, _ in traced) - min(s for _, r, s, _, _, _ in traced))
        steps = len(busy[0])
        row.update(
            busy_fraction=[sum(b - a for _, a, b in busy[s]) / span for s in range(size)],
            overlap_fraction=_overlap(busy[0], busy[1]) / span,
            send_us_per_step=1e6 * (times.send_seconds - send0) / max(1, steps),
            send_bytes_per_step=(times.bytes_sent - sent0) / max(1, steps),
            recv_us_per_step=[1e6 * sum(t[4] for t in traced if t[1] == s) / max(1, steps)
                              for s in range(1, size)],
            timeline=_timeline(busy, args.trace_steps),
        )
        return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model folder or GGUF (default: a random Llama)")
    parser.add_argument("--sizes", default="1,2", help="pipeline-parallel sizes, comma-separated")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-memory", type=int, default=128 * 2**20)
    parser.add_argument("--trace-steps", type=int, default=12)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from engine.models.testing import write_tiny_model

            model = str(write_tiny_model(Path(tmp) / "llama", "llama", overrides={
                "hidden_size": args.hidden, "num_hidden_layers": args.layers,
                "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
                "intermediate_size": args.hidden * 11 // 4 // 64 * 64,
                "max_position_embeddings": 4096}))
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 200) for _ in range(args.prompt_len)] for _ in range(args.requests)]
        rows = [trio.run(_run, model, size, args, prompts) for size in sizes]
    base = rows[0]["tokens_list"]
    print(f"{'pp':>3} {'tok/s':>8} {'steps':>6} {'ahead':>6} {'same':>5} {'busy per stage':>18} "
          f"{'overlap':>8} {'send us/step':>13} {'send B/step':>12} {'recv us/step':>13}")
    for row in rows:
        same = "yes" if row["tokens_list"] == base else "NO"
        extra = ""
        if "busy_fraction" in row:
            extra = (f"{'/'.join(f'{b:.2f}' for b in row['busy_fraction']):>18} "
                     f"{row['overlap_fraction']:8.2f} {row['send_us_per_step']:13.1f} "
                     f"{row['send_bytes_per_step']:12.0f} "
                     f"{'/'.join(f'{r:.0f}' for r in row['recv_us_per_step']):>13}")
        print(f"{row['pp']:>3} {row['tokens_per_s']:8.1f} {row['steps']:>6} {row['planned_ahead']:>6} "
              f"{same:>5} {extra}")
    for row in rows:
        if "timeline" in row:
            print(f"\npp={row['pp']}: the first {args.trace_steps} steps (digit: step id mod 10)")
            print("\n".join(row["timeline"]))
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{k: v for k, v in r.items() if k != "tokens_list"} for r in rows], indent=2))


if __name__ == "__main__":
    main()
