"""LoRA beside the base projections: a fixed pool of adapter slots, and the wrapper that
adds an adapter's delta to a projection's output.

:class:`LoraSlots` is built once per model (``Decoder.enable_lora``): for every targeted
projection of every layer it preallocates ``a`` [S, n * R, in] and ``b`` [S, n * R, out]
(``S`` = ``--max-loras`` slots, ``R`` = ``--max-lora-rank``, ``n`` the projection's fused
slices; layout in ``engine.models.lora``), so loading an adapter into a slot copies into
memory that is already there and a step never allocates. The base weights are untouched:
a dense ``Linear`` or a GGUF ``QuantLinear`` computes its output as before, and
:class:`LoraLinear` adds ``B[slot] @ (A[slot] @ x)`` per token in the activation dtype (the
kernel's ``Ops.lora_add``; ``b`` holds B transposed), as llama.cpp applies adapters beside quantized weights.

Which slot each token uses is the step's :class:`LoraSegments`, which the runner sets on
the slots before the forward and clears after it (:meth:`LoraSlots.step`): the model owns
this state, and every wrapper of the model reads it from the one :class:`LoraSlots` it was
built with, so no forward signature changes for a per-step table.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch

from engine.models.config import ModelConfig
from engine.models.lora import LoraTarget, LoraWeights, lora_targets
from engine.ops import LoraSegments, Ops


class LoraLinear:
    """A projection plus the LoRA delta of each token's slot (none for base-model tokens)."""

    __slots__ = ("base", "target", "a", "b", "slots", "bounds")

    def __init__(self, base: Any, target: LoraTarget, a: torch.Tensor, b: torch.Tensor, slots: LoraSlots) -> None:
        self.base = base
        self.target = target
        self.a = a  # [S, n * R, in]
        self.b = b  # [S, n * R, out]: B transposed
        self.slots = slots
        # The fused slices' column bounds: b is block diagonal, which the kernel may skip.
        self.bounds = (0, *itertools.accumulate(rows for _, rows in target.slices))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        segments = self.slots.segments
        if segments is not None:
            self.slots.ops.lora_add(out.view(-1, out.shape[-1]), x.reshape(-1, x.shape[-1]), self.a, self.b, segments,
                                   self.bounds)
        return out

    def describe(self) -> Any:
        """The base projection as the fused CPU decode step reads it (that step runs only
        when no token of the step has an adapter)."""
        return self.base.describe()

    def __getattr__(self, name: str) -> Any:  # widened, nbytes, ... of the base projection
        return getattr(self.base, name)


class LoraSlots:
    """The adapter slots of one model: every targeted projection's A and B buffers, which
    adapter each slot holds, and the current step's token-to-slot table."""

    def __init__(self, config: ModelConfig, layers: list[Any], ops: Ops, *, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.ops = ops
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.segments: LoraSegments | None = None
        self.wrappers: list[dict[str, LoraLinear]] = []
        for i, layer in enumerate(layers):
            wrapped = {}
            for target in lora_targets(config, i):
                n = len(target.slices)
                a = torch.zeros((max_loras, n * max_rank, target.in_features), dtype=dtype, device=device)
                b = torch.zeros((max_loras, n * max_rank, target.out_features), dtype=dtype, device=device)
                lin = LoraLinear(getattr(layer, target.key), target, a, b, self)
                setattr(layer, target.key, lin)
                wrapped[target.key] = lin
            self.wrappers.append(wrapped)

    @property
    def nbytes(self) -> int:
        return sum(w.a.numel() * w.a.element_size() + w.b.numel() * w.b.element_size()
                   for layer in self.wrappers for w in layer.values())

    def write(self, slot: int, adapter: LoraWeights) -> None:
        """Copy ``adapter`` into ``slot`` (its untargeted slices, and the rank padding, zero)."""
        r, big_r = adapter.rank, self.max_rank
        for i, wrapped in enumerate(self.wrappers):
            for lin in wrapped.values():
                lin.a[slot].zero_()
                lin.b[slot].zero_()
                row = 0
                for j, (module, rows) in enumerate(lin.target.slices):
                    pair = adapter.modules.get((i, module))
                    if pair is not None:
                        a, b = pair
                        lin.a[slot, j * big_r : j * big_r + r].copy_(a)
                        lin.b[slot, j * big_r : j * big_r + r, row : row + rows].copy_(b.T)
                    row += rows

    @contextlib.contextmanager
    def step(self, segments: LoraSegments | None) -> Iterator[None]:
        """The forward passes inside run with ``segments`` (None or inactive: base only)."""
        self.segments = segments if segments is not None and segments.active else None
        try:
            yield
        finally:
            self.segments = None


__all__ = ["LoraLinear", "LoraSlots"]
