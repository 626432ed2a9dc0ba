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

import torch
import torch.nn.functional as F

from engine.models.config import ModelConfig
from engine.models.layers.absolute import AbsoluteLayer
from engine.models.layers.decoder import Decoder
from engine.models.layers.linear import make_linear
from engine.models.layers.shard import ShardedWeights, qkv_spans
from engine.ops import AttentionMetadata, Ops
from engine.parallel import SINGLE, TensorParallel

_LAYER_TENSORS = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.dense",
                  "mlp.fc1", "mlp.fc2")


class PhiModel(Decoder):
    """Phi-2's decoder stack plus its biased LM head over Hugging Face weights."""

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        names = ["model.embed_tokens.weight"]
        for i in range(config.num_hidden_layers):
            names += [f"model.layers.{i}.{t}.{kind}" for t in _LAYER_TENSORS for kind in ("weight", "bias")]
        names += ["model.final_layernorm.weight", "model.final_layernorm.bias", "lm_head.bias"]
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
        self._build_ends(get, weights, lambda: (get("model.final_layernorm.weight"), get("model.final_layernorm.bias")))
        if tp.stage.last:  # the head carries a bias, cut with its vocabulary rows
            tied = config.tie_word_embeddings or "lm_head.weight" not in weights
            head = self.embed if tied else get.rows("lm_head.weight")
            self.lm_head = make_linear([head], get.rows("lm_head.bias"))
        self.layers = [self._layer(get, i) for i in tp.stage.layer_range(config.num_hidden_layers)]
        self.act = (lambda x: F.gelu(x, approximate="tanh")) if config.activation == "gelu_tanh" else F.gelu

    def _layer(self, get: ShardedWeights, i: int) -> AbsoluteLayer:  # type: ignore[override]
        p = f"model.layers.{i}."
        _, spans = qkv_spans(self.config, self.tp)
        attn = [(p + f"self_attn.{n}_proj", span) for n, span in zip("qkv", spans, strict=True)]
        norm, norm_bias = get(p + "input_layernorm.weight"), get(p + "input_layernorm.bias")
        return AbsoluteLayer(
            input_norm=norm,
            input_norm_bias=norm_bias,
            post_norm=norm,  # one norm a layer, read by both blocks
            post_norm_bias=norm_bias,
            qkv=make_linear([get.rows(n + ".weight", spans=[s]) for n, s in attn],
                            torch.cat([get.rows(n + ".bias", spans=[s]) for n, s in attn])),
            o_proj=get.row_parallel(p + "self_attn.dense.weight"),
            o_bias=get(p + "self_attn.dense.bias"),
            q_norm=None,
            k_norm=None,
            gate_up=make_linear([get.rows(p + "mlp.fc1.weight")], get.rows(p + "mlp.fc1.bias")),
            down=get.row_parallel(p + "mlp.fc2.weight"),
            down_bias=get(p + "mlp.fc2.bias"),
            window=0,
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
            attn = self._attention(layer, x, positions, meta, k_cache, v_cache) + layer.o_bias
            mlp = layer.down(self.act(layer.gate_up(x))) + layer.down_bias
            return attn + mlp + hidden

        return self._run_stream(input_ids, positions, kv_caches, block,  # type: ignore[return-value]
                                lambda h: self._ln(h, *self.norm))


__all__ = ["PhiModel"]
