"""The model's shape, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.errors import CorruptModelError, UnsupportedModelError

# Architectures whose decoder layer is the Llama layer with small variations: Qwen2 adds
# q/k/v biases, Qwen3 adds per-head RMSNorm on q and k, Mistral adds a sliding window.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES' values
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int  # capped at sliding_window, which attention does not apply
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None  # as written in config.json, e.g. "bfloat16"

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a parsed ``config.json``; raises a typed error naming the problem."""
        archs = raw.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; supported: "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
            max_positions = int(raw.get("max_position_embeddings", 2048))
            if window and int(window) < max_positions:
                # The decoder attends to the whole context: it equals a sliding-window
                # model (Mistral 7B v0.1: window 4096, 32k positions) only while the
                # context fits the window. Cap the context there, so a longer prompt is
                # refused (PromptTooLongError) instead of silently decoded wrong.
                max_positions = int(window)
            rope_scaling = raw.get("rope_scaling") or None
            rope_theta = raw.get("rope_theta")
            if rope_theta is None and isinstance(raw.get("rope_parameters"), dict):
                # transformers v5 moved theta (and scaling) under rope_parameters.
                params = raw["rope_parameters"]
                rope_theta = params.get("rope_theta")
                if params.get("rope_type", "default") != "default":
                    rope_scaling = dict(params)
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
                rope_scaling=rope_scaling,
                max_position_embeddings=max_positions,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", arch == "qwen2")),
                qk_norm=arch == "qwen3",
                sliding_window=int(window) if window else None,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptModelError(f"config.json is missing or has a bad field: {exc}") from exc
