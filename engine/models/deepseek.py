"""DeepSeek-V3 (``DeepseekV3ForCausalLM``: DeepSeek-V3, R1, Kimi K2's layers): multi-head latent
attention (MLA) in the Llama layer, with GLM-4.5's mixture of experts (DeepSeek-V3's
routing, ungated shared experts; engine.models.layers.moe) after the first dense layers.

The attention, as transformers computes it (``decoder_fields.MlaConfig`` holds the widths):

* q: ``q_b_proj(rms(q_a_proj(x)))`` (or one ``q_proj``), per head ``qk_nope`` values and
  ``qk_rope`` ones to rotate;
* a latent ``kv_a_proj_with_mqa(x)``: ``kv_lora_rank`` values, normed (``kv_a_layernorm``)
  and expanded by ``kv_b_proj`` into each head's ``qk_nope`` key values and its value, and
  ``qk_rope`` key values every head shares, rotated;
* the scale ``qk_head_dim ** -0.5``, times YaRN's ``mscale_all_dim`` factor squared.

DeepSeek rotates interleaved pairs ``(x0, x1), (x2, x3)...``; a query's and a key's
rotated values are laid out alike, so their dot product does not depend on the order:
the rotated rows are de-interleaved at build time (evens, then odds) and turned by the
op set's rotate-half RoPE, and each head's rotated part goes first (the op set's partial
rotary turns a head's first values). The paged cache holds the expanded per-head keys and
values (the value zero-padded to the key's width, or the key to the value's), not the
latent: every op set's paged attention serves it as it is, at the cost of
``heads x width`` values a token where the latent is ``kv_lora_rank + qk_rope``. Over
tensor-parallel ranks each keeps its heads (their rows of q and ``kv_b_proj``, their
columns of ``o_proj``) and computes the bottlenecks and the latent whole; the fused CPU
step does not run this layer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F

from engine.models.config import ModelConfig
from engine.models.layers.decoder import Decoder, DecoderLayer
from engine.models.layers.linear import Linear, make_linear
from engine.models.layers.moe import SparseMoeBlock, sparse_layer_weight_names
from engine.models.layers.shard import ShardedWeights
from engine.ops import AttentionMetadata, Ops
from engine.parallel import SINGLE, TensorParallel

_LATENT_EPS = 1e-6  # q_a_layernorm's and kv_a_layernorm's (transformers' default, not the config's)


def deepseek_weight_names(config: ModelConfig) -> list[str]:
    """The checkpoint tensors of a DeepSeek-V3 model, in checkpoint order."""
    mla = config.mla
    assert mla is not None and config.moe is not None
    names = ["model.embed_tokens.weight"]
    for i in range(config.num_hidden_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if mla.q_lora_rank:
            names += [a + "q_a_proj.weight", a + "q_a_layernorm.weight", a + "q_b_proj.weight"]
        else:
            names.append(a + "q_proj.weight")
        names += [a + "kv_a_proj_with_mqa.weight", a + "kv_a_layernorm.weight", a + "kv_b_proj.weight",
                  a + "o_proj.weight"]
        if i in config.moe.sparse_layers:
            names += sparse_layer_weight_names(config.moe, i)
        else:
            names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
    names.append("model.norm.weight")
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def _rope_first(w: torch.Tensor, heads: int, nope: int, rope: int) -> torch.Tensor:
    """q's rows [heads * (nope + rope), in] as [heads * (rope + nope), in]: each head's
    rotated rows first, de-interleaved (evens, then odds)."""
    w = w.view(heads, nope + rope, -1)
    rot = w[:, nope:]
    return torch.cat([rot[:, 0::2], rot[:, 1::2], w[:, :nope]], dim=1).reshape(heads * (nope + rope), -1)


def _yarn_softmax_scale(config: ModelConfig, qk_head_dim: int) -> float:
    """``qk_head_dim ** -0.5``, times (0.1 mscale_all_dim ln(factor) + 1) squared under YaRN."""
    scale = qk_head_dim**-0.5
    rs = config.rope_scaling or {}
    m_all, factor = rs.get("mscale_all_dim"), rs.get("factor")
    if rs.get("rope_type", "default") != "default" and m_all and factor and float(factor) > 1:
        m = 0.1 * float(m_all) * math.log(float(factor)) + 1.0
        scale *= m * m
    return scale


@dataclasses.dataclass(slots=True)
class DeepseekLayer(DecoderLayer):
    # qkv: None. q_a / q_b (q_b alone, q_a None, without a q bottleneck); the latent's.
    q_a: Any
    q_a_norm: torch.Tensor | None
    q_b: Any
    kv_a: Any  # [kv_lora_rank + rope, hidden], the rope rows de-interleaved
    kv_a_norm: torch.Tensor
    kv_b: Any  # [heads * (nope + v), kv_lora_rank]


class DeepseekModel(Decoder):
    """DeepSeek-V3's decoder stack plus LM head over Hugging Face weights."""

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        return deepseek_weight_names(config)

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
        mla = config.mla
        assert mla is not None
        self.mla = mla
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        self._init_common(config, ops, dtype, device, tp, scale=_yarn_softmax_scale(config, qk))
        self._init_rope_tables()
        get = ShardedWeights(weights, dtype, self.device, tp)
        self._build_ends(get, weights, lambda: get("model.norm.weight"))
        self.layers = [self._layer(get, i) for i in tp.stage.layer_range(config.num_hidden_layers)]

    def _layer(self, get: ShardedWeights, i: int) -> DeepseekLayer:  # type: ignore[override]
        c, mla = self.config, self.mla
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        nope, rope, lat = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
        heads = c.num_attention_heads
        q_name = a + ("q_b_proj.weight" if mla.q_lora_rank else "q_proj.weight")
        kv_a = get(a + "kv_a_proj_with_mqa.weight")
        kv_rot = kv_a[lat:]
        sparse = c.moe is not None and i in c.moe.sparse_layers
        # This rank's heads (every head on one rank): their rows of q and kv_b, their
        # columns of o; the bottlenecks and the latent whole on every rank.
        h0 = self.tp.rank * self.num_heads
        heads_of = lambda w: w.view(heads, -1, w.shape[-1])[h0:h0 + self.num_heads].reshape(-1, w.shape[-1])  # noqa: E731
        return DeepseekLayer(
            input_norm=get(p + "input_layernorm.weight"),
            post_norm=get(p + "post_attention_layernorm.weight"),
            qkv=None,
            o_proj=get.row_parallel(a + "o_proj.weight"),
            q_norm=None,
            k_norm=None,
            gate_up=None if sparse else make_linear([get.rows(p + "mlp.gate_proj.weight"),
                                                     get.rows(p + "mlp.up_proj.weight")]),
            down=None if sparse else get.row_parallel(p + "mlp.down_proj.weight"),
            window=0,
            rope=self.cos_sin_cache,
            moe=SparseMoeBlock(c, i, get, Linear, self.tp) if sparse else None,
            q_a=make_linear([get(a + "q_a_proj.weight")]) if mla.q_lora_rank else None,
            q_a_norm=get(a + "q_a_layernorm.weight") if mla.q_lora_rank else None,
            q_b=make_linear([heads_of(_rope_first(get(q_name), heads, nope, rope)).contiguous()]),
            kv_a=make_linear([torch.cat([kv_a[:lat], kv_rot[0::2], kv_rot[1::2]]).contiguous()]),
            kv_a_norm=get(a + "kv_a_layernorm.weight"),
            kv_b=make_linear([heads_of(get(a + "kv_b_proj.weight")).contiguous()]),
        )

    def plan_fused_step(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """None: the fused CPU step does not run the latent attention."""
        return None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; writes this step's K/V."""
        ops, eps = self.ops, self.eps

        def block(layer: DeepseekLayer, hidden: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
            x = ops.rms_norm(hidden, layer.input_norm, eps)
            hidden = hidden + self._latent_attention(layer, x, positions, meta, k_cache, v_cache)
            x = ops.rms_norm(hidden, layer.post_norm, eps)
            if layer.moe is not None:
                return hidden + self.tp.all_reduce(layer.moe(x, ops))  # the experts' row-parallel downs
            return hidden + layer.down(ops.silu_and_mul(layer.gate_up(x)))

        return self._run_stream(input_ids, positions, kv_caches, block,  # type: ignore[return-value]
                                lambda h: ops.rms_norm(h, self.norm, eps))

    def _latent_attention(self, layer: DeepseekLayer, x: torch.Tensor, positions: torch.Tensor,
                          meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        ops, mla = self.ops, self.mla
        t, h, width = x.shape[0], self.num_heads, self.head_dim
        nope, rope, lat, vd = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank, mla.v_head_dim
        qk = nope + rope
        if layer.q_a is not None:
            x_q = ops.rms_norm(layer.q_a(x).contiguous(), layer.q_a_norm, _LATENT_EPS)
        else:
            x_q = x
        q = layer.q_b(x_q).view(t, h, qk)  # [rope | nope] per head
        kv_a = layer.kv_a(x)
        latent = ops.rms_norm(kv_a[:, :lat].contiguous(), layer.kv_a_norm, _LATENT_EPS)
        kv = layer.kv_b(latent).view(t, h, nope + vd)
        k = torch.cat([kv_a[:, lat:].unsqueeze(1).expand(t, h, rope), kv[..., :nope]], dim=-1)
        q, k = ops.rotary_embedding(positions, q.contiguous(), k.contiguous(), layer.rope)
        v = kv[..., nope:]
        if width > qk:  # values wider than keys: the keys and queries padded with zeros
            q, k = F.pad(q, (0, width - qk)), F.pad(k, (0, width - qk))
        if width > vd:
            v = F.pad(v, (0, width - vd))
        ops.write_kv_cache(k, v.contiguous(), k_cache, v_cache, meta.slot_mapping)
        o = self._attend(layer, q.contiguous(), k_cache, v_cache, meta)
        return layer.o_proj(o[..., :vd].reshape(t, h * vd))


__all__ = ["DeepseekLayer", "DeepseekModel", "deepseek_weight_names"]
