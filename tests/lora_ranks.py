"""LoRA adapters on spawned tensor- and pipeline-parallel ranks (issue 36): what each rank
of ``tp_ranks.run_ranks`` runs for tests/test_lora_parallel.py. For every ``(tp, pp)``
layout it takes its place (its stage's layers, its tensor-parallel group within the stage,
as ``pp_ranks.pipeline_greedy`` lays them out), builds a :class:`ModelRunner` with LoRA
slots, and runs every prompt under the base model and each adapter in the same steps: a
whole-prompt prefill whose logits it keeps at every position, then greedy decoding. This
module imports only what the ranks need: spawning re-imports it in every child."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from pp_ranks import _StageDriver

from engine.parallel import TensorParallel, pipeline_ranks, place_rank

BLOCK_SIZE = 4
CHUNK = 5  # prefill chunk of the greedy runs: the longer prompts take several steps
NEW_TOKENS = 32  # greedy tokens per run: as many as tests/test_lora.py asks of peft


def lora_layouts(world: TensorParallel, layouts: list[tuple[int, int]], models: list[tuple[str, str, list]],
                 num_layers: int) -> dict[tuple[int, int], dict]:
    """For each ``(tp, pp)`` of ``layouts``: per model key, this rank's
    ``(logits, tokens, held)`` (:func:`_run`); ranks beyond ``tp * pp`` sit it out."""
    out = {}
    for tp_size, pp_size in layouts:
        size = tp_size * pp_size
        # Every rank of the world takes part in making each group, member or not.
        subset = None if size == world.world_size else dist.new_group(list(range(size)))
        stage_groups = [dist.new_group(r) for r in pipeline_ranks(tp_size, pp_size)] if tp_size > 1 else None
        if world.rank >= size:
            continue
        group = stage_groups[world.rank // tp_size] if stage_groups else None
        place = place_rank(world.rank, tp_size, pp_size, num_layers, group=group)
        last = (pp_size - 1) * tp_size
        out[(tp_size, pp_size)] = {key: _run(place, path, runs, last, subset) for key, path, runs in models}
    return out


def _run(place: TensorParallel, path: str, runs: list[tuple[list[int], Any]], last: int, group: Any) -> tuple:
    """``runs``: (prompt, LoraAdapter or None) pairs, all in the same steps. Returns the
    last stage's fp32 logits at every prompt position (None on earlier stages), the greedy
    tokens of every run, and what the rank's slots hold."""
    runner = _runner(path, place)
    logits, tokens = _logits_and_tokens(runner, _StageDriver(runner, last, group), runs)
    slots = runner.lora.slots
    held = {"layers": slots.layer_ids, "loads": runner.lora.loads,
            "shapes": {key: (tuple(w.a.shape), tuple(w.b.shape)) for key, w in slots.wrappers[0].items()},
            "modules": sorted({i for a in runner.lora._host.values() for i, _ in a.modules}),
            # The first MoE layer's expert pools (a13, b13, a2, b2), where the model has one.
            "experts": next((tuple(tuple(t.shape) for t in (e.a13, e.b13, e.a2, e.b2))
                             for e in slots.experts if e is not None), None)}
    dist.barrier(group=group)
    return logits, tokens, held


def one_rank(path: str, runs: list[tuple[list[int], Any]]) -> tuple:
    """:func:`_run`'s logits and tokens from one rank holding the whole model (the oracle
    of a GGUF kept in blocks, whose C kernels peft does not run)."""
    from engine.parallel import SINGLE

    runner = _runner(path, SINGLE)
    return _logits_and_tokens(runner, runner, runs)


def _runner(path: str, place: TensorParallel) -> Any:
    from engine.models.loader import load_model
    from engine.ops import get_ops
    from engine.runner.lora import LoraSettings
    from engine.runner.model_runner import ModelRunner

    loaded = load_model(path, dtype="float32", lazy=place.enabled or place.stage.enabled)  # a rank reads its cut
    return ModelRunner(loaded, device="cpu", ops=get_ops("cpu"), num_blocks=128, block_size=BLOCK_SIZE,
                       max_num_batched_tokens=512, max_num_seqs=16, tp=place,
                       lora=LoraSettings(4, 16, 4, torch.float32))


def _logits_and_tokens(runner: Any, driver: Any, runs: list[tuple[list[int], Any]]) -> tuple:
    from greedy_driver import run_greedy

    prompts = [p for p, _ in runs]
    loras = [a for _, a in runs]
    logits = _prefill_logits(runner, prompts, loras)
    tokens = [[s.token_id for s in run] for run in
              run_greedy(driver, prompts, NEW_TOKENS, chunk_size=CHUNK, block_size=BLOCK_SIZE, loras=loras)]
    return logits, tokens


def _prefill_logits(runner: Any, prompts: list[list[int]], loras: list) -> list[torch.Tensor] | None:
    """Every prompt prefilled whole in one step, each with its adapter, through every stage;
    the last stage's logits at every position (the runner samples only the last rows)."""
    from engine.messages import NewRequest, ScheduledChunk, StepPlan
    from engine.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1)
    ids = [f"p{i}" for i in range(len(prompts))]
    runner.execute(StepPlan(0, tuple(NewRequest(r, tuple(p), params, (), lora=a)
                                     for r, p, a in zip(ids, prompts, loras, strict=True)), (), ()))
    chunks, start = [], 0
    for r, p in zip(ids, prompts, strict=True):
        n = -(-len(p) // runner.block_size)
        chunks.append(ScheduledChunk(r, 0, len(p), tuple(range(start, start + n)), False))
        start += n
    states = [runner._state(c) for c in chunks]
    input_ids, positions, meta, _ = runner._batch.prepare(chunks, states)
    with runner._lora_step(chunks, states):
        hidden = runner.model.forward(input_ids, positions, meta, runner.kv_caches)
    stage = runner.tp.stage
    logits = None if not stage.last else list(runner.model.compute_logits(hidden).split([len(p) for p in prompts]))
    stage.wait_sent()
    runner.execute(StepPlan(1, (), (), tuple(ids)))
    return logits


__all__ = ["lora_layouts", "one_rank"]
