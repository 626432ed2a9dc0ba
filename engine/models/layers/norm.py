"""The decoders' RMSNorms beyond the op set's plain ``rms_norm``: the per-head q/k norm
(Qwen3, Gemma 3) and Gemma's ``1 + w`` norm in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.layers.shard import ShardedWeights
from engine.ops import Ops


def head_norm(ops: Ops, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm of q or k [T, heads, D] before RoPE (Qwen3).

    q and k are column slices of the fused q/k/v output, so with several rows they are
    strided views, which the C kernel does not take: copied to contiguous rows first, so
    every row takes the C kernel (Hugging Face's bf16 rounding) whatever its batch, as a
    single row (contiguous already) and the fused decode step do."""
    return ops.rms_norm(x if x.is_contiguous() else x.contiguous(), weight, eps)


def gemma_norm_weight(weights: dict[str, torch.Tensor], name: str, device: torch.device) -> torch.Tensor:
    """``1 + weight`` in fp32: transformers multiplies by it in fp32, then rounds."""
    w = ShardedWeights(weights, torch.float32, device)(name)
    return (1.0 + w).contiguous()


def gemma_rms_norm(ops: Ops, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm with ``weight`` = 1 + w in fp32 (:func:`gemma_norm_weight`)."""
    gemma_norm = getattr(ops, "gemma_rms_norm", None)  # the CPU kernels' (the fused step's too)
    if gemma_norm is not None:
        return gemma_norm(x, weight, eps)
    if x.dtype == torch.float32:
        return ops.rms_norm(x, weight, eps)  # the backend's kernel, same math
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)


__all__ = ["gemma_norm_weight", "gemma_rms_norm", "head_norm"]
