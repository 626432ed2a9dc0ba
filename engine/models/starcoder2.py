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

import torch
import torch.nn.functional as F

from engine.models.config import ModelConfig
from engine.models.layers.absolute import AbsoluteLayer
from engine.models.layers.decoder import Decoder
from engine.models.layers.linear import make_linear
from engine.models.layers.shard import ShardedWeights, qkv_spans
from engine.ops import AttentionMetadata, Ops
from engine.parallel import SINGLE, TensorParallel

_LAYER_TENSORS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                  "self_attn.v_proj", "self_attn.o_proj", "mlp.c_fc", "mlp.c_proj")


class Starcoder2Model(Decoder):
    """StarCoder2's decoder stack plus (tied) LM head over Hugging Face weights."""

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        names = ["model.embed_tokens.weight"]
        for i in range(config.num_hidden_layers):
            names += [f"model.layers.{i}.{t}.{kind}" for t in _LAYER_TENSORS for kind in ("weight", "bias")]
        names += ["model.norm.weight", "model.norm.bias"]
        return names if config.tie_word_embeddings else [*names, "lm_head.weight"]

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
        self._build_ends(get, weights, lambda: (get("model.norm.weight"), get("model.norm.bias")))
        self.layers = [self._layer(get, i) for i in tp.stage.layer_range(config.num_hidden_layers)]

    def _layer(self, get: ShardedWeights, i: int) -> AbsoluteLayer:  # type: ignore[override]
        p = f"model.layers.{i}."
        _, spans = qkv_spans(self.config, self.tp)
        attn = [(p + f"self_attn.{n}_proj", span) for n, span in zip("qkv", spans, strict=True)]
        return AbsoluteLayer(
            input_norm=get(p + "input_layernorm.weight"),
            input_norm_bias=get(p + "input_layernorm.bias"),
            post_norm=get(p + "post_attention_layernorm.weight"),
            post_norm_bias=get(p + "post_attention_layernorm.bias"),
            qkv=make_linear([get.rows(n + ".weight", spans=[s]) for n, s in attn],
                            torch.cat([get.rows(n + ".bias", spans=[s]) for n, s in attn])),
            o_proj=get.row_parallel(p + "self_attn.o_proj.weight"),
            o_bias=get(p + "self_attn.o_proj.bias"),
            q_norm=None,
            k_norm=None,
            gate_up=make_linear([get.rows(p + "mlp.c_fc.weight")], get.rows(p + "mlp.c_fc.bias")),
            down=get.row_parallel(p + "mlp.c_proj.weight"),
            down_bias=get(p + "mlp.c_proj.bias"),
            window=self.config.layer_windows[i],
            rope=self.cos_sin_cache,
        )

    def _ln(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, self.eps)

    def plan_fused_step(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """None: the fused CPU step computes the RMSNorm/gated-MLP layer, not this one."""
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

        def block(layer: AbsoluteLayer, hidden: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
            x = self._ln(hidden, layer.input_norm, layer.input_norm_bias)
            hidden = hidden + (self._attention(layer, x, positions, meta, k_cache, v_cache) + layer.o_bias)
            x = self._ln(hidden, layer.post_norm, layer.post_norm_bias)
            return hidden + (layer.down(F.gelu(layer.gate_up(x), approximate="tanh")) + layer.down_bias)

        return self._run_stream(input_ids, positions, kv_caches, block,  # type: ignore[return-value]
                                lambda h: self._ln(h, *self.norm))


__all__ = ["Starcoder2Model"]
