"""Cohere's Command R (``CohereForCausalLM``) and Command R7B / Command A
(``Cohere2ForCausalLM``): attention and the MLP side by side on one LayerNorm.

What differs from the generic decoder (:class:`~engine.models.layers.decoder.Decoder`), each
as transformers computes it:

* one norm a layer, a LayerNorm without bias (``x - mean``, over its standard deviation,
  times the weight, in fp32, rounded once); attention and the MLP both read its output,
  and both outputs join the residual stream: ``x + attn(ln(x)) + mlp(ln(x))``;
* RoPE on interleaved pairs of each head (q's and k's rows laid out for the op sets'
  rotate-half RoPE at build time: :class:`~engine.models.layers.rope.PairsToHalves`);
* logits times ``logit_scale`` (in the model dtype);
* Cohere2: sliding layers (``layer_types``, three in four by default) with RoPE, and
  global layers without it (``ModelConfig.nope_layers``).

q/k norms (``use_qk_norm``, Command R+) and attention biases are refused at load. Tensor
parallelism and pipeline stages cut it as the Llama layer (both of a layer's row-parallel
outputs, o and down, are whole before they are added). The fused CPU decode step does not
run this layer, nor do LoRA adapters or GGUF files serve it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.config import ModelConfig
from engine.models.layers.decoder import Decoder, DecoderLayer, decoder_weight_names
from engine.models.layers.rope import PairsToHalves
from engine.models.layers.shard import ShardedWeights
from engine.ops import AttentionMetadata, Ops
from engine.parallel import SINGLE, TensorParallel


class CohereModel(Decoder):
    """Command R's (and Cohere2's) decoder stack plus tied LM head over Hugging Face weights."""

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        return decoder_weight_names(config, ("input_layernorm",))

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
        weights = PairsToHalves(weights, config.head_dim)  # type: ignore[assignment]
        get = ShardedWeights(weights, dtype, self.device, tp)
        self._build_ends(get, weights, lambda: self._norm_weight(weights, "model.norm.weight"))
        self.layers = [self._layer(get, i) for i in tp.stage.layer_range(config.num_hidden_layers)]

    def _norm_weight(self, weights, name: str) -> torch.Tensor:
        """A LayerNorm's weight in fp32: transformers multiplies by it in fp32."""
        return ShardedWeights(weights, torch.float32, self.device)(name).contiguous()

    def _layer(self, get: ShardedWeights, i: int) -> DecoderLayer:  # type: ignore[override]
        return DecoderLayer(
            input_norm=self._norm_weight(get.weights, f"model.layers.{i}.input_layernorm.weight"),
            post_norm=None,  # type: ignore[arg-type]  # one norm a layer
            q_norm=None,
            k_norm=None,
            **self._plain_layer_parts(get, i) | ({"rope": None} if i in self.config.nope_layers else {}),
        )

    def _layer_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), weight.shape, weight, None, self.eps).to(x.dtype)

    def plan_fused_step(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """None: the fused CPU step does not run Cohere's layer (LayerNorm, parallel blocks)."""
        return None

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

        def block(layer: DecoderLayer, hidden: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
            x = self._layer_norm(hidden, layer.input_norm)
            attn = self._attention(layer, x, positions, meta, k_cache, v_cache)
            return hidden + attn + layer.down(ops.silu_and_mul(layer.gate_up(x)))

        return self._run_stream(input_ids, positions, kv_caches, block,  # type: ignore[return-value]
                                lambda h: self._layer_norm(h, self.norm), mm_embeds=mm_embeds)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in fp32: the head's, times ``logit_scale`` in the model dtype."""
        return (self._logits(hidden) * self.config.logit_scale).float()


__all__ = ["CohereModel"]
