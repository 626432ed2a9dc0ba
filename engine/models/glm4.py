"""GLM-4 (``Glm4ForCausalLM``: GLM-4-9B-0414, GLM-4-32B-0414 and the GLM-Z1 reasoning
models): the Llama layer with q/k/v biases, two more norms and RoPE on interleaved pairs
of half of each head.

What differs from the generic decoder (:class:`~engine.models.layers.decoder.Decoder`), each
as transformers computes it:

* the layer norms each block's output before it joins the residual stream
  (``post_self_attn_layernorm``, ``post_mlp_layernorm``), besides the usual norms before
  attention (``input_layernorm``) and before the MLP (``post_attention_layernorm``); all
  four are Llama's RMSNorm (``x / rms(x)`` rounded to the dtype, times the weight);
* gate and up are one stored projection (``mlp.gate_up_proj``, gate rows first);
* RoPE turns interleaved pairs of each head's first ``partial_rotary_factor`` (0.5) of
  values: q's and k's rows and biases are laid out for the op sets' rotate-half RoPE at
  build time (:class:`~engine.models.layers.rope.PairsToHalves`, as ERNIE 4.5's).

Tensor parallelism and pipeline stages cut it as the Llama layer. The fused CPU decode
step does not run it (its norms after the blocks round as Llama's, which the fused step's
Gemma mode does not), nor do LoRA adapters or GGUF files serve it.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.models.config import ModelConfig
from engine.models.layers.decoder import Decoder, DecoderLayer, decoder_weight_names
from engine.models.layers.rope import PairsToHalves
from engine.models.layers.shard import ShardedWeights
from engine.ops import AttentionMetadata, Ops
from engine.parallel import SINGLE, TensorParallel

GLM4_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "post_self_attn_layernorm", "post_mlp_layernorm")


@dataclasses.dataclass(slots=True)
class Glm4Layer(DecoderLayer):
    # input_norm: before attention; post_norm: before the MLP (post_attention_layernorm).
    attn_out_norm: torch.Tensor  # post_self_attn_layernorm: attention's output
    mlp_out_norm: torch.Tensor  # post_mlp_layernorm: the MLP's output


class Glm4Model(Decoder):
    """GLM-4's decoder stack plus LM head over Hugging Face weights."""

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        names = decoder_weight_names(config, GLM4_LAYER_NORMS)
        fused = []
        for name in names:  # gate and up stored as one projection
            if name.endswith("mlp.gate_proj.weight"):
                fused.append(name.replace("gate_proj", "gate_up_proj"))
            elif not name.endswith("mlp.up_proj.weight"):
                fused.append(name)
        return fused

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
        super().__init__(config, PairsToHalves(weights, config.head_dim, config.rotary_dim), ops,  # type: ignore[arg-type]
                         dtype=dtype, device=device, tp=tp)

    def _layer(self, get: ShardedWeights, i: int) -> Glm4Layer:  # type: ignore[override]
        p = f"model.layers.{i}."
        base = super()._layer(get, i)  # gate_up from gate_up_proj: the decoder reads GLM-4's so
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(DecoderLayer)}
        return Glm4Layer(**fields, attn_out_norm=get(p + "post_self_attn_layernorm.weight"),
                         mlp_out_norm=get(p + "post_mlp_layernorm.weight"))

    def plan_fused_step(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """None: the fused CPU step does not run GLM-4's layer (see the module docstring)."""
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
        ops, eps = self.ops, self.eps

        def block(layer: Glm4Layer, hidden: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
            x = self._attention(layer, ops.rms_norm(hidden, layer.input_norm, eps), positions, meta, k_cache, v_cache)
            hidden = hidden + ops.rms_norm(x, layer.attn_out_norm, eps)
            x = layer.down(ops.silu_and_mul(layer.gate_up(ops.rms_norm(hidden, layer.post_norm, eps))))
            return hidden + ops.rms_norm(x, layer.mlp_out_norm, eps)

        return self._run_stream(input_ids, positions, kv_caches, block,  # type: ignore[return-value]
                                lambda h: ops.rms_norm(h, self.norm, eps), mm_embeds=mm_embeds)


__all__ = ["GLM4_LAYER_NORMS", "Glm4Layer", "Glm4Model"]
