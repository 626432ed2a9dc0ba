"""The projections the models are built from: dense and block-quantized weights.

``make_linear`` is what the decoders build their projections with: dense weights give the
packed dense :class:`Linear`, quantized ones (:class:`engine.ops.quant.QuantizedWeight`) a
:class:`QuantLinear`. q/k/v and gate/up are fused into one matmul as for dense weights:
parts of one format are concatenated row-wise into one weight, parts of different formats
(a Q4_K_M file keeps attn_v in Q6_K beside Q4_K q/k) stay separate weights that write side
by side into one output. The token embedding of a quantized model is read row by row
(:func:`embed`), and a tied LM head multiplies by the same quantized table: no dequantized
copy is made.

Which kernel runs follows the weights' layout, which the loader picked for the model's ops
backend: "panels" go to the C kernels (CPU), "blocks" to the Triton kernel (the Triton
backend: CUDA, or CPU under the interpreter); anything else to the torch reference.

Each projection also describes itself to the fused CPU decode step (:meth:`Linear.describe`,
:meth:`QuantLinear.describe`), which takes descriptions, not these classes.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F

from engine.ops.cpu import qmatmul as cq
from engine.ops.cpu.fused_spec import DenseProjection, QuantProjection
from engine.ops.quant import QuantizedExperts, QuantizedWeight, dequantize_blocks, reference_matmul

logger = logging.getLogger("engine.models")


class Linear:
    """``y = x @ weight.T (+ bias)`` for one weight, packed once where that pays.

    On CPU, torch's plain ``F.linear`` reorders the weight into the GEMM library's blocked
    layout on every call. Packing it once at build time into oneDNN's layout (the kernels
    ``torch.compile`` uses on CPU) saves that. bf16/fp16 results are bitwise equal to
    ``F.linear``'s. fp32 goes through oneDNN too rather than MKL (which ``F.linear`` calls):
    on an AMD EPYC dev machine MKL's fp32 GEMM ran at half oneDNN's speed (SmolLM2 decode
    23 vs 47 tok/s at batch 1, 245 vs 551 at batch 32), at the price of fp32 results that
    differ from ``F.linear`` in the last bits (summation order). The packed path is checked
    against ``F.linear`` once at build time and dropped if this torch lacks it or
    disagrees. The plain weight stays too: tied embeddings read it.

    ``small_batch``: on a CPU with AVX-512, up to ``qmatmul.DENSE_MAX_ROWS`` rows go to
    quant.c's small-batch dense kernel instead (decode steps; the fused decode step runs
    the same kernel, so both paths give the same bits).
    """

    __slots__ = ("weight", "bias", "_packed", "small_batch")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool = True) -> None:
        self.weight = weight
        self.bias = bias
        self._packed: torch.Tensor | None = None
        # Up to DENSE_MAX_ROWS[dtype] rows on CPU: quant.c's dense kernel, which the fused
        # decode step runs too (the same bits either way, and a row's result whatever its
        # batch up to there).
        self.small_batch = weight.device.type == "cpu" and cq.dense_ok(weight, bias)
        if pack and weight.device.type == "cpu":
            self._pack()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.small_batch and x.dtype is self.weight.dtype and x.is_contiguous() and x.dim() >= 1 and (
            x.numel() <= cq.DENSE_MAX_ROWS.get(x.dtype, 0) * self.weight.shape[1]
            and x.shape[-1] == self.weight.shape[1]
        ):
            out = cq.dense_matmul(self.weight, self.bias, x.view(-1, x.shape[-1]))
            return out.view(*x.shape[:-1], self.weight.shape[0])
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def gelu(self, x: torch.Tensor) -> torch.Tensor:
        """``gelu(self(x))`` (erf GELU, BERT's): on the packed path oneDNN applies it as
        the matmul's epilogue, bitwise what ``F.gelu`` of the result gives, without the
        second pass over the output (at MiniLM's 1,536-wide intermediate, a separate
        ``F.gelu`` cost 70% as much as the matmul before it)."""
        if self._packed is not None and not self._small(x):
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "gelu", [], "none")
        return F.gelu(self(x))

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``self(x) + residual`` (a residual connection), the sum written by the matmul's
        epilogue on the packed path (equal to the separate add to fp32 rounding)."""
        if self._packed is not None and not self._small(x) and residual.is_contiguous():
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self._packed, self.bias, "add")
        return self(x) + residual

    def _small(self, x: torch.Tensor) -> bool:
        """Whether ``__call__`` sends ``x`` to the small-batch kernel."""
        return self.small_batch and x.dtype is self.weight.dtype and x.is_contiguous() and (
            x.numel() <= cq.DENSE_MAX_ROWS.get(x.dtype, 0) * self.weight.shape[1]
            and x.shape[-1] == self.weight.shape[1])

    def describe(self) -> DenseProjection:
        """This projection as the fused CPU decode step reads it."""
        return DenseProjection(self.weight, self.bias, self.small_batch)

    def _pack(self) -> None:
        w = self.weight
        if not _mkldnn_supports(w.dtype):
            return
        try:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH)
            probe = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
            if not torch.allclose(self(probe).float(), F.linear(probe, w, self.bias).float(), rtol=1e-2, atol=1e-2):
                raise RuntimeError("packed linear disagrees with F.linear")
        except (RuntimeError, AttributeError):
            self._packed = None


