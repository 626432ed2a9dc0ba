"""GPT-2 (``GPT2LMHeadModel``): the learned-position LayerNorm decoder of
:mod:`engine.models.layers.absolute`, under GPT-2's tensor names.

GPT-2 stores its projections as ``Conv1D`` weights, ``[in, out]`` (the transpose of
``nn.Linear``'s), with q/k/v fused in ``c_attn``; they are read transposed, and ``c_attn``
is cut into q, k and v by rows. Checkpoints saved by transformers name the stack
``transformer.*``; the original ones (the Hub's ``gpt2``) have no prefix, and both load.
"""

from __future__ import annotations

from collections.abc import Mapping

from engine.models.layers.absolute import AbsoluteDecoder, AbsoluteNames, transposed

_NAMES = AbsoluteNames(
    embed="transformer.wte",
    positions="transformer.wpe",
    layer="transformer.h.{i}.",
    attn_norm="ln_1",
    qkv=("attn.c_attn",),
    o="attn.c_proj",
    mlp_norm="ln_2",
    fc1="mlp.c_fc",
    fc2="mlp.c_proj",
    final_norm="transformer.ln_f",
)

# The Conv1D weights (stored [in, out]), by their name's ending.
_CONV1D = tuple(f".{n}.weight" for n in (_NAMES.qkv[0], _NAMES.o, _NAMES.fc1, _NAMES.fc2))


class GPT2Model(AbsoluteDecoder):
    """GPT-2's decoder stack plus its tied LM head."""

    NAMES = _NAMES

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """The Hub's original checkpoints name ``h.0.attn...``, ``wte.weight``: no prefix."""
        return name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name

    def _stored(self, weights: Mapping) -> Mapping:
        return {name: transposed(w) if name.endswith(_CONV1D) else w for name, w in weights.items()}


__all__ = ["GPT2Model"]
