"""Pipeline parallelism's model math on spawned ranks (issue 39): the tensor-parallel
harness (``tp_ranks.run_ranks``) spawns the processes once; each lays out its place in every
``(tp, pp)`` layout asked for (its stage's layers, its tensor-parallel group within the
stage) and greedy-decodes the same prompts as ``tp_ranks.greedy_with_logits``.

The last stage samples; its tokens reach the earlier stages as the engine's pipeline runner
hands them back (:meth:`ModelRunner.accept`), here by a broadcast from the last stage.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import tp_ranks
from tp_ranks import BLOCK_SIZE, CHUNK, NEW_TOKENS, prompts

from engine.parallel import TensorParallel, pipeline_ranks, place_rank


class _StageDriver:
    """A stage's runner as the greedy driver sees it: every stage runs each plan, and the
    last stage's result (broadcast by its rank ``last``) is every stage's answer."""

    def __init__(self, runner: Any, last: int, group: Any) -> None:
        self._runner = runner
        self._last = last
        self._group = group

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def execute(self, plan: Any) -> Any:
        result = self._runner.execute(plan)
        box = [result]
        dist.broadcast_object_list(box, src=self._last, group=self._group)
        if not self._runner.tp.stage.last:
            final = box[0]
            self._runner.accept([(t.sample_id, t.token_id) for t in final.sampled],
                                [f.sample_id for f in final.failed])
        self._runner.tp.stage.wait_sent()
        return box[0]


def pipeline_greedy(world: TensorParallel, layouts: list[tuple[int, int]],
                    models: list[tuple[str, str, bool]], num_layers: int) -> dict[tuple[int, int], dict]:
    """For each ``(tp, pp)`` of ``layouts``: :func:`tp_ranks.greedy_with_logits`'s results on
    this rank's place (ranks beyond ``tp * pp`` sit it out), keyed by layout."""
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
        out[(tp_size, pp_size)] = _greedy_all(place, models, last, subset)
    return out


def _greedy_all(place: TensorParallel, models: list[tuple[str, str, bool]], last: int, subset: Any) -> dict:
    from engine.ops.cpu import qmatmul as cq

    available = cq.available
    out = {}
    try:
        for key, path, c_kernels in models:
            cq.available = available if c_kernels else (lambda: False)
            out[key] = _greedy(place, path, last, subset)
            dist.barrier(group=subset)
    finally:
        cq.available = available
    return out


def _greedy(place: TensorParallel, path: str, last: int, group: Any) -> tuple:
    from greedy_driver import generate_greedy

    from engine.models.loader import load_model
    from engine.ops import get_ops
    from engine.runner.model_runner import ModelRunner

    # A stage reads only its layers (and its slices of them), as the engine's ranks do.
    loaded = load_model(path, dtype="float32", lazy=True)
    runner = ModelRunner(loaded, device="cpu", ops=get_ops("cpu"), num_blocks=64, block_size=BLOCK_SIZE,
                         max_num_batched_tokens=64, max_num_seqs=4, tp=place)
    read = getattr(loaded.weights, "bytes_read", None)
    del loaded
    steps: list[torch.Tensor] = []
    if place.stage.last:
        compute = runner.model.compute_logits

        def record(hidden: torch.Tensor, compute=compute, steps=steps) -> torch.Tensor:
            logits = compute(hidden)
            steps.append(logits.clone())
            return logits

        runner.model.compute_logits = record  # type: ignore[method-assign]
    tokens = generate_greedy(_StageDriver(runner, last, group), prompts(runner.config.vocab_size), NEW_TOKENS,
                             chunk_size=CHUNK, block_size=BLOCK_SIZE)
    model = runner.model
    held = {"layers": len(model.layers), "kv_layers": len(runner.kv_caches),
            "embed": model.embed is not None, "tied": model.config.tie_word_embeddings, "head": model.lm_head is not None, "read": read}
    return tokens, steps, held


__all__ = ["pipeline_greedy", "tp_ranks"]
