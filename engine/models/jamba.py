"""AI21's Jamba (``JambaForCausalLM``: Jamba-v0.1, Jamba 1.5 / 1.6 / 1.7 Mini and Large,
Jamba Reasoning 3B): Llama's layer (two RMS norms, residual adds) whose mixer is attention
without positions every ``attn_layer_period``-th layer (from ``attn_layer_offset``) and a
Mamba-1 selective scan (engine.models.layers.mamba1, under ``mamba.``, its dt, B and C
RMS-normed with weights) in the others; its MLP (under ``feed_forward.``) is a mixture of
experts every ``expert_layer_period``-th layer (from ``expert_layer_offset``: a softmax
router, ``feed_forward.router``, the top ``num_experts_per_tok`` weights not renormalised)
and a SwiGLU MLP in the others.

The generic decoder's step runs the stack, as for Granite 4: a Mamba layer's "KV cache"
is its conv and SSM states (``ModelConfig.mamba1``, a state slot a request). Mamba-1
layers refuse tensor-parallel ranks; pipeline stages cut the layers as any. The fused CPU
decode step does not run it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from engine.models.config import ModelConfig
from engine.models.layers.decoder import Decoder, DecoderLayer
from engine.models.layers.linear import Linear, make_linear
from engine.models.layers.mamba1 import Mamba1Mixer, mamba1_weight_names
from engine.models.layers.moe import SparseMoeBlock, sparse_layer_weight_names
from engine.models.layers.shard import ShardedWeights, qkv_spans
from engine.ops import AttentionMetadata
from engine.parallel import SINGLE, TensorParallel


@dataclasses.dataclass(slots=True)
class JambaMambaLayer:
    """A Mamba layer: the fields the decoder's step reads of any layer, and its mixer."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    mixer: Mamba1Mixer
    gate_up: Any
    down: Any
    moe: SparseMoeBlock | None = None


class JambaModel(Decoder):
    """Jamba's decoder (see the module docstring)."""

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        m, moe = config.mamba1, config.moe
        assert m is not None
        names = ["model.embed_tokens.weight"]
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "pre_ff_layernorm.weight"]
            if i in m.layers:
                names += mamba1_weight_names(m, p)
            else:
                names += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
            if moe is not None and i in moe.sparse_layers:
                names += sparse_layer_weight_names(moe, i)
            else:
                names += [p + f"feed_forward.{n}_proj.weight" for n in ("gate", "up", "down")]
        names.append("model.final_layernorm.weight")
        if not config.tie_word_embeddings:
            names.append("lm_head.weight")
        return names

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], ops: Any, *, dtype: torch.dtype,
                 device: torch.device | str = "cpu", tp: TensorParallel = SINGLE) -> None:
        self._init_common(config, ops, dtype, device, tp, scale=config.head_dim**-0.5)
        self.cos_sin_cache = None
        get = ShardedWeights(weights, dtype, self.device, tp)
        self._build_ends(get, weights, lambda: get("model.final_layernorm.weight"))
        self.layers = [self._layer(get, i) for i in tp.stage.layer_range(config.num_hidden_layers)]

    def _layer(self, get: ShardedWeights, i: int) -> Any:  # type: ignore[override]
        c, p = self.config, f"model.layers.{i}."
        ff = p + "feed_forward."
        sparse = c.moe is not None and i in c.moe.sparse_layers
        common = dict(
            input_norm=get(p + "input_layernorm.weight"), post_norm=get(p + "pre_ff_layernorm.weight"),
            gate_up=None if sparse else make_linear([get.rows(ff + "gate_proj.weight"), get.rows(ff + "up_proj.weight")]),
            down=None if sparse else get.row_parallel(ff + "down_proj.weight"),
            moe=SparseMoeBlock(c, i, get, Linear, self.tp) if sparse else None)
        assert c.mamba1 is not None
        if i in c.mamba1.layers:
            return JambaMambaLayer(mixer=Mamba1Mixer.build(c.mamba1, get, p, make_linear, self.ops), **common)
        _, spans = qkv_spans(c, self.tp)
        return DecoderLayer(
            qkv=make_linear([get.rows(p + f"self_attn.{n}_proj.weight", spans=[span])
                             for n, span in zip("qkv", spans, strict=True)]),
            o_proj=get.row_parallel(p + "self_attn.o_proj.weight"), q_norm=None, k_norm=None, window=0, rope=None,
            **common)

    def _attention(self, layer: Any, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(layer, JambaMambaLayer):  # its "KV cache" is its conv and SSM states
            return layer.mixer(x, meta, k_cache, v_cache)
        return super()._attention(layer, x, positions, meta, k_cache, v_cache, rope)

    def plan_fused_step(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """None: the fused CPU step runs no Mamba mixer."""
        return None


__all__ = ["JambaMambaLayer", "JambaModel"]
