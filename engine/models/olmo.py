"""OLMo 2 and OLMo 3 (and EXAONE 4): the Llama decoder's attention and MLP in a layer
normed after each block instead of before it.

What differs from the generic decoder (:class:`~engine.models.layers.decoder.Decoder`), each
as transformers computes it:

* no norm before attention or the MLP: each block reads the residual stream itself, and its
  output is normed (``post_attention_layernorm``, ``post_feedforward_layernorm``) before it
  is added back;
* q and k are each normed over all their heads at once (``q_norm`` over
  ``heads * head_dim`` values, ``k_norm`` over the KV heads'), before RoPE;
* every norm multiplies ``x / rms(x)`` by its weight in fp32 and rounds once, Gemma's
  arithmetic with the weight as stored (no ``1 +``): :func:`gemma_rms_norm` over the fp32
  weight;
* OLMo 3 slides a window over three layers in four, its full layers alone taking the rope
  scaling (``ModelConfig.rope_local_theta`` gives the sliding layers' table).

EXAONE 4 (``exaone4``) is the same layer with Llama's norms (``x / rms(x)`` rounded to the
dtype, then times the weight: :meth:`Ops.rms_norm`), q and k normed per head, and, in its
hybrid models, RoPE only on the sliding layers (``ModelConfig.nope_layers``: the global
ones). It runs the unfused layers only (:meth:`OlmoModel.plan_fused_step` is None for it).

Projections, the embedding and the head are the generic decoder's (GGUF-free: OLMo loads
from Hugging Face folders). The fused CPU decode step runs this layer in its Gemma mode
(fp32 norm weights multiplied as stored, no norms before the blocks, SwiGLU, q/k norms
across the heads: :meth:`OlmoModel.fused_description`). q/k norms across all heads
split with the heads over tensor-parallel ranks: each rank normalizes its heads by the
sum of squares of all of them (one all-reduce of a value a token,
:func:`engine.models.layers.norm.split_heads_norm`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from engine.models.config import ModelConfig
from engine.models.layers.decoder import Decoder, DecoderLayer, decoder_weight_names
from engine.models.layers.norm import gemma_rms_norm, split_heads_norm
from engine.models.layers.shard import ShardedWeights, qkv_spans, take_rows
from engine.ops import AttentionMetadata, Ops
from engine.ops.cpu.fused_spec import FusedLayer, FusedModel
from engine.parallel import SINGLE, TensorParallel

OLMO_LAYER_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")


@dataclasses.dataclass(slots=True)
class OlmoLayer(DecoderLayer):
    # input_norm: None (OLMo has none); post_norm: after attention; q_norm / k_norm: over
    # all of q's and k's heads.
    post_ffn_norm: torch.Tensor  # after the MLP


class OlmoModel(Decoder):
    """OLMo 2 / OLMo 3 decoder stack plus LM head over Hugging Face weights."""

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        return decoder_weight_names(config, OLMO_LAYER_NORMS)

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
        self._build_ends(get, weights, lambda: self._norm_weight(weights, "model.norm.weight"))
        self.layers = [self._layer(get, i) for i in tp.stage.layer_range(config.num_hidden_layers)]

    @property
    def _exaone(self) -> bool:
        return self.config.architecture == "exaone4"

    def _norm_weight(self, weights: Any, name: str) -> torch.Tensor:
        """A norm's weight in fp32, as stored: OLMo's norm multiplies by it in fp32
        (EXAONE's in the model dtype, as Llama's)."""
        dtype = self.dtype if self._exaone else torch.float32
        return ShardedWeights(weights, dtype, self.device)(name).contiguous()

    def _layer(self, get: ShardedWeights, i: int) -> OlmoLayer:  # type: ignore[override]
        p = f"model.layers.{i}."
        norm = lambda name: self._norm_weight(get.weights, p + name)  # noqa: E731
        q_norm, k_norm = norm("self_attn.q_norm.weight"), norm("self_attn.k_norm.weight")
        if self.tp.enabled and not self._exaone:
            # Norms across all heads: each rank keeps its heads' share of the weights.
            (sq, _, sk), (q_span, k_span, _) = qkv_spans(self.config, self.tp)
            q_norm = take_rows(q_norm, q_span).contiguous()
            k_norm = take_rows(k_norm, k_span).contiguous()
        return OlmoLayer(
            input_norm=None,  # type: ignore[arg-type]  # OLMo norms after each block
            post_norm=norm("post_attention_layernorm.weight"),
            post_ffn_norm=norm("post_feedforward_layernorm.weight"),
            q_norm=q_norm,
            k_norm=k_norm,
            **self._plain_layer_parts(get, i) | ({"rope": None} if i in self.config.nope_layers else {}),
        )

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """q or k [T, heads, D] normed over all its heads at once (the weight is as wide);
        EXAONE's each head on its own, as the Llama family's. Over tensor-parallel ranks
        each holds some of the heads: :func:`~engine.models.layers.norm.split_heads_norm`."""
        if self._exaone:
            return super()._head_norm(x, weight)
        t = x.shape[0]
        if self.tp.enabled:
            return split_heads_norm(x.reshape(t, -1), weight, self.eps, self.tp, self.config, fp32_weight=True).view(x.shape)
        return self._rms(x.reshape(t, -1), weight).view(x.shape)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._exaone:
            return self.ops.rms_norm(x, weight, self.eps)
        return gemma_rms_norm(self.ops, x, weight, self.eps)

    def plan_fused_step(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """OLMo's fused step (its Gemma mode); None for EXAONE, whose Llama-rounded norms
        after each block the fused step does not compute."""
        return None if self._exaone else super().plan_fused_step(kv_caches)

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

        def block(layer: OlmoLayer, hidden: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
            x = self._attention(layer, hidden, positions, meta, k_cache, v_cache)
            hidden = hidden + self._rms(x, layer.post_norm)
            x = layer.down(ops.silu_and_mul(layer.gate_up(hidden)))  # row-parallel: the whole output
            return hidden + self._rms(x, layer.post_ffn_norm)

        return self._run_stream(input_ids, positions, kv_caches, block, lambda h: self._rms(h, self.norm),  # type: ignore[return-value]
                                lambda h: self._run_fused(h, positions, meta, kv_caches), mm_embeds=mm_embeds)  # small CPU steps: one C call

    def fused_description(self) -> FusedModel:
        return dataclasses.replace(super().fused_description(), gemma=True, qk_norm_full=True)

    def _fused_layer(self, layer: DecoderLayer) -> FusedLayer:
        assert isinstance(layer, OlmoLayer)
        # No norm before either block (input_norm and pre_ffn_norm None); both after.
        return dataclasses.replace(super()._fused_layer(layer), pre_ffn_norm=None,
                                   post_ffn_norm=layer.post_ffn_norm)


__all__ = ["OLMO_LAYER_NORMS", "OlmoLayer", "OlmoModel"]
