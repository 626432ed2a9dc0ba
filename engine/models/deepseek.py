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
op set's rotate-half RoPE.

The paged cache holds the latent, as vLLM's MLA does: one KV head a token of
``qk_rope + kv_lora_rank`` values (the rotated key part first, where the op set's partial
RoPE turns it), one tensor serving as both K and V (``engine.runner.kv_cache``). Each
head's key from the latent is ``W_UK latent`` (``kv_b_proj``'s key rows of that head), so
its score ``q_nope . W_UK latent`` is ``(W_UK^T q_nope) . latent``: the query folds
``W_UK`` in and becomes ``[q_rope | W_UK^T q_nope]``, as wide as the cache, and every op
set's paged attention (GQA with one KV head) scores it unchanged. Its output over the
same rows, less the rotated part, is the weighted latent, and ``W_UV`` (the value rows)
turns it into the head's value. Over tensor-parallel ranks each keeps its heads (their
rows of q and ``kv_b_proj``, their columns of ``o_proj``), computes the bottlenecks and
the latent whole and keeps the whole latent cache; the fused CPU step does not run this
layer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

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
    w_uk: torch.Tensor  # [heads, qk_nope, kv_lora_rank]: kv_b_proj's key rows, by head
    w_uv: torch.Tensor  # [heads, kv_lora_rank, v_head_dim]: its value rows, by head, transposed


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
        kv_b = get(a + "kv_b_proj.weight").view(heads, nope + mla.v_head_dim, lat)
        # This rank's heads (every head on one rank): their rows of q and kv_b, their
        # columns of o; the bottlenecks and the latent whole on every rank.
        h0 = self.tp.rank * self.num_heads
        heads_of = lambda w: w.view(heads, -1, w.shape[-1])[h0:h0 + self.num_heads].reshape(-1, w.shape[-1])  # noqa: E731
        kv_b = kv_b[h0:h0 + self.num_heads]
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
            w_uk=kv_b[:, :nope].contiguous(),
            w_uv=kv_b[:, nope:].transpose(1, 2).contiguous(),
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
        t, h = x.shape[0], self.num_heads
        nope, rope, lat = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
        if layer.q_a is not None:
            x_q = ops.rms_norm(layer.q_a(x).contiguous(), layer.q_a_norm, _LATENT_EPS)
        else:
            x_q = x
        q = layer.q_b(x_q).view(t, h, rope + nope)  # [rope | nope] per head
        # W_UK folded into each head's query: [T, H, nope] -> [T, H, latent]
        q_lat = torch.bmm(q[..., rope:].transpose(0, 1), layer.w_uk).transpose(0, 1)
        q = torch.cat([q[..., :rope], q_lat], dim=-1)
        kv_a = layer.kv_a(x)
        latent = ops.rms_norm(kv_a[:, :lat].contiguous(), layer.kv_a_norm, _LATENT_EPS)
        k = torch.cat([kv_a[:, lat:], latent], dim=-1).unsqueeze(1)  # one KV head: [rope | latent]
        q, k = ops.rotary_embedding(positions, q.contiguous(), k.contiguous(), layer.rope)
        ops.write_kv_cache(k, k, k_cache, v_cache, meta.slot_mapping)  # v_cache is k_cache
        o = self._attend(layer, q.contiguous(), k_cache, v_cache, meta)  # [T, H, rope + latent]
        # The weighted latent of each head, through its W_UV: [T, H, latent] -> [T, H, v]
        o = torch.bmm(o[..., rope:].transpose(0, 1), layer.w_uv).transpose(0, 1)
        return layer.o_proj(o.reshape(t, h * mla.v_head_dim))


__all__ = ["DeepseekLayer", "DeepseekModel", "deepseek_weight_names"]
