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

Tensor and pipeline parallelism: the slots hold this rank's cut of each adapter, cut as the
base layer is (``engine.models.layers.shard``). A column-parallel projection (q/k/v by heads,
KV heads copied where there are fewer than ranks, gate/up by intermediate rows, Phi-3's
fused parts each cut so) keeps ``A`` whole and the rows of ``B`` that are its output rows;
its delta is this rank's output rows of the whole delta. A row-parallel projection (o,
down) keeps the columns of ``A`` that are its input features and ``B`` whole: its delta
``B (A_r x_r)`` is a partial sum, added to the rank's partial product before the base
layer's all-reduce sums both (the maths is linear: no collective of its own). Where a
row-parallel weight is gathered (GGUF panels on CPU, ``shard.RowParallel``) the rank
multiplies the whole input for its output rows, so it keeps ``A`` whole and ``B``'s rows of
those outputs. The scale is folded into ``B`` before the cut, so each part carries it once.
A pipeline stage builds slots for its own layers only, and keeps only those layers' part of
each adapter it reads (:meth:`LoraSlots.cut`).

A mixture-of-experts layer's routed experts get :class:`LoraExperts`: per expert and slot
an ``A`` and ``B`` for the fused gate/up and for the down projection, applied inside the
expert MLP (the gate/up delta before the activation), which the fused MoE kernel cannot
take: a step where a token's adapter adapts the experts runs that layer's experts as the
torch reference does, a loop over the experts that received tokens, with ``Ops.lora_add``
per expert over its rows grouped by slot. Steps without such tokens keep ``Ops.fused_moe``.
Under tensor parallelism a rank's experts hold their share of the intermediate rows (gate
and up rows, down columns: engine/models/layers/moe.py), and their pools hold the same cut
of each adapter (:meth:`LoraExperts.cut`); Qwen2-MoE's shared expert is cut as a dense MLP
and its gate kept whole.

Which slot each token uses is the step's :class:`LoraSegments`, which the runner sets on
the slots before the forward and clears after it (:meth:`LoraSlots.step`): the model owns
this state, and every wrapper of the model reads it from the one :class:`LoraSlots` it was
built with, so no forward signature changes for a per-step table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from engine.models.config import ModelConfig
from engine.models.layers.moe import expert_linear
from engine.models.layers.shard import RowParallel, qkv_spans
from engine.models.lora import (
    EXPERT_DOWN,
    EXPERT_GATE_UP,
    LoraTarget,
    LoraWeights,
    lora_expert_targets,
    lora_targets,
)
from engine.ops import LoraSegments, Ops, lora_rows_paired
from engine.ops.cpu.fused_spec import LoraProjection
from engine.ops.moe import combine
from engine.parallel import SINGLE, TensorParallel, shard_range

Spans = tuple[tuple[int, int], ...]

# Under tensor parallelism: Qwen2-MoE's shared-expert gate is whole on every rank (its one
# output scales each rank's partial sum alike), and the shared expert's down is a bare
# linear over the rank's intermediate columns (row-parallel: the decoder all-reduces the
# block's partial output, no RowParallel wrapper of its own).
REPLICATED_TARGETS = frozenset({"moe.shared_gate"})
ROW_PARALLEL_TARGETS = frozenset({"moe.shared_down"})


@dataclasses.dataclass(frozen=True, slots=True)
class LoraCut:
    """This rank's part of an adapter for one projection: ``A``'s input columns
    ``[start, stop)`` and, per fused slice, the rows of ``B`` it keeps (spans within the
    slice's own rows, joined in order)."""

    cols: tuple[int, int]
    rows: tuple[Spans, ...]

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(sum(b - a for a, b in spans) for spans in self.rows)


def lora_cut(config: ModelConfig, target: LoraTarget, tp: TensorParallel, *, row_parallel: bool,
             gathered: bool = False) -> LoraCut:
    """How rank ``tp.rank`` cuts an adapter for ``target``, as the base layer is cut
    (module docstring): the whole adapter on one rank."""
    whole = tuple(((0, rows),) for _, rows in target.slices)
    if not tp.enabled or target.key in REPLICATED_TARGETS:
        return LoraCut((0, target.in_features), whole)
    if row_parallel:
        if gathered:  # the rank's output rows of the whole input
            ((_, out),) = target.slices
            return LoraCut((0, target.in_features), ((shard_range(out, tp.rank, tp.world_size),),))
        return LoraCut(shard_range(target.in_features, tp.rank, tp.world_size), whole)
    if target.key == "qkv":
        sizes, spans = qkv_spans(config, tp)  # q by heads, k and v by KV heads (copied below N)
        per_part = [tuple(part) for part in spans]
    else:  # gate/up: each its equal share of the intermediate rows
        inter = target.slices[0][1] if len(target.slices) == 2 else target.slices[0][1] // 2
        sizes = (inter, inter)
        per_part = [(shard_range(inter, tp.rank, tp.world_size),)] * 2
    if len(target.slices) == len(sizes):
        return LoraCut((0, target.in_features), tuple(per_part))
    # Phi-3's one fused slice: every part's cut, offset by the parts before it.
    joined, start = [], 0
    for size, part in zip(sizes, per_part, strict=True):
        joined += [(start + a, start + b) for a, b in part]
        start += size
    return LoraCut((0, target.in_features), (tuple(joined),))


