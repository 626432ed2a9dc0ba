"""Run a function on N tensor-parallel ranks, each a spawned process, joined by gloo over a
local TCP store (the tensor-parallel tests' harness, issue 21).

:func:`run_ranks` spawns the ranks once and hands each a :class:`TensorParallel`; the
function does as much as it likes (several models in a row) and returns what the test
compares, which comes back per rank. The parent holds the TCP store (port picked by the
OS, so no race for a free port), and the collectives time out, so a stuck rank fails the
test instead of hanging it. This module imports only what the ranks need: spawning
re-imports it in every child.
"""

from __future__ import annotations

import datetime
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.parallel import TensorParallel

TIMEOUT = datetime.timedelta(seconds=120)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """``[fn(TensorParallel(r, world_size), *args) for r in ranks]``, each on its own
    process; ``fn`` must be a module-level function (it is pickled by name)."""
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, timeout=TIMEOUT,
                          wait_for_workers=False)
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank_main, args=(fn, world_size, store.port, out, args),
                           nprocs=world_size, join=True, start_method="spawn")
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _rank_main(rank: int, fn: Callable[..., Any], world_size: int, port: int, out: str, args: tuple) -> None:
    torch.set_num_threads(1)  # tiny shapes; two ranks on a shared 2-core machine
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=TIMEOUT)
    try:
        result = fn(TensorParallel(rank, world_size), *args)
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# --- what the parity tests run on each rank ---------------------------------------------------

BLOCK_SIZE = 4
CHUNK = 8  # prefill chunk: the longer prompts take several steps
NEW_TOKENS = 32


def prompts(vocab: int) -> list[list[int]]:
    """Three prompts (1, 9 and 23 tokens: one chunk, two, three), seeded."""
    g = torch.Generator().manual_seed(4321)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 9, 23)]


def greedy_with_logits(tp: TensorParallel, models: list[tuple[str, str, bool]]) -> dict[str, tuple]:
    """For each ``(key, path, c_kernels)``: ``(tokens, logits, kept)`` of greedy decoding
    the :func:`prompts` through a :class:`ModelRunner` for ``tp``'s rank, chunked prefill
    then :data:`NEW_TOKENS` decode steps. ``logits``: every step's sampled rows, in fp32;
    ``kept``: the block formats of the quantized weights the rank's projections hold (a
    GGUF loads with its blocks kept). ``c_kernels`` False: the quantized weights are
    multiplied by the torch reference matmul instead of the C kernels."""
    from engine.ops.cpu import qmatmul as cq

    available = cq.available
    out = {}
    try:
        for key, path, c_kernels in models:
            cq.available = available if c_kernels else (lambda: False)
            out[key] = _greedy(tp, path)
    finally:
        cq.available = available
    return out


def expert_parallel_greedy_with_logits(tp: TensorParallel, models: list[tuple[str, str, bool]]) -> dict[str, tuple]:
    """:func:`greedy_with_logits` with the ranks' routed experts dealt out whole (expert
    parallelism)."""
    import dataclasses

    return greedy_with_logits(dataclasses.replace(tp, expert_parallel=True), models)


