"""Granite 4 (``GraniteMoeHybridForCausalLM``): Granite's decoder layer, with its MLP
stored as ``shared_mlp``, whose mixer is attention in some layers and Mamba-2 in the
others (the "h" models: granite-4.0-h-micro, -h-1b, -h-350m); the attention-only models
(granite-4.0-micro) are the same class with no Mamba layer. The MoE models
(granite-4.0-h-tiny, -h-small) add routed experts (Granite MoE's, ``block_sparse_moe``)
to the shared MLP in every layer.

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
from engine.models.layers.linear import Linear, make_linear
from engine.models.layers.mamba import MambaMixer
from engine.models.layers.moe import SparseMoeBlock
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
    moe: SparseMoeBlock | None = None  # the MoE models' routed experts, beside the shared MLP


class GraniteHybridModel(Decoder):
    """Granite 4's decoder (see the module docstring)."""

    def _layer(self, get: ShardedWeights, i: int) -> Any:
        mamba, moe = self.config.mamba, self.config.moe
        p = f"model.layers.{i}."
        shared = p + "shared_mlp.output_linear.weight"
        if mamba is None or i not in mamba.layers:
            layer = super()._layer(get, i)
            if layer.moe is not None:  # the shared MLP beside the experts
                layer.down = get.row_parallel(shared)
            return layer
        inter = self.config.intermediate_size
        return MambaLayer(
            input_norm=get(p + "input_layernorm.weight"),
            post_norm=get(p + "post_attention_layernorm.weight"),
            mixer=MambaMixer.build(mamba, get, p, self.eps, make_linear, self.ops),
            gate_up=make_linear([get.rows(p + "shared_mlp.input_linear.weight", (inter, inter))]),
            down=get.row_parallel(shared),
            moe=SparseMoeBlock(self.config, i, get, Linear, self.tp) if moe is not None else None,
        )

    def _mlp(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        """The shared MLP, plus the routed experts' output in the MoE models (as
        transformers adds them)."""
        shared = layer.down(self.ops.silu_and_mul(layer.gate_up(x)))
        if layer.moe is None:
            return shared
        return self.tp.all_reduce(layer.moe(x, self.ops)) + shared

    def _attention(self, layer: Any, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(layer, MambaLayer):  # its "KV cache" is its conv and SSM states
            return layer.mixer(x, meta, k_cache, v_cache)
        return super()._attention(layer, x, positions, meta, k_cache, v_cache, rope)

    def plan_fused_step(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> fused_decode.FusedDecode | None:
        if self.config.mamba is not None or self.config.moe is not None:
            return None  # the fused step runs attention layers, and experts without a shared MLP
        return super().plan_fused_step(kv_caches)


__all__ = ["GraniteHybridModel", "MambaLayer"]
