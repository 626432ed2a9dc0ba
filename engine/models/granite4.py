"""Granite 4 (``GraniteMoeHybridForCausalLM``): Granite's decoder layer, with its MLP
stored as ``shared_mlp``, whose mixer is attention in some layers and Mamba-2 in the
others (the "h" models: granite-4.0-h-micro, -h-1b, -h-350m); the attention-only models
(granite-4.0-micro) are the same class with no Mamba layer.

A Mamba layer takes the place of attention between the same two norms and residual adds
(times ``residual_multiplier``), so the generic decoder's step runs the stack; this class
builds the Mamba layers (engine.models.layers.mamba) and sends their mixer the layer's
recurrent states where an attention layer's KV cache would go. The fused CPU decode step
does not run Mamba layers: a hybrid model's steps run layer by layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from engine.models.layers.decoder import Decoder
from engine.models.layers.linear import make_linear
from engine.models.layers.mamba import MambaMixer
from engine.models.layers.shard import ShardedWeights
from engine.ops import AttentionMetadata
from engine.ops.cpu import fused as fused_decode


@dataclasses.dataclass(slots=True)
class MambaLayer:
    """A Mamba layer: the fields the decoder's step reads of any layer, and its mixer."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    mixer: MambaMixer
    gate_up: Any  # Linear: shared_mlp.input_linear, [gate; up]
    down: Any
    moe: None = None


class GraniteHybridModel(Decoder):
    """Granite 4's decoder (see the module docstring)."""

    def _layer(self, get: ShardedWeights, i: int) -> Any:
        mamba = self.config.mamba
        if mamba is None or i not in mamba.layers:
            return super()._layer(get, i)
        p = f"model.layers.{i}."
        inter = self.config.intermediate_size
        return MambaLayer(
            input_norm=get(p + "input_layernorm.weight"),
            post_norm=get(p + "post_attention_layernorm.weight"),
            mixer=MambaMixer.build(mamba, get, p, self.eps, make_linear),
            gate_up=make_linear([get.rows(p + "shared_mlp.input_linear.weight", (inter, inter))]),
            down=get.row_parallel(p + "shared_mlp.output_linear.weight"),
        )

    def _attention(self, layer: Any, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(layer, MambaLayer):  # its "KV cache" is its conv and SSM states
            return layer.mixer(x, meta, k_cache, v_cache)
        return super()._attention(layer, x, positions, meta, k_cache, v_cache, rope)

    def plan_fused_step(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> fused_decode.FusedDecode | None:
        if self.config.mamba is not None:
            return None  # the fused step runs attention layers only
        return super().plan_fused_step(kv_caches)


__all__ = ["GraniteHybridModel", "MambaLayer"]
