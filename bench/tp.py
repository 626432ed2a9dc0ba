"""Tensor parallelism: throughput at each tensor-parallel size, and what the ranks' joining
costs per step (the all-reduces, the logits' all-gather, the step's broadcast); with
``--memory``, each rank's peak host memory instead.

    .venv/bin/python bench/tp.py [--model PATH] [--sizes 1,2] [--requests 16]
                                 [--concurrency 8] [--prompt-len 128] [--max-tokens 64]
                                 [--hidden 1024] [--layers 8] [--heads 16] [--kv-heads 8]
                                 [--dtype float32] [--quantization none] [--memory]
                                 [--json out.json]

``--memory``: each size runs in a fresh process (a high-water mark only rises), which opens
the engine, runs a few greedy requests and reports every rank's peak resident memory
(``VmHWM`` in ``/proc/PID/status``: anonymous and file-backed pages, the load's transients
included) and its resident memory then (``VmRSS``), with the weight bytes rank 0 holds. A
rank of N reads only its slices (issue 41), so its peak is its ``1/N`` of the weights plus
the runtime; with the random model, a tiny model with the same tokenizer gives the
runtime's own peak (the ``baseline`` row). Not a timing: the figures do not depend on the
machine's load.

Without ``--model`` a random Llama of ``--hidden``/``--layers``/``--heads`` is written to a
temporary folder (SmolLM2's 9 query heads split over 1 or 3 ranks only: ``--model`` the
SmolLM2 GGUF with ``--sizes 1,3 --dtype float32``; its weights are dequantized). Every size
runs the same greedy requests through the embedded engine (``--tensor-parallel-size N``,
``mp`` workers) and must give the same tokens. Printed per size: output tokens/s over the
whole run, engine steps, and per step: rank 0's time in all-reduces (the row-parallel
layers' sums; per layer too) and in the logits' all-gathers, measured on rank 0, so they
include waiting for the slowest rank; the step's broadcast (packing the plan and writing
it to every worker) and its size; and rank 0's wait for the workers' answers after its
own step. On a machine whose cores the ranks share, more ranks are not faster: the
per-step and per-layer costs are the figures to carry to a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

import engine
from engine.parallel import TensorParallel
from engine.params import SamplingParams

_TIMES = {"all_reduce": [0.0, 0], "all_gather_last": [0.0, 0]}


def _time_collectives() -> None:
    """Wrap rank 0's collectives (this process) to add up their time and count."""
    for name in _TIMES:
        inner = getattr(TensorParallel, name)

        def timed(self: TensorParallel, tensor: Any, _inner: Any = inner, _name: str = name) -> Any:
            if self.world_size == 1:
                return _inner(self, tensor)
            t0 = time.perf_counter()
            out = _inner(self, tensor)
            _TIMES[_name][0] += time.perf_counter() - t0
            _TIMES[_name][1] += 1
            return out

        setattr(TensorParallel, name, timed)