class LoraLinear:
    """A projection plus the LoRA delta of each token's slot (none for base-model tokens)."""

    __slots__ = ("base", "target", "cut", "a", "b", "slots", "bounds")

    def __init__(self, base: Any, target: LoraTarget, cut: LoraCut, a: torch.Tensor, b: torch.Tensor,
                 slots: LoraSlots) -> None:
        self.base = base
        self.target = target
        self.cut = cut  # this rank's part of each adapter (the whole on one rank)
        self.a = a  # [S, n * R, in]: in = this rank's input columns
        self.b = b  # [S, n * R, out]: B transposed, out = this rank's output rows (or its row pairs)
        self.slots = slots
        # The fused slices' column bounds: b is block diagonal, which the kernel may skip.
        self.bounds = (0, *itertools.accumulate(cut.widths))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        segments = self.slots.segments
        if segments is not None:
            if x.dim() == 2:  # the decoder's flat batch: no views to make
                self.slots.ops.lora_add(out, x, self.a, self.b, segments, self.bounds)
            else:
                self.slots.ops.lora_add(out.view(-1, out.shape[-1]), x.reshape(-1, x.shape[-1]), self.a, self.b,
                                       segments, self.bounds)
        return out

    def describe(self) -> Any:
        """The base projection as the fused CPU decode step reads it."""
        return self.base.describe()

    def describe_lora(self) -> LoraProjection:
        """The adapter slots as the fused CPU decode step reads them (it adds the deltas
        after the base projection, as :meth:`__call__` does)."""
        return LoraProjection(self.a, self.b, self.bounds)

    def __getattr__(self, name: str) -> Any:  # widened, nbytes, ... of the base projection
        return getattr(self.base, name)


