"""ERNIE 4.5 (``Ernie4_5ForCausalLM``: ERNIE-4.5-0.3B; ``Ernie4_5_MoeForCausalLM``: its MoE
models, whose sparse MLPs are engine.models.layers.moe's): the Llama layer with RoPE on
interleaved pairs.

ERNIE rotates each head's pairs ``(x0, x1), (x2, x3), ...`` (GPT-J's layout), the Llama
layer the halves. A query's and a key's values meet only in their dot product, which does
not depend on the order of a head's values: so q_proj's and k_proj's rows are reordered
once at build time, each head's even rows then its odd ones, and the decoder's rotate-half
RoPE (and the fused CPU step) turns the same pairs by the same angles. v and o are left
as they are. Biases on the projections (``use_bias``) are refused at load, as the
decoder's o_proj and MLP carry none.
"""

from __future__ import annotations

import torch

from engine.models.config import ModelConfig
from engine.models.layers.decoder import Decoder
from engine.models.layers.rope import PairsToHalves
from engine.ops import Ops
from engine.parallel import SINGLE, TensorParallel


class ErnieModel(Decoder):
    """ERNIE 4.5's decoder stack plus LM head over Hugging Face weights."""

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
        super().__init__(config, PairsToHalves(weights, config.head_dim), ops,  # type: ignore[arg-type]
                         dtype=dtype, device=device, tp=tp)


__all__ = ["ErnieModel"]
