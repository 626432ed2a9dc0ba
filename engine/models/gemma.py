"""Gemma, Gemma 2 and Gemma 3 (text): the Llama decoder's attention with Gemma's layer
around it.

What differs from the generic decoder (:class:`~engine.models.layers.decoder.Decoder`, the
Llama family's), each as transformers computes it:

* RMSNorms ``x / rms(x) * (1 + weight)`` computed in fp32 and rounded once (Llama rounds
  ``x / rms(x)`` first, then multiplies by a weight stored without the 1). Gemma 1 has
  Llama's two a layer (before attention, before the MLP); Gemma 2 and 3 four: before and
  after attention, before and after the MLP (the "sandwich");
* the MLP is GeGLU: ``down(gelu_tanh(gate(x)) * up(x))``;
* embeddings are scaled by ``sqrt(hidden_size)`` (rounded to the model dtype first);
* attention scale ``query_pre_attn_scalar ** -0.5`` (Gemma 1: ``head_dim ** -0.5``); Gemma 2 soft-caps attention scores
  (``attn_logit_softcapping``) and final logits (``final_logit_softcapping``);
* local (sliding-window) and global layers alternate (``ModelConfig.layer_windows``);
  Gemma 3's local layers rotate with their own base (``rope_local_base_freq``, no scaling)
  and it normalises each head of q and k before RoPE (with the same ``1 + weight`` norm).

Projections, the embedding and the (tied) head go through the same quantization-aware
helpers as the Llama decoder (:mod:`engine.models.layers.linear`), so a GGUF's blocks are
kept.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.models.config import ModelConfig
from engine.models.layers.decoder import LAYER_NORMS, Decoder, DecoderLayer, decoder_weight_names
from engine.models.layers.norm import gemma_norm_weight, gemma_rms_norm
from engine.models.layers.shard import ShardedWeights
from engine.ops import AttentionMetadata, Ops
from engine.ops.cpu.fused_spec import FusedLayer, FusedModel
from engine.parallel import SINGLE, TensorParallel

# Gemma's sandwich: a norm before and after the MLP too.
GEMMA_LAYER_NORMS = (*LAYER_NORMS, "pre_feedforward_layernorm", "post_feedforward_layernorm")


@dataclasses.dataclass(slots=True)
class GemmaLayer(DecoderLayer):
    # input_norm: before attention; post_norm: after it (Gemma 2/3's post_attention_layernorm;
    # None in Gemma 1, which adds attention's output as it is).
    pre_ffn_norm: torch.Tensor  # before the MLP (Gemma 1's post_attention_layernorm)
    post_ffn_norm: torch.Tensor | None  # after it; None in Gemma 1


class GemmaModel(Decoder):
    """Gemma / Gemma 2 / Gemma 3 decoder stack plus (tied) LM head over Hugging Face weights."""

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        return decoder_weight_names(config, LAYER_NORMS if config.architecture == "gemma" else GEMMA_LAYER_NORMS)

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
        assert config.query_pre_attn_scalar is not None  # from_hf requires it for Gemma
        self._init_common(config, ops, dtype, device, tp, scale=config.query_pre_attn_scalar**-0.5,
                          softcap=config.attn_logit_softcapping)
        self._init_rope_tables()
        # transformers: Gemma 2 builds the scale in the model dtype, Gemma 3 in fp32 and
        # casts it; both round sqrt(hidden) to the dtype before the multiply.
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32).to(dtype)
        get = ShardedWeights(weights, dtype, self.device, tp)
        self._build_ends(get, weights, lambda: self._norm_weight(weights, "model.norm.weight"))
        self.layers = [self._layer(get, i) for i in tp.stage.layer_range(config.num_hidden_layers)]

    def _norm_weight(self, weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        return gemma_norm_weight(weights, name, self.device)

    def _layer(self, get: ShardedWeights, i: int) -> GemmaLayer:  # type: ignore[override]
        p = f"model.layers.{i}."
        norm = lambda name: self._norm_weight(get.weights, p + name)  # noqa: E731
        qk_norm = self.config.qk_norm
        sandwich = self.config.architecture != "gemma"
        return GemmaLayer(
            input_norm=norm("input_layernorm.weight"),
            post_norm=norm("post_attention_layernorm.weight") if sandwich else None,
            pre_ffn_norm=norm("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight"),
            post_ffn_norm=norm("post_feedforward_layernorm.weight") if sandwich else None,
            q_norm=norm("self_attn.q_norm.weight") if qk_norm else None,
            k_norm=norm("self_attn.k_norm.weight") if qk_norm else None,
            **self._plain_layer_parts(get, i),
        )

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._rms(x, weight)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(self.ops, x, weight, self.eps)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; writes this step's K/V."""
        ops = self.ops
        stage = self.tp.stage
        hidden = self._hidden_stream_in(input_ids, positions, self.embed_scale)
        if not stage.enabled:
            out = self._run_fused(hidden, positions, meta, kv_caches)  # small CPU steps: one C call
            if out is not None:
                return out
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            assert isinstance(layer, GemmaLayer)
            x = self._rms(hidden, layer.input_norm)
            x = self._attention(layer, x, positions, meta, k_cache, v_cache)
            hidden = hidden + (x if layer.post_norm is None else self._rms(x, layer.post_norm))
            x = self._rms(hidden, layer.pre_ffn_norm)
            x = layer.down(ops.gelu_tanh_and_mul(layer.gate_up(x)))  # row-parallel: the whole output
            hidden = hidden + (x if layer.post_ffn_norm is None else self._rms(x, layer.post_ffn_norm))
        if not stage.last:
            stage.send([hidden])
            return None  # type: ignore[return-value]
        return self._rms(hidden, self.norm)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in fp32, soft-capped (in the model dtype, as transformers; with
        tensor parallelism, on the gathered logits)."""
        logits = self._logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def fused_description(self) -> FusedModel:
        return dataclasses.replace(super().fused_description(), gemma=True, activation="gelu_tanh")

    def _fused_layer(self, layer: DecoderLayer) -> FusedLayer:
        assert isinstance(layer, GemmaLayer)
        return dataclasses.replace(super()._fused_layer(layer), pre_ffn_norm=layer.pre_ffn_norm,
                                   post_ffn_norm=layer.post_ffn_norm)


__all__ = ["GEMMA_LAYER_NORMS", "GemmaLayer", "GemmaModel"]
