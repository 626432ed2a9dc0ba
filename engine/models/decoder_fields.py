"""Per-family fields of a decoder's ``config.json`` that ``ModelConfig.from_hf``
(engine.models.config) reads beside the common ones: which biases a family would need
beyond q/k/v (refused: the decoder has no place for them), Phi-4-mini's partial rotary,
SmolLM3's layers without RoPE, Granite's multipliers."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.errors import UnsupportedModelError

GEMMA_FAMILY = frozenset({"gemma", "gemma2", "gemma3"})

# Families whose attention_bias puts a bias on o_proj too (transformers' classes), which the
# decoder does not add: such a checkpoint is refused rather than run without it. (Qwen2's
# attention_bias is its q/k/v biases alone.)
_O_PROJ_BIAS_FAMILIES = frozenset({"llama", "qwen3", "qwen3_moe", "smollm3", "granite", "granite_moe",
                                   "granite_hybrid", "olmo2", "olmo3", "cohere", "cohere2",
                                   *GEMMA_FAMILY})
# Families whose mlp_bias puts biases on gate/up/down (the others ignore the key).
_MLP_BIAS_FAMILIES = frozenset({"llama", "smollm3", "granite"})


# Families whose attention rotates only the first partial_rotary_factor of each head
# (transformers' Phi-3 slices q and k so); the others refuse a factor below 1.
_PARTIAL_ROTARY_FAMILIES = frozenset({"phi3", "glm4_moe", "glm4", "gpt_neox", "phi", "qwen3_5", "qwen3_5_moe", "qwen3_next"})
# Families whose config means a partial rotary when it names none (transformers' default).
_DEFAULT_ROTARY_FACTOR = {"glm4_moe": 0.5, "glm4": 0.5, "phi": 0.5, "qwen3_5": 0.25, "qwen3_5_moe": 0.25,
                          "qwen3_next": 0.25}


def rotary_dim(raw: dict[str, Any], arch: str, head_dim: int) -> int:
    """The rotated share of each head (``ModelConfig.rotary_dim``, 0 for all of it), from
    ``partial_rotary_factor`` wherever the config keeps it (top level, rope_scaling, or
    transformers 5's rope_parameters), as ``int(head_dim * factor)``."""
    factor = _DEFAULT_ROTARY_FACTOR.get(arch, 1.0)
    for where in (raw.get("rope_scaling"), raw.get("rope_parameters"), raw):
        if isinstance(where, dict) and where.get("partial_rotary_factor") is not None:
            factor = float(where["partial_rotary_factor"])
            break
    if factor == 1.0:
        return 0
    if arch not in _PARTIAL_ROTARY_FAMILIES:
        raise UnsupportedModelError(
            f"partial_rotary_factor below 1 (partial RoPE) is not supported for {arch}; it is for "
            f"{', '.join(sorted(_PARTIAL_ROTARY_FAMILIES))}")
    dim = int(head_dim * factor)
    if not 0 < dim <= head_dim or dim % 2:
        raise ValueError(f"partial_rotary_factor {factor} gives {dim} rotated values of a {head_dim}-wide head")
    return dim


def granite_multipliers(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """Granite's four multipliers (transformers' GraniteConfig defaults: 1 each); Cohere's
    logit_scale (its configs' default 0.0625) and LayerNorm eps (1e-5); StarCoder2's
    LayerNorm eps (``norm_epsilon``); GPT-NeoX's and its ``use_parallel_residual``; Phi's."""
    if arch == "gpt_neox":
        if not raw.get("attention_bias", True):
            raise UnsupportedModelError("attention_bias false on GPT-NeoX (q/k/v and o without biases) is not supported")
        return {"rms_norm_eps": float(raw.get("layer_norm_eps", 1e-5)),
                "parallel_residual": bool(raw.get("use_parallel_residual", True))}
    if arch == "phi":
        if raw.get("qk_layernorm"):
            raise UnsupportedModelError("qk_layernorm (a LayerNorm on q and k) on Phi is not supported")
        return {"rms_norm_eps": float(raw.get("layer_norm_eps", 1e-5))}
    if arch == "starcoder2":
        if not raw.get("use_bias", True):
            raise UnsupportedModelError("use_bias false on StarCoder2 (projections without biases) is not supported")
        return {"rms_norm_eps": float(raw.get("norm_epsilon", 1e-5))}
    if arch in ("cohere", "cohere2"):
        if raw.get("use_qk_norm"):
            raise UnsupportedModelError(f"use_qk_norm (a LayerNorm on each head of q and k) on {arch} is not supported")
        return {"logit_scale": float(raw.get("logit_scale", 0.0625)),
                "rms_norm_eps": float(raw.get("layer_norm_eps", 1e-5))}
    if arch == "falcon_h1":  # its other multipliers: ModelConfig.falcon_h1
        return {"embedding_multiplier": float(raw.get("embedding_multiplier", 1.0))}
    if arch not in ("granite", "granite_moe", "granite_hybrid"):
        return {}
    return {
        "embedding_multiplier": float(raw.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(raw.get("residual_multiplier", 1.0)),
        "logits_scaling": float(raw.get("logits_scaling", 1.0)),
        "attention_multiplier": float(raw.get("attention_multiplier", 1.0)),
    }


def check_biases(raw: dict[str, Any], arch: str, attention_bias: bool) -> None:
    """Refuse the biases the decoder would leave out (fail closed): the MLP's (Llama's
    ``mlp_bias``) and o_proj's (``attention_bias`` in the families that put one there)."""
    if raw.get("clip_qkv") is not None and arch == "olmoe":
        raise UnsupportedModelError("clip_qkv (q, k and v clamped) on OLMoE is not supported")
    if raw.get("use_bias") and arch in ("ernie4_5", "ernie4_5_moe"):  # ERNIE's: every projection biased
        raise UnsupportedModelError("use_bias (biases on every projection of ERNIE 4.5) is not supported")
    if raw.get("mlp_bias") and arch in _MLP_BIAS_FAMILIES:
        raise UnsupportedModelError("mlp_bias (biases on gate_proj, up_proj and down_proj) is not supported")
    if attention_bias and arch in _O_PROJ_BIAS_FAMILIES:
        raise UnsupportedModelError(
            f"attention_bias on a {arch} model (a bias on o_proj as well as q/k/v) is not supported")


def gpt_neox_raw(raw: dict[str, Any]) -> dict[str, Any]:
    """A GPT-NeoX (``GPTNeoXForCausalLM``) config.json under the decoder's keys: the Hub's
    older files name the rotated share ``rotary_pct`` (default 0.25) and the base
    ``rotary_emb_base``; q/k/v and o carry biases unless ``attention_bias`` says not."""
    out = dict(raw)
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    if "partial_rotary_factor" not in params and "partial_rotary_factor" not in raw:
        out["partial_rotary_factor"] = float(raw.get("rotary_pct", 0.25))
    if "rope_theta" not in params and "rope_theta" not in raw:
        out["rope_theta"] = float(raw.get("rotary_emb_base", 10000.0))
    out.setdefault("attention_bias", True)
    return out


def granite_hybrid_raw(raw: dict[str, Any]) -> dict[str, Any]:
    """A Granite 4 (``GraniteMoeHybridForCausalLM``) config.json as the decoder reads it: its
    dense MLP's width (``shared_intermediate_size``) as ``intermediate_size``, and the routed
    experts' (the MoE models': granite-4.0-h-tiny, -h-small) as ``expert_intermediate_size``.
    Its Mamba layers are read by engine.models.mamba_config."""
    return dict(raw, intermediate_size=int(raw.get("shared_intermediate_size", 1024)),
                expert_intermediate_size=int(raw.get("intermediate_size", 0)))


def nope_layers(raw: dict[str, Any], arch: str, layers: int) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: config.json's ``no_rope_layers`` (1: RoPE, 0: none),
    else every ``no_rope_layer_interval``-th (transformers' default 4). Granite 4's, all of
    them unless its ``position_embedding_type`` is "rope"."""
    if arch == "granite_hybrid":
        return () if raw.get("position_embedding_type") == "rope" else tuple(range(layers))
    if arch in ("nemotron_h", "jamba"):  # their attention layers take no positions
        return tuple(range(layers))
    if arch != "smollm3":
        return ()
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = int(raw.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers:
        raise ValueError(f"no_rope_layers lists {len(flags)} layers, the model has {layers}")
    return tuple(i for i, rope in enumerate(flags) if not rope)


def bidirectional_window(raw: dict[str, Any], arch: str, window: int) -> tuple[bool, int]:
    """``(bidirectional, window)``: Gemma 3's ``use_bidirectional_attention`` (EmbeddingGemma:
    every token sees every other, the sliding layers those fewer than the window positions
    away either side). transformers then narrows the window it reads to ``window // 2 + 1``
    (``Gemma3TextConfig``, and its config.json keeps the wide one); other families do not
    take the flag and are refused with it."""
    if not raw.get("use_bidirectional_attention"):
        return False, window
    if arch != "gemma3":
        raise UnsupportedModelError(f"use_bidirectional_attention is not supported for {arch}")
    return True, window // 2 + 1 if window else 0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MlaConfig:
    """DeepSeek-V3's multi-head latent attention (``ModelConfig.mla``): q through a rank
    ``q_lora_rank`` bottleneck (0: one q_proj), k and v through a shared ``kv_lora_rank``
    latent and ``kv_b_proj``, each head's key ``qk_nope_head_dim`` values from the latent
    and ``qk_rope_head_dim`` rotated ones shared by every head, its value
    ``v_head_dim`` wide (engine.models.deepseek)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


def mla_fields(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """DeepSeek-V3's attention shape as ``ModelConfig`` fields, as the paged cache holds it:
    one KV head (the latent, every query head's) of ``qk_rope + kv_lora_rank`` values, the
    rotated key part first (RoPE turns the first ``qk_rope`` values); each query head is
    laid out the same way once ``kv_b_proj``'s key half is folded into it
    (engine.models.deepseek). {} for other architectures."""
    if arch not in ("deepseek_v3", "deepseek_v2"):
        return {}
    if raw.get("rope_interleave", True) is not True:
        raise UnsupportedModelError(f"{arch} with rope_interleave false is not supported")
    mla = MlaConfig(q_lora_rank=int(raw.get("q_lora_rank") or 0), kv_lora_rank=int(raw["kv_lora_rank"]),
                    qk_nope_head_dim=int(raw["qk_nope_head_dim"]), qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
                    v_head_dim=int(raw["v_head_dim"]))
    if raw.get("attention_bias"):
        raise UnsupportedModelError(f"{arch} with attention_bias is not supported")
    return {"mla": mla, "head_dim": mla.qk_rope_head_dim + mla.kv_lora_rank, "num_key_value_heads": 1,
            "rotary_dim": mla.qk_rope_head_dim}