async def _run(model: str, size: int, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    for v in _TIMES.values():
        v[0], v[1] = 0.0, 0
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    async with engine.open_engine(model, tensor_parallel_size=size, dtype=args.dtype,
                                  quantization=args.quantization, kv_cache_memory=args.kv_cache_memory,
                                  max_num_seqs=args.concurrency) as eng:
        runner = eng._parts.runner
        layers = runner.config.num_hidden_layers
        group = getattr(runner, "group", None)
        for v in _TIMES.values():  # the warm-up's collectives are not the workload's
            v[0], v[1] = 0.0, 0
        if group is not None:
            group.stats.__init__()
        steps0 = eng.statistics().steps
        outputs: dict[int, list[int]] = {}
        limiter = trio.Semaphore(args.concurrency)

        async def one(i: int) -> None:
            async with limiter:
                stream = await eng.submit(prompts[i], params)
                async with stream:
                    outputs[i] = [t async for out in stream for t in out.token_ids]

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        wall = time.perf_counter() - t0
        steps = eng.statistics().steps - steps0
    tokens = sum(len(v) for v in outputs.values())
    row: dict[str, Any] = {
        "tp": size, "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
        "steps": steps, "tokens_list": [outputs[i] for i in range(len(prompts))],
    }
    if group is not None and steps:
        s = group.stats
        ar, ag = _TIMES["all_reduce"], _TIMES["all_gather_last"]
        row.update(
            all_reduce_ms_per_step=1e3 * ar[0] / steps, all_reduces_per_step=ar[1] / steps,
            all_reduce_ms_per_layer=1e3 * ar[0] / steps / layers,
            all_gather_ms_per_step=1e3 * ag[0] / steps,
            broadcast_us_per_step=1e6 * s.broadcast_seconds / max(1, s.steps),
            broadcast_bytes_per_step=s.broadcast_bytes / max(1, s.steps),
            answer_wait_us_per_step=1e6 * s.wait_seconds / max(1, s.steps),
        )
    return row


def _status_kib(pid: int, key: str) -> int:
    """A ``/proc/PID/status`` figure in KiB (VmHWM, VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


async def _memory_one(model: str, size: int, args: argparse.Namespace) -> dict[str, Any]:
    """In this (fresh) process: open the engine at ``size`` ranks, run a few requests, and
    read every rank's memory figures."""
    from engine.models.layers.linear import weight_bytes

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    async with engine.open_engine(model, tensor_parallel_size=size, dtype=args.dtype,
                                  quantization=args.quantization, kv_cache_memory=args.kv_cache_memory,
                                  max_num_seqs=4) as eng:
        for prompt in ([5, 6, 7, 8], [40, 41, 42]):
            stream = await eng.submit(prompt, params)
            async with stream:
                _ = [out async for out in stream]
        runner = eng._parts.runner
        rank0 = getattr(runner, "rank0", runner)
        pids = [os.getpid(), *(runner.worker_pids() if size > 1 else [])]
        ranks = [{"rank": r, "pid": pid, "hwm_mib": _status_kib(pid, "VmHWM") / 1024,
                  "rss_mib": _status_kib(pid, "VmRSS") / 1024} for r, pid in enumerate(pids)]
        return {"tp": size, "ranks": ranks, "rank0_weights_mib": weight_bytes(rank0.model) / 2**20}


def _memory_child(model: str, size: int, args: argparse.Namespace) -> dict[str, Any]:
    child = [sys.executable, __file__, "--memory-child", str(size), "--model", model, "--dtype", args.dtype,
             "--quantization", args.quantization, "--kv-cache-memory", str(args.kv_cache_memory)]
    done = subprocess.run(child, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"tp={size} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _memory(model: str, sizes: list[int], args: argparse.Namespace, baseline: str | None) -> list[dict[str, Any]]:
    """Each size in a fresh process; ``baseline``: a tiny model with the same tokenizer, whose
    peak is the runtime's (torch, the engine, tokenizer and grammar tables) with next to no
    weights."""
    rows = [_memory_child(model, size, args) for size in sizes]
    if baseline is not None:
        rows.append({**_memory_child(baseline, 1, args), "baseline": True})
    print(f"{'tp':>8} {'rank':>5} {'peak MiB':>9} {'rss MiB':>8} {'weights MiB':>12} {'peak - weights':>15}")
    for row in rows:
        w = row["rank0_weights_mib"]  # every rank's share is equal: the heads and widths divide
        for r in row["ranks"]:
            name = "baseline" if row.get("baseline") else str(row["tp"])
            print(f"{name:>8} {r['rank']:>5} {r['hwm_mib']:9.1f} {r['rss_mib']:8.1f} {w:12.1f} "
                  f"{r['hwm_mib'] - w:15.1f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model folder or GGUF (default: a random Llama)")
    parser.add_argument("--sizes", default="1,2", help="tensor-parallel sizes, comma-separated")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-memory", type=int, default=256 * 2**20)
    parser.add_argument("--quantization", default="none",
                        help="none: dequantize a GGUF (the throughput figures' default); auto keeps its blocks")
    parser.add_argument("--memory", action="store_true", help="each rank's peak host memory per size")
    parser.add_argument("--memory-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if args.memory_child:
        print(json.dumps(trio.run(_memory_one, args.model, args.memory_child, args)))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    _time_collectives()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from engine.models.testing import write_tiny_model

            model = str(write_tiny_model(Path(tmp) / "llama", "llama", overrides={
                "hidden_size": args.hidden, "num_hidden_layers": args.layers,
                "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
                "intermediate_size": args.hidden * 11 // 4 // 64 * 64,
                "max_position_embeddings": 4096}))
        if args.memory:
            baseline = None
            if args.model is None:
                from engine.models.testing import write_tiny_model

                baseline = str(write_tiny_model(Path(tmp) / "tiny", "llama"))
            rows = _memory(model, sizes, args, baseline)
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=2))
            return
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 200) for _ in range(args.prompt_len)] for _ in range(args.requests)]
        rows = [trio.run(_run, model, size, args, prompts) for size in sizes]
    base = rows[0]["tokens_list"]
    print(f"{'tp':>3} {'tok/s':>8} {'steps':>6} {'same':>5} {'AR ms/step':>11} {'AR/step':>8} "
          f"{'AR ms/layer':>12} {'AG ms/step':>11} {'bcast us/step':>14} {'bcast B/step':>13} "
          f"{'wait us/step':>13}")
    for row in rows:
        same = "yes" if row["tokens_list"] == base else "NO"
        extra = (f"{row['all_reduce_ms_per_step']:11.3f} {row['all_reduces_per_step']:8.1f} "
                 f"{row['all_reduce_ms_per_layer']:12.4f} {row['all_gather_ms_per_step']:11.3f} "
                 f"{row['broadcast_us_per_step']:14.1f} {row['broadcast_bytes_per_step']:13.0f} "
                 f"{row['answer_wait_us_per_step']:13.1f}") if "all_reduce_ms_per_step" in row else ""
        print(f"{row['tp']:>3} {row['tokens_per_s']:8.1f} {row['steps']:>6} {same:>5} {extra}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{k: v for k, v in r.items() if k != "tokens_list"} for r in rows], indent=2))


if __name__ == "__main__":
    main()
