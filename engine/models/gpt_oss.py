"""gpt-oss (``GptOssForCausalLM``, OpenAI's gpt-oss-20b and -120b): the Llama layer with
biased attention that has sinks, and a mixture of experts on every layer.

What differs from the generic decoder (:class:`~engine.models.layers.decoder.Decoder`), each
as transformers computes it:

* q, k, v and o all carry biases (``attention_bias``); over tensor-parallel ranks o's is
  added once, after the ranks' partial sums are all-reduced (inside o on one rank);
* every head has an attention *sink* (``self_attn.sinks``): one more logit in its softmax,
  with no value, so a head may attend to nothing much (``Ops.paged_attention_*``'s
  ``sinks``);
* sliding-window (128) and full layers alternate (``layer_types``), and RoPE is YaRN
  without truncating its correction range;
* each norm multiplies ``x / rms(x)`` by its fp32 weight in fp32, then rounds (the fp32
  norms of transformers' ``_keep_in_fp32_modules``): :func:`gemma_rms_norm` over the
  weight as stored;
* the MLP is a mixture of experts (:class:`GptOssExperts`): a router with a bias whose
  top-k logits are softmaxed (a renormalised top-k of the softmax), experts stored
  stacked with their gate and up columns interleaved, biases on both projections, and
  the clamped SwiGLU ``(clamp(up) + 1) * g * sigmoid(1.702 g)``, ``g = min(gate, 7)``
  (:class:`~engine.ops.moe.ClampedSwiglu`).

Small CPU steps run in the fused decode step's Gemma mode (fp32 norm weights multiplied as
stored, norms before the blocks only, the sinks in its attention), each layer's experts in
between its C calls (quant.c's MoE kernel). The released checkpoints keep the experts in
MXFP4 blocks; the loader dequantizes them (engine.models.hf_quant) and they run dense. Over tensor-parallel ranks each rank keeps
its heads (their sinks too) and its share of every expert, as for the other MoE families;
the down projections' biases, like o's, join after the all-reduce.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from engine.models.config import ModelConfig
from engine.models.layers.decoder import Decoder, DecoderLayer
from engine.models.layers.linear import Linear, make_linear
from engine.models.layers.moe import expert_share, local_experts, select_experts
from engine.models.layers.norm import gemma_rms_norm
from engine.models.layers.shard import ShardedWeights, qkv_spans
from engine.ops import AttentionMetadata, Ops
from engine.ops.cpu.fused_spec import FusedLayer, FusedModel
from engine.ops.moe import ClampedSwiglu
from engine.parallel import SINGLE, TensorParallel, shard_range


def gpt_oss_weight_names(config: ModelConfig) -> list[str]:
    """The checkpoint tensors of a gpt-oss model, in checkpoint order (the experts dense;
    an MXFP4 folder's ``_blocks``/``_scales`` pairs are read as these names)."""
    names = ["model.embed_tokens.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names += [p + f"self_attn.{proj}.weight", p + f"self_attn.{proj}.bias"]
        names.append(p + "self_attn.sinks")
        names += [p + "mlp.router.weight", p + "mlp.router.bias"]
        names += [p + f"mlp.experts.{n}" for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")]
    names.append("model.norm.weight")
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def _deinterleave(w: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gate/up outputs alternate along the last axis (gate at even positions);
    the kernels take every gate output, then every up output."""
    return torch.cat([w[..., 0::2], w[..., 1::2]], dim=-1)


class GptOssExperts:
    """One layer's router and experts: ``w13`` [E, 2 * inter, hidden] (gate rows, then up
    rows), ``b13`` [E, 2 * inter], ``w2`` [E, hidden, inter] and ``b2`` [E, hidden], each
    rank's share of every expert's inner width, or under expert parallelism its experts
    whole (``b2`` whole either way: it joins after the all-reduce, :meth:`down_bias`)."""

    __slots__ = ("top_k", "router", "w13", "w2", "b2", "swiglu", "first_expert")

    def __init__(self, config: ModelConfig, layer: int, get: Callable[[str], torch.Tensor],
                 tp: TensorParallel = SINGLE) -> None:
        moe = config.moe
        assert moe is not None and moe.naming == "gpt_oss"
        p = f"model.layers.{layer}.mlp."
        self.top_k = moe.top_k
        self.router = Linear(get(p + "router.weight"), get(p + "router.bias"))
        gate_up = _deinterleave(get(p + "experts.gate_up_proj"))  # [E, hidden, 2 * inter]
        b13 = _deinterleave(get(p + "experts.gate_up_proj_bias"))  # [E, 2 * inter]
        down = get(p + "experts.down_proj")  # [E, inter, hidden]
        inter = moe.intermediate_size
        self.first_expert: int | None = None
        if tp.enabled and tp.expert_parallel:  # this rank's experts, whole
            a, b = expert_share(moe.num_experts, tp)
            gate_up, b13, down, self.first_expert = gate_up[a:b], b13[a:b], down[a:b], a
        elif tp.enabled:  # this rank's share of every expert's gate and up columns, down rows
            a, b = shard_range(inter, tp.rank, tp.world_size)
            gate_up = torch.cat([gate_up[..., a:b], gate_up[..., inter + a:inter + b]], dim=-1)
            b13 = torch.cat([b13[:, a:b], b13[:, inter + a:inter + b]], dim=-1)
            down = down[:, a:b]
        self.w13 = gate_up.transpose(1, 2).contiguous()
        self.w2 = down.transpose(1, 2).contiguous()
        self.b2 = get(p + "experts.down_proj_bias")
        self.swiglu = ClampedSwiglu(b13.contiguous(), moe.swiglu_alpha, moe.swiglu_limit)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k] fp32, ids [T, k])``: the softmax of each token's top-k logits."""
        return select_experts(self.router(x), self.top_k, renormalize=True)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ops: Ops) -> torch.Tensor:
        """The routed experts' outputs without their down biases (this rank's part: under
        expert parallelism, its experts' pairs)."""
        if self.first_expert is not None:
            return local_experts(ops, x, self.w13, self.w2, weights, ids, self.first_expert, self.swiglu)
        return ops.fused_moe(x, self.w13, self.w2, weights, ids, self.swiglu)

    def down_bias(self, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``sum_j weights[t, j] * b2[ids[t, j]]`` [T, hidden] in fp32: the down biases'
        share of each token's output, the same on every rank."""
        return (weights.unsqueeze(-1) * self.b2[ids].float()).sum(1)


@dataclasses.dataclass(slots=True)
class GptOssLayer(DecoderLayer):
    # input_norm / post_norm: fp32 weights (before attention, before the MLP); moe: None.
    # o_proj's bias: in o_proj on one rank, else added after o's all-reduce (o_bias).
    o_bias: torch.Tensor | None
    sinks: torch.Tensor  # [this rank's heads] fp32
    experts: GptOssExperts

    def mlp(self, x: torch.Tensor, ops: Ops, tp: TensorParallel) -> torch.Tensor:
        """The experts' output for ``x`` [T, hidden], whole (all-reduced), in x's dtype."""
        weights, ids = self.experts.route(x)
        out = tp.all_reduce(self.experts(x, weights, ids, ops))
        return (out.float() + self.experts.down_bias(weights, ids)).to(x.dtype)


class GptOssModel(Decoder):
    """gpt-oss's decoder stack plus LM head over Hugging Face weights."""

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        return gpt_oss_weight_names(config)

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
        self._init_rope_tables()
        get = ShardedWeights(weights, dtype, self.device, tp)
        self._build_ends(get, weights, lambda: self._fp32(weights, "model.norm.weight"))
        self.layers = [self._layer(get, i) for i in tp.stage.layer_range(config.num_hidden_layers)]

    def _fp32(self, weights: Any, name: str) -> torch.Tensor:
        return ShardedWeights(weights, torch.float32, self.device)(name).contiguous()

    def _layer(self, get: ShardedWeights, i: int) -> GptOssLayer:  # type: ignore[override]
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        _, spans = qkv_spans(self.config, self.tp)
        parts = [(get.rows(attn + f"{n}_proj.weight", spans=[s]), get.rows(attn + f"{n}_proj.bias", spans=[s]))
                 for n, s in zip("qkv", spans, strict=True)]
        (q0, q1), = spans[0]
        d = self.head_dim
        window = self.config.layer_windows[i]
        o_bias = get(attn + "o_proj.bias")
        if self.tp.enabled:  # the bias joins once, after the ranks' partial sums
            o_proj = get.row_parallel(attn + "o_proj.weight")
        else:
            o_proj, o_bias = make_linear([get(attn + "o_proj.weight")], o_bias), None
        return GptOssLayer(
            input_norm=self._fp32(get.weights, p + "input_layernorm.weight"),
            post_norm=self._fp32(get.weights, p + "post_attention_layernorm.weight"),
            qkv=make_linear([w for w, _ in parts], torch.cat([b for _, b in parts])),
            o_proj=o_proj,
            q_norm=None,
            k_norm=None,
            gate_up=None,
            down=None,
            window=window,
            rope=self.local_cos_sin_cache if window else self.cos_sin_cache,
            o_bias=o_bias,
            sinks=self._fp32(get.weights, attn + "sinks")[q0 // d:q1 // d].contiguous(),
            experts=GptOssExperts(self.config, i, get, self.tp),
        )

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(self.ops, x, weight, self.eps)

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
        ops = self.ops

        def block(layer: GptOssLayer, hidden: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
            x = self._attention(layer, self._rms(hidden, layer.input_norm), positions, meta, k_cache, v_cache)
            hidden = hidden + (x if layer.o_bias is None else x + layer.o_bias)
            return hidden + layer.mlp(self._rms(hidden, layer.post_norm), ops, self.tp)

        return self._run_stream(input_ids, positions, kv_caches, block, lambda h: self._rms(h, self.norm),  # type: ignore[return-value]
                                lambda h: self._run_fused(h, positions, meta, kv_caches), mm_embeds=mm_embeds)  # small CPU steps: one C call

    def _attend(self, layer: DecoderLayer, q: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The layer's causal (windowed) attention with its sinks."""
        assert isinstance(layer, GptOssLayer)
        if meta.decode_only:
            return self.ops.paged_attention_decode(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale,
                meta.seq_lens_host, window=layer.window, sinks=layer.sinks,
            )
        return self.ops.paged_attention_prefill(q, k_cache, v_cache, meta, self.scale,
                                                window=layer.window, sinks=layer.sinks)


    def fused_description(self) -> FusedModel:
        """The fused CPU step's Gemma mode (fp32 norm weights multiplied as stored), each
        layer's experts run in torch between C calls."""
        return dataclasses.replace(super().fused_description(), gemma=True)

    def _fused_layer(self, layer: DecoderLayer) -> FusedLayer:
        assert isinstance(layer, GptOssLayer)
        # Norms before each block (the pre-MLP one in the pre-FFN place), none after; the
        # sinks in the decode items; the biases in the projections.
        return dataclasses.replace(
            super()._fused_layer(layer), post_norm=None, pre_ffn_norm=layer.post_norm, post_ffn_norm=None,
            sinks=layer.sinks, external_mlp=functools.partial(layer.mlp, ops=self.ops, tp=self.tp))


__all__ = ["GptOssExperts", "GptOssLayer", "GptOssModel", "gpt_oss_weight_names"]
