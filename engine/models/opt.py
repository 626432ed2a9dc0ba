"""OPT (``OPTForCausalLM``): the learned-position LayerNorm decoder of
:mod:`engine.models.layers.absolute`, under OPT's tensor names.

OPT's position table starts 2 rows in; OPT-350m normalises after each residual add
(``do_layer_norm_before`` false, no final norm) and embeds in 512 dimensions, projected to
and from its hidden size of 1024 (``project_in`` / ``project_out``): both are supported
(``ModelConfig.absolute``). Checkpoints saved by transformers name the stack
``model.decoder.*``; older ones ``decoder.*``, and both load.
"""

from __future__ import annotations

from engine.models.layers.absolute import AbsoluteDecoder, AbsoluteNames


class OPTModel(AbsoluteDecoder):
    """OPT's decoder stack plus its (tied) LM head."""

    NAMES = AbsoluteNames(
        embed="model.decoder.embed_tokens",
        positions="model.decoder.embed_positions",
        layer="model.decoder.layers.{i}.",
        attn_norm="self_attn_layer_norm",
        qkv=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        o="self_attn.out_proj",
        mlp_norm="final_layer_norm",
        fc1="fc1",
        fc2="fc2",
        final_norm="model.decoder.final_layer_norm",
        project_in="model.decoder.project_in",
        project_out="model.decoder.project_out",
    )

    @staticmethod
    def checkpoint_name(name: str) -> str:
        return "model." + name if name.startswith("decoder.") else name


__all__ = ["OPTModel"]
