"""Plain-torch reference of every op: the CPU path and the oracle for the Triton kernels."""

from __future__ import annotations

import torch

from engine.ops import AttentionMetadata
from engine.ops.sampling_ref import sample as _sample


class TorchOps:
    name = "torch"

    # The model helper fills in rms_norm, fused_add_rms_norm, rotary_embedding,
    # silu_and_mul, write_kv_cache, paged_attention_decode, paged_attention_prefill.

    def sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        seeds: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _sample(logits, temperature, top_k, top_p, min_p, seeds)


__all__ = ["AttentionMetadata", "TorchOps"]
