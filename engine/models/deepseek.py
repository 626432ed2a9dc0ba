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
turns it into the head's value. That is how decoding steps attend. A step's prompt chunks
attend as vLLM's MLA prefill does, as plain multi-head attention: the blocks their context
uses are read from the latent cache and expanded by ``kv_b_proj`` into every head's key and
value, a paged cache of their own for the step (:class:`_MlaSplit`), which costs a third
of the absorbed form's attention work a head; one-token requests in the same step keep the
absorbed form. Over tensor-parallel ranks each keeps its heads (their
rows of q and ``kv_b_proj``, their columns of ``o_proj``), computes the bottlenecks and
the latent whole and keeps the whole latent cache; the fused CPU step does not run this
layer.
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
from engine.ops import AttentionMetadata, KVCache, Ops, QuantizedKV
from engine.ops.reference import dequantize_kv
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

    # Prompt chunks attend as multi-head attention over their context expanded from the
    # latent (vLLM's MLA prefill); False: as decoding does, absorbed over the latent cache
    # (the same answer for three times the attention work a head: tests and benchmarks).
    prefill_expanded = True

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
        self._split_key: AttentionMetadata | None = None  # the step _split_cache was made for
        self._split_cache: _MlaSplit | None = None
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
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
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
                                lambda h: ops.rms_norm(h, self.norm, eps), mm_embeds=mm_embeds)

    def _latent_attention(self, layer: DeepseekLayer, x: torch.Tensor, positions: torch.Tensor,
                          meta: AttentionMetadata, k_cache: KVCache, v_cache: KVCache) -> torch.Tensor:
        ops, mla = self.ops, self.mla
        t, h = x.shape[0], self.num_heads
        rope, lat, vd = mla.qk_rope_head_dim, mla.kv_lora_rank, mla.v_head_dim
        if layer.q_a is not None:
            x_q = ops.rms_norm(layer.q_a(x).contiguous(), layer.q_a_norm, _LATENT_EPS)
        else:
            x_q = x
        q = layer.q_b(x_q).view(t, h, rope + mla.qk_nope_head_dim)  # [rope | nope] per head
        kv_a = layer.kv_a(x)
        latent = ops.rms_norm(kv_a[:, :lat].contiguous(), layer.kv_a_norm, _LATENT_EPS)
        k = torch.cat([kv_a[:, lat:], latent], dim=-1).unsqueeze(1)  # one KV head: [rope | latent]
        q, k = ops.rotary_embedding(positions, q.contiguous(), k.contiguous(), layer.rope)
        ops.write_kv_cache(k, k, k_cache, v_cache, meta.slot_mapping)  # v_cache is k_cache
        if meta.decode_only or not self.prefill_expanded:
            o = self._absorbed(layer, q, k_cache, meta, None)
        else:
            split = self._split(meta, k_cache.shape[1])
            o = torch.empty((t, h, vd), dtype=q.dtype, device=q.device)
            if split.decode_rows is not None:
                o.index_copy_(0, split.decode_rows,
                              self._absorbed(layer, q.index_select(0, split.decode_rows), k_cache, meta, split))
            o.index_copy_(0, split.prefill_rows,
                          self._expanded(layer, q.index_select(0, split.prefill_rows), k_cache, split))
        return layer.o_proj(o.reshape(t, h * vd))

    def _absorbed(self, layer: DeepseekLayer, q: torch.Tensor, k_cache: KVCache, meta: AttentionMetadata,
                  split: _MlaSplit | None) -> torch.Tensor:
        """One-token queries over the latent cache, ``W_UK`` folded into each head's query
        and ``W_UV`` applied to its weighted latent: [T, H, v] (``split``: the decode rows of
        a step with prompt chunks)."""
        rope = self.mla.qk_rope_head_dim
        q_lat = torch.bmm(q[..., rope:].transpose(0, 1), layer.w_uk).transpose(0, 1)  # [T, H, latent]
        q = torch.cat([q[..., :rope], q_lat], dim=-1)
        if split is None:
            o = self._attend(layer, q, k_cache, k_cache, meta)  # [T, H, rope + latent]
        else:
            d = split.decode_meta
            o = self.ops.paged_attention_decode(q, k_cache, k_cache, d.block_tables, d.seq_lens, self.scale,
                                                d.seq_lens_host)
        return torch.bmm(o[..., rope:].transpose(0, 1), layer.w_uv).transpose(0, 1)  # [T, H, v]

    def _expanded(self, layer: DeepseekLayer, q: torch.Tensor, k_cache: KVCache, split: _MlaSplit) -> torch.Tensor:
        """Prompt chunks attended as plain multi-head attention (vLLM's MLA prefill): the
        blocks their context uses, read from the latent cache and expanded by ``kv_b_proj``
        into every head's key and value, as a paged cache of their own: [T, H, v]."""
        mla = self.mla
        rope, nope, vd = mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.v_head_dim
        width = max(rope + nope, vd)
        blocks = _read_blocks(k_cache, split.prefill_blocks, q.dtype)  # [N, bs, 1, rope + latent]
        n, bs, h = blocks.shape[0], blocks.shape[1], q.shape[1]
        rows = blocks.view(n * bs, -1)
        k = torch.empty((n * bs, h, width), dtype=q.dtype, device=q.device)
        k[..., :rope] = rows[:, None, :rope]
        k[..., rope:rope + nope] = torch.einsum("tl,hnl->thn", rows[:, rope:], layer.w_uk)
        k[..., rope + nope:] = 0
        v = F.pad(torch.einsum("tl,hlv->thv", rows[:, rope:], layer.w_uv), (0, width - vd))
        q = F.pad(q, (0, width - rope - nope))
        o = self.ops.paged_attention_prefill(q.contiguous(), k.view(n, bs, h, width), v.view(n, bs, h, width),
                                             split.prefill_meta, self.scale)
        return o[..., :vd]

    def _split(self, meta: AttentionMetadata, block_size: int) -> _MlaSplit:
        """``meta``'s split (every layer of a step passes the same object: made once a step)."""
        if self._split_key is not meta:
            self._split_cache = _split_step(meta, block_size)
            self._split_key = meta
        return self._split_cache


