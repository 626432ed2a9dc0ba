"""The Llama family: Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3 and SmolLM2, and the
mixture-of-experts models built on the same layer (Mixtral, Qwen2-MoE, Qwen3-MoE).

Their decoder is the generic one (:class:`engine.models.layers.decoder.Decoder`): what
sets them apart are switches on :class:`~engine.models.config.ModelConfig` (q/k/v biases,
per-head q/k norms, fused Phi-3 weights, sliding windows, tied heads, sparse MLP layers),
which the decoder reads.
"""

from __future__ import annotations

from engine.models.layers.decoder import Decoder


class LlamaModel(Decoder):
    """The decoder stack plus LM head of a Llama-family model (see the module docstring)."""


__all__ = ["LlamaModel"]
