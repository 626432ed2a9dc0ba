"""Tensor and pipeline parallelism: which slice of each layer a rank holds, the collectives
that join the slices (issue 21), and which layers a pipeline stage runs (issue 39).

A model is built for one :class:`TensorParallel` (``SINGLE`` when the engine runs one
rank). Rank ``r`` of ``N`` keeps rows ``shard_range(dim, r, N)`` of every column-parallel
weight (q/k/v, gate/up: output features), the matching columns of every row-parallel
weight (o, down: input features, followed by :meth:`TensorParallel.all_reduce`), its KV
heads (replicated where there are fewer KV heads than ranks), and its slice of the
vocabulary for the embedding and the LM head (logits joined by
:meth:`TensorParallel.all_gather_last`). With ``world_size == 1`` every method is the
identity, so the one-rank path pays nothing.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch


def shard_range(total: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, stop)`` of rank ``rank``'s equal share of ``total`` items; ``total`` must
    divide by ``world_size`` (the caller refuses a model where it does not, naming it)."""
    if total % world_size:
        raise ValueError(f"{total} does not divide by tensor-parallel size {world_size}")
    size = total // world_size
    return rank * size, (rank + 1) * size


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group. ``group`` is the
    ``torch.distributed`` process group (``None``: the default group, or no group at all
    when ``world_size == 1``)."""

    rank: int = 0
    world_size: int = 1
    group: Any = None
    # Which pipeline stage this rank's slice belongs to (WHOLE: every layer). It rides on
    # the tensor-parallel description so that everything a rank builds from it (the model,
    # its KV pool, the pool's sizing) sees both cuts.
    stage: PipelineStage = dataclasses.field(default_factory=lambda: WHOLE)
    # Expert parallelism (vLLM's --enable-expert-parallel): a mixture-of-experts layer's
    # routed experts are dealt out whole, E / N to a rank, instead of each rank keeping a
    # slice of every expert (engine.models.layers.moe). Attention, dense layers and shared
    # experts are cut as tensor parallelism cuts them either way.
    expert_parallel: bool = False

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` joined along the last dimension, in rank order."""
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def stage_layers(num_layers: int, num_stages: int,
                 partition: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """Each pipeline stage's ``[start, stop)`` of ``num_layers`` decoder layers.

    ``partition`` gives every stage's layer count (vLLM's ``VLLM_PP_LAYER_PARTITION``,
    e.g. ``(4, 4)``); without it the layers split evenly, and the stages before the last
    take one more each while layers remain (as vLLM's ``get_pp_indices`` does: the last
    stage also runs the final norm, the LM head and sampling). Raises ``ValueError`` for a
    partition that does not fit."""
    if num_stages < 1:
        raise ValueError(f"pipeline-parallel size must be at least 1, got {num_stages}")
    if partition is None:
        if num_layers < num_stages:
            raise ValueError(f"{num_layers} layers cannot be split into {num_stages} "
                             "pipeline stages (each stage needs a layer)")
        counts = [num_layers // num_stages] * num_stages
        for i in range(2, num_layers % num_stages + 2):
            counts[-i] += 1
    else:
        counts = list(partition)
        if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(f"pipeline layer partition {','.join(map(str, counts))} must give "
                             f"each of {num_stages} stages at least one layer, "
                             f"{num_layers} layers in all")
    bounds, start = [], 0
    for n in counts:
        bounds.append((start, start + n))
        start += n
    return bounds


@dataclasses.dataclass(slots=True)
class StageTimes:
    """What a stage spent passing tensors (the benchmark reads it): in ``recv`` (waiting for
    the previous stage included) and in ``send`` (queueing, and waiting for the previous
    send to be taken), and the bytes sent."""

    recv_seconds: float = 0.0
    send_seconds: float = 0.0
    bytes_sent: int = 0


@dataclasses.dataclass(frozen=True)
class PipelineStage:
    """This process's pipeline stage: decoder layers ``[start, stop)`` of the model (``stop``
    ``None``: to the last). The first stage embeds the tokens; the last runs the final
    norm, the LM head and sampling; between stages the hidden states (and the residual
    stream, where the family keeps one) go from this rank to ``next_rank`` (the same
    tensor-parallel rank of the next stage, a global rank of the default process group)
    with point-to-point sends, and come from ``prev_rank``.

    A send is asynchronous (``isend``): the stage goes on to its next batch while the
    next stage takes this one; it waits for its previous send before the next, so at most
    one batch's tensors are in flight from each rank."""

    index: int = 0
    count: int = 1
    start: int = 0
    stop: int | None = None
    prev_rank: int = -1
    next_rank: int = -1
    # The isend in flight (mutable state of a frozen description: compared by nobody).
    _pending: list = dataclasses.field(default_factory=list, compare=False, repr=False)
    times: StageTimes = dataclasses.field(default_factory=StageTimes, compare=False, repr=False)

    @property
    def enabled(self) -> bool:
        return self.count > 1

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def layer_range(self, num_layers: int) -> range:
        return range(self.start, num_layers if self.stop is None else self.stop)

    def send(self, tensors: list[torch.Tensor]) -> None:
        """Send ``tensors`` to the next stage (returns once queued)."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        self.wait_sent()
        for t in tensors:
            t = t.contiguous()
            self._pending.append((t, dist.isend(t, self.next_rank)))
            self.times.bytes_sent += t.numel() * t.element_size()
        self.times.send_seconds += time.perf_counter() - t0

    def wait_sent(self) -> None:
        """Wait until the last batch's tensors have been taken by the next stage."""
        while self._pending:
            _, work = self._pending.pop(0)
            work.wait()

    def drop_sent(self) -> None:
        """Forget the sends in flight (the group is being torn down after a fault)."""
        self._pending.clear()

    def recv(self, count: int, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> list[torch.Tensor]:
        """``count`` tensors of ``shape`` from the previous stage, in the order sent."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        out = [torch.empty(shape, dtype=dtype, device=device) for _ in range(count)]
        for t in out:
            dist.recv(t, self.prev_rank)
        self.times.recv_seconds += time.perf_counter() - t0
        return out


WHOLE = PipelineStage()
"""One stage holding every layer: no pipeline."""


SINGLE = TensorParallel()


def pipeline_ranks(tp_size: int, pp_size: int) -> list[list[int]]:
    """The global ranks of each stage's tensor-parallel group: stage ``s`` holds ranks
    ``s * tp_size .. (s + 1) * tp_size - 1`` (rank 0 is stage 0's tensor-parallel rank 0)."""
    return [list(range(s * tp_size, (s + 1) * tp_size)) for s in range(pp_size)]


def place_rank(rank: int, tp_size: int, pp_size: int, num_layers: int,
               partition: tuple[int, ...] | None = None, group: Any = None) -> TensorParallel:
    """Global rank ``rank``'s place in a ``tp_size`` x ``pp_size`` layout: its tensor-parallel
    rank within its stage (``group``: that stage's process group) and its stage's layers."""
    index, tp_rank = divmod(rank, tp_size)
    start, stop = stage_layers(num_layers, pp_size, partition)[index]
    stage = PipelineStage(index, pp_size, start, stop,
                          prev_rank=rank - tp_size if index > 0 else -1,
                          next_rank=rank + tp_size if index < pp_size - 1 else -1)
    return TensorParallel(tp_rank, tp_size, group, stage)