class LoraExperts:
    """The LoRA deltas of one MoE layer's routed experts, per expert and slot."""

    __slots__ = ("slots", "span", "inter", "a13", "b13", "a2", "b2", "adapted", "adapted_host", "per_expert")

    def __init__(self, slots: LoraSlots, num_experts: int, hidden: int, inter: int, device: torch.device,
                 span: tuple[int, int] | None = None) -> None:
        """``inter``: an expert's whole intermediate size; ``span``: this rank's share of it
        (tensor parallelism cuts each expert's gate/up rows and down columns so; the
        whole by default). The pools hold the rank's cut: B's gate and up rows of the span
        for gate/up, A's columns of the span for down (whose partial delta joins the
        block's partial sum before the decoder's all-reduce)."""
        self.slots = slots
        self.inter = inter
        self.span = span or (0, inter)
        inter = self.span[1] - self.span[0]
        s, r, dtype = slots.max_loras, slots.max_rank, slots.dtype
        # [E, S, R, ...]: one expert's slots are contiguous, the [S, R, in] pool lora_add reads.
        self.a13 = torch.zeros((num_experts, s, r, hidden), dtype=dtype, device=device)
        self.b13 = torch.zeros((num_experts, s, r, 2 * inter), dtype=dtype, device=device)
        self.a2 = torch.zeros((num_experts, s, r, inter), dtype=dtype, device=device)
        self.b2 = torch.zeros((num_experts, s, r, hidden), dtype=dtype, device=device)
        # Which slots hold an adapter that adapts these experts (index slot + 1; 0: the base).
        self.adapted = torch.zeros(s + 1, dtype=torch.bool, device=device)
        self.adapted_host = [False] * s  # the same per slot, read without a device sync
        # Each expert's four [S, R, ...] pools as views made once: the same objects every
        # step, so a backend may keep what it checked about them (CpuOps.lora_add).
        self.per_expert = list(zip(self.a13.unbind(0), self.b13.unbind(0), self.a2.unbind(0), self.b2.unbind(0),
                                   strict=True))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a13, self.b13, self.a2, self.b2))

    def cut(self, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An expert pair (``A`` [E, r, in], ``B`` [E, out, r]) as this rank's pools hold it."""
        (g0, g1), inter = self.span, self.inter
        if (g0, g1) == (0, inter):
            return a, b
        if module == EXPERT_GATE_UP:  # B's gate rows then up rows, each the span's
            return a, torch.cat([b[:, g0:g1], b[:, inter + g0 : inter + g1]], dim=1)
        return a[:, :, g0:g1].contiguous(), b  # down: A's columns of the span

    def write(self, slot: int, layer: int, adapter: LoraWeights) -> None:
        for a_pool, b_pool, target in ((self.a13, self.b13, EXPERT_GATE_UP), (self.a2, self.b2, EXPERT_DOWN)):
            a_pool[:, slot].zero_()
            b_pool[:, slot].zero_()
            pair = adapter.modules.get((layer, target))
            if pair is not None:
                a, b = pair  # [E, r, in], [E, out, r]; r twice the adapter's for per-expert gate/up
                r = a.shape[1]
                a_pool[:, slot, :r].copy_(a)
                b_pool[:, slot, :r].copy_(b.transpose(1, 2))
        adapted = any((layer, t) in adapter.modules for t in (EXPERT_GATE_UP, EXPERT_DOWN))
        self.adapted[slot + 1] = adapted
        self.adapted_host[slot] = adapted

    def active(self) -> torch.Tensor | None:
        """Each token's slot where its adapter adapts these experts, else -1 (int64 [T]);
        None when no token's does (the step keeps the fused kernel)."""
        segments = self.slots.segments
        if segments is None or not any(self.adapted_host[run[2]] for run in segments.host):
            return None
        slots = segments.token_slots.long()
        return torch.where(self.adapted[slots + 1], slots, -1)

    def __call__(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
        """The routed experts' output with each token's adapter deltas (engine.ops.moe's
        sorted layout, the pairs sorted by expert and, within an expert, by slot)."""
        ops = self.slots.ops
        tokens, k = topk_ids.shape
        num_experts, num_slots = self.a13.shape[:2]
        inter = w2.shape[-1]
        pair_slots = token_slots.repeat_interleave(k)  # pair t * k + j is token t's
        key = topk_ids.reshape(-1) * (num_slots + 1) + (pair_slots + 1)
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=num_experts * (num_slots + 1)).view(num_experts, -1).tolist()
        rows = x.index_select(0, order // k)
        sorted_slots = pair_slots.index_select(0, order).to(torch.int32)
        out_sorted = torch.empty((tokens * k, x.shape[-1]), dtype=x.dtype, device=x.device)
        start = 0
        for e, per_slot in enumerate(counts):
            n = sum(per_slot)
            if n == 0:
                continue  # an expert that received no token: its weights are never read
            end = start + n
            runs, pos = [], per_slot[0]  # the base model's rows come first
            for slot, c in enumerate(per_slot[1:]):
                if c:
                    runs.append((pos, pos + c, slot))
                    pos += c
            segments = LoraSegments(tuple(runs), sorted_slots[start:end]) if runs else None
            h = expert_linear(rows[start:end], w13, e)  # (experts kept in blocks: qmatmul)
            a13, b13, a2, b2 = self.per_expert[e]
            if segments is not None:
                ops.lora_add(h, rows[start:end], a13, b13, segments)
            act = F.silu(h[:, :inter]) * h[:, inter:]
            out = expert_linear(act, w2, e)
            if segments is not None:
                ops.lora_add(out, act, a2, b2, segments)
            out_sorted[start:end] = out
            start = end
        return combine(out_sorted, order, topk_weights)


class LoraSlots:
    """The adapter slots of one model: every targeted projection's A and B buffers, which
    adapter each slot holds, and the current step's token-to-slot table.

    ``layers`` are this rank's: a pipeline stage's, numbered from ``tp.stage``'s first
    layer, each cut for ``tp``'s rank."""

    def __init__(self, config: ModelConfig, layers: list[Any], ops: Ops, *, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, tp: TensorParallel = SINGLE) -> None:
        self.ops = ops
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.segments: LoraSegments | None = None
        self.layer_ids = list(tp.stage.layer_range(config.num_hidden_layers))
        if len(self.layer_ids) != len(layers):
            raise ValueError(f"{len(layers)} layers for a stage of {len(self.layer_ids)}")
        self.wrappers: list[dict[str, LoraLinear]] = []
        self.experts: list[LoraExperts | None] = []
        # B as row pairs where the backend's kernel takes them so (lora_rows_paired): a
        # pair never straddles two slices when the padded rank is even.
        self.pairs = max_rank % 2 == 0 and ops.lora_pairs(dtype)
        for i, layer in zip(self.layer_ids, layers, strict=True):
            wrapped = {}
            for target in lora_targets(config, i):
                # "moe.shared_down": a field of the layer's SparseMoeBlock.
                owner, _, field = target.key.rpartition(".")
                holder = getattr(layer, owner) if owner else layer
                base = getattr(holder, field)
                # A row-parallel projection's delta joins its partial product, before the
                # all-reduce (or the gather) that RowParallel adds: wrap its inner projection.
                wrapped_row = isinstance(base, RowParallel)
                row = wrapped_row or target.key in ROW_PARALLEL_TARGETS
                cut = lora_cut(config, target, tp, row_parallel=row, gathered=wrapped_row and base.gathered)
                n = len(target.slices)
                a = torch.zeros((max_loras, n * max_rank, cut.cols[1] - cut.cols[0]), dtype=dtype, device=device)
                width = sum(cut.widths)
                b = torch.zeros((max_loras, n * max_rank // 2, width, 2) if self.pairs else
                                (max_loras, n * max_rank, width), dtype=dtype, device=device)
                lin = LoraLinear(base.linear if wrapped_row else base, target, cut, a, b, self)
                if wrapped_row:
                    base.linear = lin
                else:
                    setattr(holder, field, lin)
                wrapped[target.key] = lin
            self.wrappers.append(wrapped)
            experts = None
            if lora_expert_targets(config, i):
                assert config.moe is not None
                inter = config.moe.intermediate_size
                experts = LoraExperts(self, config.moe.num_experts, config.hidden_size, inter, device,
                                      shard_range(inter, tp.rank, tp.world_size) if tp.enabled else None)
                layer.moe.lora = experts
            self.experts.append(experts)

    def cut(self, adapter: LoraWeights) -> LoraWeights:
        """``adapter`` as this rank keeps it: its modules of this stage's layers only, each
        cut as the rank's slots are (the whole adapter on one rank of one stage)."""
        modules = {}
        for i, wrapped, experts in zip(self.layer_ids, self.wrappers, self.experts, strict=True):
            for lin in wrapped.values():
                (c0, c1), rows = lin.cut.cols, lin.cut.rows
                for (module, _), spans in zip(lin.target.slices, rows, strict=True):
                    pair = adapter.modules.get((i, module))
                    if pair is None:
                        continue
                    a, b = pair
                    if (c0, c1) != (0, a.shape[1]):
                        a = a[:, c0:c1].contiguous()
                    if spans != ((0, b.shape[0]),):
                        b = torch.cat([b[s:e] for s, e in spans])
                    modules[(i, module)] = (a, b)
            # The routed experts' pairs, cut as the rank's expert pools are.
            for module in (EXPERT_GATE_UP, EXPERT_DOWN):
                pair = adapter.modules.get((i, module))
                if pair is not None and experts is not None:
                    modules[(i, module)] = experts.cut(module, *pair)
        return dataclasses.replace(adapter, modules=modules)

    @property
    def nbytes(self) -> int:
        return (sum(w.a.numel() * w.a.element_size() + w.b.numel() * w.b.element_size()
                    for layer in self.wrappers for w in layer.values())
                + sum(e.nbytes for e in self.experts if e is not None))

    def write(self, slot: int, adapter: LoraWeights) -> None:
        """Copy ``adapter`` (as :meth:`cut` gives it) into ``slot`` (its untargeted slices,
        and the rank padding, zero)."""
        r, big_r = adapter.rank, self.max_rank
        for i, wrapped, experts in zip(self.layer_ids, self.wrappers, self.experts, strict=True):
            for lin in wrapped.values():
                lin.a[slot].zero_()
                # B is written as [n * R, out], then into the slot (as row pairs, or as is).
                b_slot = torch.zeros((lin.a.shape[1], lin.b.shape[2]), dtype=lin.b.dtype, device=lin.b.device) \
                    if self.pairs else lin.b[slot]
                b_slot.zero_()
                row = 0
                for j, ((module, _), rows) in enumerate(zip(lin.target.slices, lin.cut.widths, strict=True)):
                    pair = adapter.modules.get((i, module))
                    if pair is not None:
                        a, b = pair
                        lin.a[slot, j * big_r : j * big_r + r].copy_(a)
                        b_slot[j * big_r : j * big_r + r, row : row + rows].copy_(b.T)
                    row += rows
                if self.pairs:
                    lin.b[slot].copy_(lora_rows_paired(b_slot))
            if experts is not None:
                experts.write(slot, i, adapter)

    @contextlib.contextmanager
    def step(self, segments: LoraSegments | None) -> Iterator[None]:
        """The forward passes inside run with ``segments`` (None or inactive: base only)."""
        self.segments = segments if segments is not None and segments.active else None
        try:
            yield
        finally:
            self.segments = None


__all__ = ["LoraCut", "LoraExperts", "LoraLinear", "LoraSlots", "lora_cut"]
