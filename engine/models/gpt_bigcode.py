"""GPTBigCode (``GPTBigCodeForCausalLM``: StarCoder, StarCoderBase, SantaCoder,
WizardCoder): GPT-2's learned-position LayerNorm decoder
(:mod:`engine.models.layers.absolute`) with one KV head for all the query heads
(``multi_query``, the checkpoints' setting) and ``nn.Linear`` weights, ``[out, in]`` as
stored.

With ``multi_query``, ``c_attn``'s rows are q (``hidden``), then the one head's k and v,
the fused q/k/v layout the decoder cuts by rows; the KV head is copied to every
tensor-parallel rank. Without it each head's q, k and v rows are stored together
(``[heads, 3, head_dim]``); they are regrouped at load into q's, then k's, then v's.
"""

from __future__ import annotations

from collections.abc import Mapping

from engine.models.layers.absolute import AbsoluteDecoder, AbsoluteNames, HeadsRegrouped

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


class GPTBigCodeModel(AbsoluteDecoder):
    """GPTBigCode's decoder stack plus its tied LM head."""

    NAMES = _NAMES

    def _stored(self, weights: Mapping) -> Mapping:
        c = self.config
        if c.num_key_value_heads == 1 and c.num_attention_heads > 1:  # multi_query: as stored
            return weights
        return HeadsRegrouped(weights, c.num_attention_heads, (".attn.c_attn.weight", ".attn.c_attn.bias"))


__all__ = ["GPTBigCodeModel"]
