"""GPT-2's and OPT's ``config.json``, read into :class:`~engine.models.config.ModelConfig`'s
fields (``ModelConfig.from_hf`` builds the config from :func:`absolute_fields`).

Both families have learned absolute positions, LayerNorm (with bias) and a plain
two-matmul MLP (models/layers/absolute.py); their config.json names its fields its own way
(GPT-2: ``n_embd``, ``n_head``, ``n_layer``, ``n_inner``, ``n_positions``; OPT:
``ffn_dim``, ``do_layer_norm_before``, ``word_embed_proj_dim``). What the layer does not
compute is refused, naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.errors import CorruptModelError, UnsupportedModelError
from engine.models.audio_config import AudioConfig

# Hugging Face architecture -> family.
ABSOLUTE_ARCHITECTURES = {
    "GPT2LMHeadModel": "gpt2",
    "OPTForCausalLM": "opt",
    # GPT-2's layer with one KV head (multi_query) and nn.Linear weights: StarCoder,
    # SantaCoder, WizardCoder (models/gpt_bigcode.py).
    "GPTBigCodeForCausalLM": "gpt_bigcode",
    # The decoder of Whisper's encoder-decoder (models/whisper.py): GPT-2's layer with a
    # cross-attention to the audio encoder's states between attention and MLP.
    "WhisperForConditionalGeneration": "whisper",
}

# activation_function values -> the MLP's activation. gelu_new (GPT-2's) is the tanh
# approximation of GELU, the formula torch's approximate="tanh" computes.
_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                "gelu": "gelu", "relu": "relu"}

# GPT-2's training-stability switches (scores scaled by 1 / (layer index + 1); attention
# in fp32 with the scale applied before the matmul) and its use as a cross-attending
# decoder: not implemented.
_GPT2_REFUSED = ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention")
# OPT variants without biases or without LayerNorm weights: no checkpoint on the Hub has them.
_OPT_REQUIRED = ("enable_bias", "layer_norm_elementwise_affine")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AbsoluteConfig:
    """What a learned-absolute-position decoder (GPT-2, OPT) sets apart from the rest of
    ``ModelConfig`` (see models/layers/absolute.py)."""

    # OPT's position table starts 2 rows in (transformers' OPTLearnedPositionalEmbedding
    # adds 2 to every position id); GPT-2's at row 0.
    position_offset: int
    # LayerNorm before attention and the MLP (GPT-2, most OPTs), or after each residual
    # add (OPT-350m: do_layer_norm_before false).
    pre_norm: bool
    final_norm: bool  # a LayerNorm after the last layer (OPT-350m has none)
    # OPT's word_embed_proj_dim: the embedding's width, projected to and from hidden_size
    # (project_in / project_out) where it differs; hidden_size elsewhere.
    embed_dim: int
    # GPT-2's scale_attn_weights: scores divided by sqrt(head_dim) (else unscaled).
    scale_attention: bool = True


def absolute_fields(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """``ModelConfig``'s fields for a GPT-2, GPTBigCode or OPT ``config.json`` (RoPE fields
    neutral)."""
    if arch == "whisper":
        return _whisper_fields(raw)
    gpt2 = arch in ("gpt2", "gpt_bigcode")  # GPTBigCode names its fields as GPT-2
    for key in _GPT2_REFUSED if gpt2 else ():
        if raw.get(key):
            raise UnsupportedModelError(f"{arch}: {key} true is not supported")
    for key in () if gpt2 else _OPT_REQUIRED:
        if not raw.get(key, True):
            raise UnsupportedModelError(f"{arch}: {key} false is not supported")
    act = raw.get("activation_function", "gelu_new" if gpt2 else "relu")
    if act not in _ACTIVATIONS:
        raise UnsupportedModelError(
            f"{arch}: activation_function {act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
    try:
        if gpt2:
            hidden, heads, layers = int(raw["n_embd"]), int(raw["n_head"]), int(raw["n_layer"])
            inter = int(raw.get("n_inner") or 4 * hidden)  # transformers' default: 4 x n_embd
            positions = int(raw.get("n_positions", 1024))
            eps = float(raw.get("layer_norm_epsilon", 1e-5))
            pre_norm, final_norm, embed_dim, offset = True, True, hidden, 0
        else:
            hidden, heads, layers = int(raw["hidden_size"]), int(raw["num_attention_heads"]), int(raw["num_hidden_layers"])
            inter = int(raw["ffn_dim"])
            positions = int(raw.get("max_position_embeddings", 2048))
            eps = 1e-5  # OPT's LayerNorms take torch's default eps (the config has no field)
            pre_norm = bool(raw.get("do_layer_norm_before", True))
            final_norm = pre_norm and not raw.get("_remove_final_layer_norm", False)
            embed_dim = int(raw.get("word_embed_proj_dim") or hidden)
            offset = 2
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return dict(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            # GPTBigCode's multi_query (its default): one KV head for all the query heads
            num_key_value_heads=1 if arch == "gpt_bigcode" and raw.get("multi_query", True) else heads,
            head_dim=hidden // heads,
            rms_norm_eps=eps,  # the LayerNorms' eps here
            rope_theta=0.0,
            rope_scaling=None,
            max_position_embeddings=positions,
            # transformers ties both heads to the embedding unless config.json says otherwise.
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            attention_bias=True,
            qk_norm=False,
            sliding_window=None,
            layer_windows=(0,) * layers,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            activation=_ACTIVATIONS[act],
            absolute=AbsoluteConfig(
                position_offset=offset, pre_norm=pre_norm, final_norm=final_norm, embed_dim=embed_dim,
                scale_attention=bool(raw.get("scale_attn_weights", True)),
            ),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptModelError(f"config.json is missing or has a bad field: {exc}") from exc


def _whisper_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Whisper's decoder as GPT-2's fields (pre-norm, a final norm, positions from row 0),
    its encoder as an :class:`AudioConfig` in ``vision`` (the media encoder's slot)."""
    if raw.get("scale_embedding"):
        raise UnsupportedModelError("whisper: scale_embedding true is not supported")
    act = raw.get("activation_function", "gelu")
    if act != "gelu":
        raise UnsupportedModelError(f"whisper: activation_function {act!r} is not supported")
    try:
        hidden, heads = int(raw["d_model"]), int(raw["decoder_attention_heads"])
        layers = int(raw["decoder_layers"])
        encoder = AudioConfig(
            num_mel_bins=int(raw.get("num_mel_bins", 80)), d_model=hidden,
            encoder_layers=int(raw["encoder_layers"]),
            encoder_attention_heads=int(raw["encoder_attention_heads"]),
            encoder_ffn_dim=int(raw["encoder_ffn_dim"]),
            max_source_positions=int(raw.get("max_source_positions", 1500)),
            activation_function=act, audio_token_id=-1, kind="whisper")
        eos = raw.get("eos_token_id", 50256)
        return dict(
            architecture="whisper", vocab_size=int(raw["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(raw["decoder_ffn_dim"]), num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
            rms_norm_eps=1e-5, rope_theta=0.0, rope_scaling=None,
            max_position_embeddings=int(raw.get("max_target_positions", 448)),
            tie_word_embeddings=True, attention_bias=True, qk_norm=False, sliding_window=None,
            layer_windows=(0,) * layers, bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in (eos if isinstance(eos, list) else [eos])),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"), activation="gelu",
            absolute=AbsoluteConfig(position_offset=0, pre_norm=True, final_norm=True,
                                    embed_dim=hidden),
            vision=encoder,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptModelError(f"config.json is missing or has a bad whisper field: {exc}") from exc


__all__ = ["ABSOLUTE_ARCHITECTURES", "AbsoluteConfig", "absolute_fields"]
