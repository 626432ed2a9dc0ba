"""Qwen2-Audio's audio tower as its ``config.json`` gives it (``audio_config``), read into
``ModelConfig.vision``, the slot of a model's media encoder (models/qwen2_audio.py builds
it); the language model is the ``text_config``'s Qwen2 decoder."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.errors import CorruptModelError, UnsupportedModelError

QWEN2_AUDIO = "Qwen2AudioForConditionalGeneration"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AudioConfig:
    """Whisper's encoder as Qwen2-Audio uses it: two convolutions over the log-mel frames
    (the second halving them), learned positions, pre-norm layers, pairs of positions
    averaged, a final LayerNorm, then one linear projector into the decoder."""

    num_mel_bins: int
    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    max_source_positions: int  # positions after the stride-2 convolution
    activation_function: str
    audio_token_id: int  # the placeholder token each audio's embeddings replace
    kind: str = "qwen2_audio"

    @property
    def max_frames(self) -> int:
        """Log-mel frames of the longest clip (Whisper's 30 s window: 3,000)."""
        return 2 * self.max_source_positions


def qwen2_audio_text(raw: dict[str, Any]) -> dict[str, Any]:
    """The ``text_config`` with Qwen2's defaults under it, as transformers fills it (a
    released Qwen2-Audio config gives only the fields that differ from them)."""
    from transformers import Qwen2Config  # the defaults of a config; loaded on use

    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise CorruptModelError(f"{QWEN2_AUDIO}: config.json has no text_config")
    if text.get("model_type", "qwen2") != "qwen2":
        raise UnsupportedModelError(f"{QWEN2_AUDIO} with a {text['model_type']!r} language "
                                    "model is not supported ('qwen2' is)")
    base = Qwen2Config().to_dict()
    keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps",
            "vocab_size")
    return {**{k: base[k] for k in keep if base.get(k) is not None}, **text}


def qwen2_audio_config(raw: dict[str, Any], vocab_size: int) -> AudioConfig:
    """The audio tower's config; ``vocab_size`` is the language model's."""
    audio = raw.get("audio_config")
    if not isinstance(audio, dict):
        raise CorruptModelError(f"{QWEN2_AUDIO}: config.json has no audio_config")
    try:
        config = AudioConfig(
            num_mel_bins=int(audio.get("num_mel_bins", 128)),
            d_model=int(audio.get("d_model", 1280)),
            encoder_layers=int(audio.get("encoder_layers", 32)),
            encoder_attention_heads=int(audio.get("encoder_attention_heads", 20)),
            encoder_ffn_dim=int(audio.get("encoder_ffn_dim", 5120)),
            max_source_positions=int(audio.get("max_source_positions", 1500)),
            activation_function=str(audio.get("activation_function", "gelu")),
            audio_token_id=int(raw.get("audio_token_index", raw.get("audio_token_id", 151646))),
        )
    except (TypeError, ValueError) as exc:
        raise CorruptModelError(f"config.json has a bad {QWEN2_AUDIO} audio_config field: {exc}") from exc
    if config.activation_function not in ("gelu", "relu", "silu"):
        raise UnsupportedModelError(
            f"Qwen2-Audio activation {config.activation_function!r} is not supported")
    if config.d_model % config.encoder_attention_heads:
        raise CorruptModelError(f"Qwen2-Audio: d_model {config.d_model} does not divide over "
                                f"{config.encoder_attention_heads} heads")
    if not 0 <= config.audio_token_id < vocab_size:
        raise UnsupportedModelError(f"Qwen2-Audio: the audio token ({config.audio_token_id}) is "
                                    f"outside the language model's vocabulary ({vocab_size})")
    return config


__all__ = ["QWEN2_AUDIO", "AudioConfig", "qwen2_audio_config", "qwen2_audio_text"]