# The batch size oneDNN tunes its packed layout for; any batch works.
_PACK_BATCH = 32


def _mkldnn_supports(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    check = torch.ops.mkldnn._is_mkldnn_bf16_supported if dtype == torch.bfloat16 else torch.ops.mkldnn._is_mkldnn_fp16_supported
    return bool(check())


class QuantLinear:
    """``y = x @ W.T (+ bias)`` with ``W`` the rows of ``parts`` stacked, each part kept in
    its block format; ``y`` comes in ``x``'s dtype."""

    __slots__ = ("parts", "bias", "out_features", "_offsets")

    def __init__(self, parts: list[QuantizedWeight], bias: torch.Tensor | None = None) -> None:
        k = parts[0].shape[1]
        if any(p.shape[1] != k for p in parts):
            raise ValueError("fused quantized parts must share the input width")
        self.parts = _merge_same_format(parts)
        self.bias = bias
        self.out_features = sum(p.shape[0] for p in self.parts)
        offsets, start = [], 0
        for p in self.parts:
            offsets.append((start, start + p.shape[0]))
            start += p.shape[0]
        self._offsets = offsets

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self._kernel(x)
        if kernel is None:  # reference path (no kernel for this layout or dtype): dequantize per call
            out = torch.cat([reference_matmul(x.reshape(-1, x.shape[-1]), p) for p in self.parts], -1)
            out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        elif len(self.parts) == 1:
            out = kernel(x, self.parts[0])
        else:
            out = torch.empty((*x.shape[:-1], self.out_features), dtype=x.dtype, device=x.device)
            flat = out.view(-1, self.out_features)
            for part, (a, b) in zip(self.parts, self._offsets, strict=True):
                kernel(x, part, out=flat[:, a:b])
        return out if self.bias is None else out + self.bias

    def describe(self) -> QuantProjection:
        """This projection as the fused CPU decode step reads it."""
        return QuantProjection(tuple(self.parts), self.bias, self.out_features)

    def widened(self, x: torch.Tensor) -> torch.Tensor | None:
        """``self(x).float()`` for bf16 ``x`` in one kernel pass (fp32 results rounded to
        bf16 first, so the values are those of the bf16 output), or None where the CPU
        kernel does not take it (several parts, a bias, another dtype or layout)."""
        if x.dtype != torch.bfloat16 or len(self.parts) != 1 or self.bias is not None:
            return None
        if self._kernel(x) is not cq.qmatmul:
            return None
        return cq.qmatmul(x, self.parts[0], out_dtype=torch.float32)

    def _kernel(self, x: torch.Tensor):
        """The matmul for the parts' layout, which the loader chose for the model's ops
        backend: panels for the C kernels (CPU), blocks for the Triton kernel (CUDA, or CPU
        under the interpreter); ``None`` for the reference."""
        layout = self.parts[0].layout  # one layout per model: the loader keeps one
        if layout == "panels" and x.is_cpu and x.dtype in (torch.float32, torch.bfloat16):
            return cq.qmatmul if cq.available() else None
        if layout == "blocks" and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
            # Imported on first use: importing it imports triton (and decorates the kernel,
            # which reads TRITON_INTERPRET), which a CPU-only run never needs.
            from engine.ops.triton import quant_matmul as tq

            return tq.quant_matmul if all(tq.supports(p) for p in self.parts) else None
        return None


def _merge_same_format(parts: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """Adjacent parts of one format as one weight (one kernel call instead of several)."""
    merged: list[list[QuantizedWeight]] = []
    for p in parts:
        if merged and merged[-1][-1].fmt == p.fmt and merged[-1][-1].shape[0] % 16 == 0:
            merged[-1].append(p)
        else:
            merged.append([p])
    return [group[0] if len(group) == 1 else QuantizedWeight.cat_rows(group) for group in merged]


def is_quantized(w: object) -> bool:
    return isinstance(w, QuantizedWeight)


def make_linear(parts: list, bias: torch.Tensor | None = None):
    """A projection over the row-stacked ``parts`` (dense tensors or quantized weights)."""
    if all(is_quantized(p) for p in parts):
        return QuantLinear(parts, bias)
    if any(is_quantized(p) for p in parts):
        # Fusing a dense and a quantized part: dequantize (a file mixing kinds, or a format the
        # kernels lack beside one they read: a Q4_K_M's Q6_K attn_v on the Triton backend).
        logger.info("dequantizing %d quantized part(s) fused with dense weights", sum(map(is_quantized, parts)))
        dense = next(p for p in parts if not is_quantized(p))
        parts = [p.dequantize().to(dense) if is_quantized(p) else p for p in parts]  # dense's dtype and device
    return Linear(parts[0] if len(parts) == 1 else torch.cat(parts), bias)


def embed(table, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of the token embedding ``table`` (dense, or quantized: read row by row)."""
    if not is_quantized(table):
        return F.embedding(ids, table)
    if table.layout == "blocks":  # GGUF rows on the model's device: gather, then dequantize them
        k = table.shape[1]
        raw = table.data["raw"][ids.reshape(-1)]
        rows = dequantize_blocks(raw, table.fmt, k) if len(raw) else torch.empty((0, k), device=raw.device)
        return rows.to(dtype).view(*ids.shape, k)
    if cq.available() and dtype in (torch.float32, torch.bfloat16):
        return cq.qrows(table, ids, dtype)
    rows = table.decoded()  # reference path
    flat = ids.reshape(-1).cpu()
    dense = rows.dequantize()[flat]
    return dense.to(device=ids.device, dtype=dtype).view(*ids.shape, -1)


def weight_bytes(model) -> int:
    """Bytes of every weight the model holds (quantized blocks as stored), each counted once."""
    seen: set[int] = set()
    total = 0

    def add(t) -> None:
        nonlocal total
        if t is None or id(t) in seen:
            return
        seen.add(id(t))
        if isinstance(t, QuantizedWeight | QuantizedExperts):
            total += t.nbytes
        elif hasattr(t, "slots") and hasattr(t, "base"):  # LoraLinear: the base (its slots are not weights)
            add(t.base)
        elif isinstance(t, QuantLinear):
            for p in t.parts:
                add(p)
            add(t.bias)
        elif isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
        elif isinstance(t, tuple):  # a LayerNorm's (weight, bias)
            for part in t:
                add(part)
        elif hasattr(t, "w13"):  # a sparse MoE block: its experts, router and shared expert
            for name in ("router", "score_bias", "w13", "w2", "shared_gate_up", "shared_down", "shared_gate",
                         "latent_in", "latent_out"):
                add(getattr(t, name, None))
        elif hasattr(t, "linear"):  # a tensor-parallel rank's row-parallel projection
            add(t.linear)
        elif hasattr(t, "weight"):  # a dense Linear: its weight and its packed copy
            add(t.weight)
            add(getattr(t, "_packed", None))
            add(getattr(t, "bias", None))  # (an fp32 router has none)

    # The decoders' top-level weights (GPT-2's and OPT's position tables and projections
    # too), and the BERT encoder's (models/bert.py).
    for name in ("embed", "norm", "lm_head", "word", "position", "token_type", "embed_norm",
                 "pooler", "classifier", "positions", "project_in", "project_out"):
        add(getattr(model, name, None))
    for layer in model.layers:
        # A slotted dataclass subclass's __slots__ names only its own fields (GemmaLayer's
        # two norms, AbsoluteLayer's biases): the dataclass's fields name them all.
        names = [f.name for f in dataclasses.fields(layer)] if dataclasses.is_dataclass(layer) else (
            layer.__slots__ if hasattr(layer, "__slots__") else vars(layer))
        for name in names:
            if name != "rope":  # the RoPE table is not a weight (and is shared)
                add(getattr(layer, name))
    return total


__all__ = ["Linear", "QuantLinear", "embed", "is_quantized", "make_linear", "weight_bytes"]
