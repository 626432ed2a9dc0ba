"""Tensor parallelism: which slice of each layer a rank holds, and the collectives that
join the slices (issue 21).

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


SINGLE = TensorParallel()
