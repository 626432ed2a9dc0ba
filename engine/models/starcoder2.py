"""StarCoder2 (``Starcoder2ForCausalLM``: StarCoder2-3B, 7B, 15B): the Llama layer's
attention (GQA, rotate-half RoPE) in GPT-2's layer.

What differs from the generic decoder (:class:`~engine.models.layers.decoder.Decoder`), each
as transformers computes it:

* LayerNorm with a bias before attention and before the MLP, and after the last layer
  (``norm_epsilon``), in the model dtype;
* biases on q, k, v and o and on the MLP's two projections (``use_bias``; checkpoints
  without them are refused);
* a plain MLP: ``c_proj(gelu_tanh(c_fc(x)))``;
* a sliding window (``sliding_window``) on every layer.

Tensor parallelism cuts q/k/v and ``c_fc`` by rows with their biases, o and ``c_proj`` by
input columns, their biases added once after the all-reduce (GPT-2's layer:
:class:`~engine.models.layers.absolute.AbsoluteLayer`). The fused CPU decode step does not
run this layer, nor do LoRA adapters or GGUF files serve it.
"""

from __future__ import annotations

from engine.models.config import ModelConfig
from engine.models.layers.absolute import AbsoluteLayer, RotaryLayerNormDecoder, biased_layer
from engine.models.layers.shard import ShardedWeights

_LAYER_TENSORS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                  "self_attn.v_proj", "self_attn.o_proj", "mlp.c_fc", "mlp.c_proj")


class Starcoder2Model(RotaryLayerNormDecoder):
    """StarCoder2's decoder stack plus (tied) LM head over Hugging Face weights."""

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        names = ["model.embed_tokens.weight"]
        for i in range(config.num_hidden_layers):
            names += [f"model.layers.{i}.{t}.{kind}" for t in _LAYER_TENSORS for kind in ("weight", "bias")]
        names += ["model.norm.weight", "model.norm.bias"]
        return names if config.tie_word_embeddings else [*names, "lm_head.weight"]

    def _layer(self, get: ShardedWeights, i: int) -> AbsoluteLayer:  # type: ignore[override]
        return biased_layer(get, self.config, self.tp, f"model.layers.{i}.",
                            norms=("input_layernorm", "post_attention_layernorm"),
                            qkv=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), o="self_attn.o_proj",
                            fc1="mlp.c_fc", fc2="mlp.c_proj", window=self.config.layer_windows[i], rope=self.cos_sin_cache)


__all__ = ["Starcoder2Model"]
