"""GPT-NeoX (``GPTNeoXForCausalLM``: Pythia, Dolly, RedPajama-INCITE, GPT-NeoX-20B):
attention and a plain MLP, each on its own LayerNorm, side by side.

What differs from the generic decoder (:class:`~engine.models.layers.decoder.Decoder`), each
as transformers computes it:

* ``use_parallel_residual`` (the default): ``x + attn(ln1(x)) + mlp(ln2(x))``; without it
  the blocks follow each other (``x + attn(ln1(x))``, then ``+ mlp(ln2(...))``);
  LayerNorms with biases, in the model dtype;
* q/k/v in one projection stored head by head (each head's q, k, v rows together),
  regrouped at load (:class:`~engine.models.layers.absolute.HeadsRegrouped`); biases on
  q/k/v, o and the MLP (``dense_h_to_4h``, ``dense_4h_to_h``; o's and the MLP's second
  added once after the all-reduce under tensor parallelism);
* RoPE (rotate-half) on the first ``rotary_pct`` (0.25) of each head;
* the MLP's activation: exact GELU (``gelu``, the default) or its tanh approximation;
* the names: ``gpt_neox.embed_in``, ``gpt_neox.layers.N``, ``gpt_neox.final_layer_norm``,
  and the head ``embed_out``.

The fused CPU decode step does not run this layer, nor do LoRA adapters or GGUF files
serve it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from engine.models.config import ModelConfig
from engine.models.layers.absolute import (
    AbsoluteLayer,
    HeadsRegrouped,
    RotaryLayerNormDecoder,
    biased_layer,
)
from engine.models.layers.shard import ShardedWeights

_LAYER_TENSORS = ("input_layernorm", "post_attention_layernorm", "attention.query_key_value", "attention.dense",
                  "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")
# The decoder's names for the ends -> GPT-NeoX's.
_ENDS = {"model.embed_tokens.weight": "gpt_neox.embed_in.weight", "lm_head.weight": "embed_out.weight"}


class _Ends(Mapping):
    """The checkpoint's tensors, the embedding and head also under the decoder's names."""

    def __init__(self, weights: Mapping) -> None:
        self._weights = weights

    def __getitem__(self, name: str) -> Any:
        return self._weights[_ENDS.get(name, name)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)


class GPTNeoXModel(RotaryLayerNormDecoder):
    """GPT-NeoX's decoder stack plus LM head over Hugging Face weights."""

    FINAL_NORM = "gpt_neox.final_layer_norm"

    @property
    def parallel(self) -> bool:  # type: ignore[override]
        return self.config.parallel_residual

    def _stored(self, weights: Mapping) -> Mapping:
        return _Ends(HeadsRegrouped(weights, self.config.num_attention_heads,
                                    (".attention.query_key_value.weight", ".attention.query_key_value.bias")))

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        names = [_ENDS["model.embed_tokens.weight"]]
        for i in range(config.num_hidden_layers):
            names += [f"gpt_neox.layers.{i}.{t}.{kind}" for t in _LAYER_TENSORS for kind in ("weight", "bias")]
        names += ["gpt_neox.final_layer_norm.weight", "gpt_neox.final_layer_norm.bias"]
        return names if config.tie_word_embeddings else [*names, _ENDS["lm_head.weight"]]

    def _layer(self, get: ShardedWeights, i: int) -> AbsoluteLayer:  # type: ignore[override]
        return biased_layer(get, self.config, self.tp, f"gpt_neox.layers.{i}.",
                            norms=("input_layernorm", "post_attention_layernorm"), qkv=("attention.query_key_value",),
                            o="attention.dense", fc1="mlp.dense_h_to_4h", fc2="mlp.dense_4h_to_h", rope=self.cos_sin_cache)


__all__ = ["GPTNeoXModel"]
