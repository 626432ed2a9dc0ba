"""Phi-1, Phi-1.5 and Phi-2 (``PhiForCausalLM``): attention and a plain MLP side by side on
one LayerNorm.

What differs from the generic decoder (:class:`~engine.models.layers.decoder.Decoder`), each
as transformers computes it:

* one LayerNorm a layer, with a bias (``layer_norm_eps``); ``attn(ln(x)) + mlp(ln(x)) + x``;
* biases on q, k, v and o (``dense``), on the MLP (``fc1``, ``fc2``, tanh GELU) and on the
  LM head; a final LayerNorm (``final_layernorm``);
* rotate-half RoPE on the first ``partial_rotary_factor`` (0.4 in Phi-2) of each head.

``qk_layernorm`` is refused at load. Tensor parallelism cuts it as GPT-2's layer (o's and
fc2's biases added once after the all-reduce; the head's bias cut with its vocabulary
rows). The fused CPU decode step does not run this layer, nor do LoRA adapters or GGUF
files serve it.
"""

from __future__ import annotations

from typing import Any

from engine.models.config import ModelConfig
from engine.models.layers.absolute import AbsoluteLayer, RotaryLayerNormDecoder, biased_layer
from engine.models.layers.linear import make_linear
from engine.models.layers.shard import ShardedWeights

_LAYER_TENSORS = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.dense",
                  "mlp.fc1", "mlp.fc2")


class PhiModel(RotaryLayerNormDecoder):
    """Phi-2's decoder stack plus its biased LM head over Hugging Face weights."""

    parallel = True
    FINAL_NORM = "model.final_layernorm"

    def _build_ends(self, get: ShardedWeights, weights: Any, final_norm: Any) -> None:
        super()._build_ends(get, weights, final_norm)
        if self.tp.stage.last:  # the head carries a bias, cut with its vocabulary rows
            tied = self.config.tie_word_embeddings or "lm_head.weight" not in weights
            head = self.embed if tied else get.rows("lm_head.weight")
            self.lm_head = make_linear([head], get.rows("lm_head.bias"))


    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        names = ["model.embed_tokens.weight"]
        for i in range(config.num_hidden_layers):
            names += [f"model.layers.{i}.{t}.{kind}" for t in _LAYER_TENSORS for kind in ("weight", "bias")]
        names += ["model.final_layernorm.weight", "model.final_layernorm.bias", "lm_head.bias"]
        return names if config.tie_word_embeddings else [*names, "lm_head.weight"]

    def _layer(self, get: ShardedWeights, i: int) -> AbsoluteLayer:  # type: ignore[override]
        return biased_layer(get, self.config, self.tp, f"model.layers.{i}.", norms=("input_layernorm",) * 2,
                            qkv=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), o="self_attn.dense",
                            fc1="mlp.fc1", fc2="mlp.fc2", rope=self.cos_sin_cache)


__all__ = ["PhiModel"]
