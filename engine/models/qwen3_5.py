"""Qwen3.5 (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``; the text model of
``Qwen3_5ForConditionalGeneration`` and ``Qwen3_5MoeForConditionalGeneration``) and
Qwen3-Next (``Qwen3NextForCausalLM``): three Gated DeltaNet layers to each attention
layer, as ``layer_types`` (or ``full_attention_interval``) lays them out; the MoE models'
MLPs are Qwen2-MoE's routed experts (softmax top-k, renormalised) and sigmoid-gated shared
expert (Qwen3-Next's on the layers its ``decoder_sparse_step`` / ``mlp_only_layers`` make
sparse). Qwen3-Next stores its DeltaNet projections grouped by key head, read into
Qwen3.5's layout at build time (``layers/deltanet.py``).

* A "linear_attention" layer mixes with Gated DeltaNet (``layers/deltanet.py``), keeping a
  recurrent state a request in the runner's state slots (engine.runner.state_slots).
* A "full_attention" layer is gated attention: ``q_proj`` gives each head's query and
  gate side by side, q and k are normed per head, RoPE turns the first quarter of each
  head (``partial_rotary_factor``), and the attention's output is multiplied by
  ``sigmoid(gate)`` before ``o_proj``.
* Every RMS norm (the layer's two, the final one, q's and k's) is zero-centred: the fp32
  normed row times ``1 + w`` in fp32, rounded once (Gemma's arithmetic, ``layers/norm``).

Positions: Qwen3.5's M-RoPE gives a text token the same position on its three streams,
which is the plain RoPE this runs (images are not read: the vision tower is not built).
What a recurrent layer turns off or refuses (prefix caching; speculation, beam search,
LoRA) applies. Tensor-parallel ranks each keep their heads of every layer (a DeltaNet
layer's key and value heads) and their share of every MLP. The fused CPU decode step does
not run it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from engine.models.config import ModelConfig
from engine.models.layers.decoder import Decoder, DecoderLayer
from engine.models.layers.deltanet import DeltaNetMixer, deltanet_weight_names
from engine.models.layers.linear import Linear, make_linear
from engine.models.layers.moe import SparseMoeBlock, sparse_layer_weight_names
from engine.models.layers.norm import gemma_norm_weight, gemma_rms_norm
from engine.models.layers.rope import rope_cos_sin_cache
from engine.models.layers.shard import ShardedWeights, qkv_spans
from engine.ops import AttentionMetadata, Ops
from engine.parallel import SINGLE, TensorParallel


@dataclasses.dataclass(slots=True)
class DeltaNetLayer:
    """A Gated DeltaNet layer: its two norms (1 + w, fp32), mixer and MLP."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    mixer: DeltaNetMixer
    gate_up: Any
    down: Any
    moe: SparseMoeBlock | None = None


