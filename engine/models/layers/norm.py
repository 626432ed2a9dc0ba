"""The decoders' RMSNorms beyond the op set's plain ``rms_norm``: the per-head q/k norm
(Qwen3, Gemma 3), the q/k norm across all heads split over tensor-parallel ranks (OLMo 2,
OLMoE) and Gemma's ``1 + w`` norm in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.config import ModelConfig
from engine.models.layers.shard import ShardedWeights
from engine.ops import Ops
from engine.parallel import TensorParallel


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


def split_heads_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, tp: TensorParallel, config: ModelConfig,
                     *, fp32_weight: bool) -> torch.Tensor:
    """This rank's q or k heads [T, local width] normed over every rank's heads, as
    transformers norms q or k over its whole width: the sums of squares are summed over
    the ranks (one value a token), in fp32. KV heads copied to several ranks (fewer KV
    heads than ranks) are counted once each. ``fp32_weight``: the weight multiplies in
    fp32 and the result rounds once (OLMo 2's); else ``x / rms(x)`` rounds to the dtype
    first and the weight multiplies in it (Llama's, OLMoE's)."""
    d, n = config.head_dim, tp.world_size
    is_q = x.shape[1] == config.num_attention_heads * d // n
    width = (config.num_attention_heads if is_q else config.num_key_value_heads) * d
    copies = 1 if is_q else max(1, n // config.num_key_value_heads)
    xf = x.float()
    squares = tp.all_reduce(xf.square().sum(-1, keepdim=True)) / copies
    normed = xf * torch.rsqrt(squares / width + eps)
    if fp32_weight:
        return (normed * weight).to(x.dtype)
    return weight * normed.to(x.dtype)


__all__ = ["gemma_norm_weight", "gemma_rms_norm", "head_norm", "split_heads_norm"]
