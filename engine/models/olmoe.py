"""OLMoE (``OlmoeForCausalLM``: OLMoE-1B-7B): the Llama layer with q and k each normed
across all their heads at once, and a mixture of experts on every layer.

What differs from the Llama family's decoder (:class:`~engine.models.layers.decoder.Decoder`),
each as transformers computes it:

* q's norm spans all ``heads x head_dim`` values of a token, k's all of its KV heads'
  (OLMo 2's), with Llama's rounding (``x / rms(x)`` to the dtype, then times the weight);
  over tensor-parallel ranks each keeps its heads' share of the weights and the sums of
  squares are summed over the ranks (:func:`~engine.models.layers.norm.split_heads_norm`);
* every layer's MLP is routed experts (engine.models.layers.moe, Qwen's names): a softmax
  over all experts, the top ``num_experts_per_tok``, renormalised only with
  ``norm_topk_prob`` (off by default).

``clip_qkv`` is refused at load. The fused CPU decode step does not run this layer, nor do
LoRA adapters or GGUF files serve it.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.models.layers.decoder import Decoder, DecoderLayer
from engine.models.layers.norm import split_heads_norm
from engine.models.layers.shard import ShardedWeights, qkv_spans, take_rows


class OlmoeModel(Decoder):
    """OLMoE's decoder stack plus LM head over Hugging Face weights."""

    def _layer(self, get: ShardedWeights, i: int) -> DecoderLayer:  # type: ignore[override]
        layer = super()._layer(get, i)
        if not self.tp.enabled:
            return layer
        # Norms across all heads: each rank keeps its heads' share of the weights.
        _, (q_span, k_span, _) = qkv_spans(self.config, self.tp)
        return dataclasses.replace(layer, q_norm=take_rows(layer.q_norm, q_span).contiguous(),
                                   k_norm=take_rows(layer.k_norm, k_span).contiguous())

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """q or k [T, heads, D] normed over all its heads at once."""
        t = x.shape[0]
        if self.tp.enabled:
            return split_heads_norm(x.reshape(t, -1), weight, self.eps, self.tp, self.config,
                                    fp32_weight=False).view(x.shape)
        return self.ops.rms_norm(x.reshape(t, -1).contiguous(), weight, self.eps).view(x.shape)

    def plan_fused_step(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """None: the fused CPU step's q/k norms across the heads are OLMo 2's (fp32 weights)."""
        return None


__all__ = ["OlmoeModel"]