class Qwen35Model(Decoder):
    """Qwen3.5's decoder stack plus LM head (see the module docstring)."""

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        net = config.deltanet
        assert net is not None  # deltanet_fields always reads Qwen3.5's layers
        names = ["model.embed_tokens.weight"]
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            if i in net.layers:
                names += deltanet_weight_names(net, p)
            else:
                names += [p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm",
                                                                 "k_norm")]
            if config.moe is not None and i in config.moe.sparse_layers:
                names += sparse_layer_weight_names(config.moe, i)
            else:
                names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        names.append("model.norm.weight")
        if not config.tie_word_embeddings:
            names.append("lm_head.weight")
        return names

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        ops: Ops,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        tp: TensorParallel = SINGLE,
    ) -> None:
        self._init_common(config, ops, dtype, device, tp, scale=config.head_dim**-0.5)
        self.cos_sin_cache = rope_cos_sin_cache(config, dtype, self.device)
        get = ShardedWeights(weights, dtype, self.device, tp)
        self._build_ends(get, weights, lambda: self._norm_weight(weights, "model.norm.weight"))
        self.layers = [self._layer(get, i) for i in tp.stage.layer_range(config.num_hidden_layers)]

    def _norm_weight(self, weights: Any, name: str) -> torch.Tensor:
        return gemma_norm_weight(weights, name, self.device)

    def _layer(self, get: ShardedWeights, i: int) -> Any:  # type: ignore[override]
        net = self.config.deltanet
        assert net is not None
        p = f"model.layers.{i}."
        norm = lambda name: self._norm_weight(get.weights, p + name)  # noqa: E731
        moe = self.config.moe
        if moe is not None and i in moe.sparse_layers:  # routed experts and a gated shared expert
            mlp = dict(gate_up=None, down=None, moe=SparseMoeBlock(self.config, i, get, Linear, self.tp))
        else:  # over tensor-parallel ranks: gate's and up's rows, down's columns
            mlp = dict(gate_up=make_linear([get.rows(p + "mlp.gate_proj.weight"), get.rows(p + "mlp.up_proj.weight")]),
                       down=get.row_parallel(p + "mlp.down_proj.weight"))
        if i in net.layers:
            return DeltaNetLayer(input_norm=norm("input_layernorm.weight"), post_norm=norm("post_attention_layernorm.weight"),
                                 mixer=DeltaNetMixer.build(net, get, p, self.eps, make_linear, self.ops), **mlp)
        attn = p + "self_attn."
        d = self.head_dim
        _, (q_span, k_span, v_span) = qkv_spans(self.config, self.tp)
        (q0, q1), = q_span
        # Each head's query rows, then its gate's (2 d rows a head): this rank's heads' of each
        # (rows of a GGUF's blocks stay in blocks).
        heads = range(q0 // d, q1 // d)
        query, gate = (get.pick_rows(attn + "q_proj.weight", [(2 * d * j + o, 2 * d * j + o + d) for j in heads])
                       for o in (0, d))
        return DecoderLayer(
            input_norm=norm("input_layernorm.weight"), post_norm=norm("post_attention_layernorm.weight"),
            # [q; k; v; gate]: one matmul, split in _gated_attention.
            qkv=make_linear([query, get.rows(attn + "k_proj.weight", spans=[k_span]),
                             get.rows(attn + "v_proj.weight", spans=[v_span]), gate]),
            o_proj=get.row_parallel(attn + "o_proj.weight"),
            q_norm=norm("self_attn.q_norm.weight"), k_norm=norm("self_attn.k_norm.weight"),
            window=0, rope=self.cos_sin_cache, **mlp)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(self.ops, x, weight, self.eps)

    def _gated_attention(self, layer: DecoderLayer, x: torch.Tensor, positions: torch.Tensor,
                         meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        ops, t = self.ops, x.shape[0]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        assert layer.q_norm is not None and layer.k_norm is not None
        q, k, v, gate = layer.qkv(x).split([h * d, hkv * d, hkv * d, h * d], dim=-1)
        q = self._rms(q.reshape(t * h, d), layer.q_norm).view(t, h, d)
        k = self._rms(k.reshape(t * hkv, d), layer.k_norm).view(t, hkv, d)
        q, k = ops.rotary_embedding(positions, q, k, layer.rope)
        ops.write_kv_cache(k, v.reshape(t, hkv, d), k_cache, v_cache, meta.slot_mapping)
        o = self._attend(layer, q, k_cache, v_cache, meta).reshape(t, h * d)
        return layer.o_proj(o * torch.sigmoid(gate))

    def plan_fused_step(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """None: the fused CPU step runs no Gated DeltaNet or gated attention."""
        return None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; writes this step's K/V and
        advances the DeltaNet layers' states."""
        def block(layer: Any, hidden: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
            x = self._rms(hidden, layer.input_norm)
            if isinstance(layer, DeltaNetLayer):
                mixed = layer.mixer(x, meta, first, second)  # the layer's conv and recurrent states
            else:
                mixed = self._gated_attention(layer, x, positions, meta, first, second)
            hidden = hidden + mixed
            return hidden + self._mlp(layer, self._rms(hidden, layer.post_norm))

        return self._run_stream(input_ids, positions, kv_caches, block,  # type: ignore[return-value]
                                lambda h: self._rms(h, self.norm), mm_embeds=mm_embeds)


__all__ = ["DeltaNetLayer", "Qwen35Model"]