@dataclasses.dataclass(frozen=True, slots=True)
class _MlaSplit:
    """A step with prompt chunks, split as vLLM's MLA splits it: its one-token requests
    (decoding) read the latent cache with absorbed queries; its prompt chunks attend as
    multi-head attention over their context's blocks, expanded into a paged cache of their
    own whose block ids are the blocks' places in ``prefill_blocks``."""

    prefill_rows: torch.Tensor  # [T_p] int64: the step's rows in requests with more than one
    prefill_blocks: torch.Tensor  # [N] int64: the latent cache blocks their context uses
    prefill_meta: AttentionMetadata  # over the expanded blocks, renumbered 0..N-1
    decode_rows: torch.Tensor | None  # [T_d] int64: the rows of one-token requests
    decode_meta: AttentionMetadata | None


def _split_step(meta: AttentionMetadata, block_size: int) -> _MlaSplit:
    device = meta.slot_mapping.device
    qlens, slens = meta.query_lens_host, meta.seq_lens_host
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    prefill = [b for b, n in enumerate(qlens) if n > 1]
    decode = [b for b, n in enumerate(qlens) if n == 1]
    tables = meta.block_tables.cpu()
    used = [tables[b, :-(-slens[b] // block_size)].long() for b in prefill]
    blocks, renumbered = torch.unique(torch.cat(used), return_inverse=True)
    compact = torch.zeros((len(prefill), max(len(u) for u in used)), dtype=torch.int32)
    at = 0
    for i, u in enumerate(used):
        compact[i, :len(u)] = renumbered[at:at + len(u)].to(torch.int32)
        at += len(u)

    def rows(requests: list[int]) -> torch.Tensor:
        return torch.tensor([r for b in requests for r in range(starts[b], starts[b + 1])], dtype=torch.long,
                            device=device)

    def sub(requests: list[int], block_tables: torch.Tensor) -> AttentionMetadata:
        q = [qlens[b] for b in requests]
        s = [slens[b] for b in requests]
        loc = [0]
        for n in q:
            loc.append(loc[-1] + n)
        return AttentionMetadata(
            slot_mapping=meta.slot_mapping.index_select(0, rows(requests)),
            query_start_loc=torch.tensor(loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(s, dtype=torch.int32, device=device),
            block_tables=block_tables, max_query_len=max(q), max_seq_len=max(s),
            query_lens_host=tuple(q), seq_lens_host=tuple(s))

    decode_meta = None
    if decode:
        decode_meta = sub(decode, meta.block_tables.index_select(0, torch.tensor(decode, device=device)))
    return _MlaSplit(prefill_rows=rows(prefill), prefill_blocks=blocks.to(device),
                     prefill_meta=sub(prefill, compact.to(device)),
                     decode_rows=rows(decode) if decode else None, decode_meta=decode_meta)


def _read_blocks(cache: KVCache, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Whole blocks of a latent cache in ``dtype`` (an 8-bit cache's codes times their scales)."""
    if isinstance(cache, QuantizedKV):  # the codes moved as bytes: CPU index_select has no fp8 kernel
        codes = cache.data.view(torch.uint8).index_select(0, blocks).view(cache.dtype)
        return dequantize_kv(codes, cache.scale.index_select(0, blocks)).to(dtype)
    return cache.index_select(0, blocks).to(dtype)


__all__ = ["DeepseekLayer", "DeepseekModel", "deepseek_weight_names"]