def _greedy(tp: TensorParallel, path: str) -> tuple:
    from greedy_driver import generate_greedy

    from engine.models.layers.linear import QuantLinear
    from engine.models.loader import load_model
    from engine.ops import get_ops
    from engine.runner.model_runner import ModelRunner

    # A split rank reads only its slices (as the engine's ranks do); one rank loads whole.
    loaded = load_model(path, dtype="float32", lazy=tp.enabled)
    runner = ModelRunner(loaded, device="cpu", ops=get_ops("cpu"), num_blocks=64, block_size=BLOCK_SIZE,
                         max_num_batched_tokens=64, max_num_seqs=4, tp=tp)
    del loaded  # the runner keeps its slice only
    steps: list[torch.Tensor] = []
    compute = runner.model.compute_logits

    def record(hidden: torch.Tensor, compute=compute, steps=steps) -> torch.Tensor:
        logits = compute(hidden)
        steps.append(logits.clone())
        return logits

    runner.model.compute_logits = record  # type: ignore[method-assign]
    tokens = generate_greedy(runner, prompts(runner.config.vocab_size), NEW_TOKENS, chunk_size=CHUNK,
                             block_size=BLOCK_SIZE)
    model = runner.model
    # RowParallel: its projection; a recurrent layer or an MLP block lacks some of them.
    linears = [model.lm_head] + [getattr(p, "linear", p) for layer in model.layers
                                 for p in (getattr(layer, n, None) for n in ("qkv", "o_proj", "gate_up", "down"))
                                 if p is not None]
    kept = sorted({part.fmt.name for q in linears if isinstance(q, QuantLinear) for part in q.parts})
    return tokens, steps, kept


# --- the bound: long greedy runs of GGUF models over the C kernels -------------------


def greedy_texts_by_size(tp: TensorParallel, runs: list[tuple[int, list[tuple[str, str]]]], texts: list[str],
                         new_tokens: int, chunk: int | None) -> dict[int, dict[str, tuple]]:
    """:func:`greedy_texts` for each ``(size, models)`` of ``runs`` on ranks ``0 .. size - 1``
    of this world (a group of their own where ``size`` is smaller: one spawn serves every
    size), by size; the ranks outside a group skip its models."""
    out = {}
    for size, models in runs:
        # Every rank takes part in making a group, members or not.
        group = None if size == tp.world_size else dist.new_group(list(range(size)))
        if tp.rank < size:
            out[size] = greedy_texts(TensorParallel(tp.rank, size, group), models, texts, new_tokens, chunk)
    return out


def greedy_texts(tp: TensorParallel, models: list[tuple[str, str]], texts: list[str], new_tokens: int,
                 chunk: int | None) -> dict[str, tuple]:
    """For each ``(key, path)``: ``(tokens, logits)`` of greedy decoding every text of
    ``texts`` (tokenized by the model's own tokenizer) together, ``new_tokens`` each, with
    prefill chunks of ``chunk`` tokens. ``logits``: every step's sampled rows stacked in
    fp32 on rank 0; on the other ranks a digest of their bytes (every rank gathers the same
    logits: the digests say so without the bytes crossing)."""
    import hashlib

    from greedy_driver import generate_greedy

    from engine.models.loader import load_model
    from engine.models.tokenizer import Tokenizer
    from engine.ops import get_ops
    from engine.runner.model_runner import ModelRunner

    out = {}
    for key, path in models:
        loaded = load_model(path, dtype="float32", lazy=tp.enabled)  # a split rank reads its slices
        tokenizer = Tokenizer.from_folder(loaded.folder)
        prompts = [tokenizer.encode(text) for text in texts]
        blocks = sum(-(-(len(p) + new_tokens) // BLOCK_SIZE) for p in prompts)
        runner = ModelRunner(loaded, device="cpu", ops=get_ops("cpu"), num_blocks=blocks, block_size=BLOCK_SIZE,
                             max_num_batched_tokens=256, max_num_seqs=len(prompts), tp=tp)
        del loaded
        steps: list[torch.Tensor] = []
        compute = runner.model.compute_logits

        def record(hidden: torch.Tensor, compute=compute, steps=steps) -> torch.Tensor:
            logits = compute(hidden)
            steps.append(logits.clone())
            return logits

        runner.model.compute_logits = record  # type: ignore[method-assign]
        tokens = generate_greedy(runner, prompts, new_tokens, chunk_size=chunk, block_size=BLOCK_SIZE)
        logits = torch.cat(steps)
        out[key] = (tokens, logits if tp.rank == 0 else hashlib.sha256(logits.numpy().tobytes()).hexdigest())
        del runner, steps
    return out
