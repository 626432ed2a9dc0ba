"""Whisper's audio encoder, which Qwen2-Audio's tower is too: two convolutions over a
clip's log-mel frames (the second halving them), learned (or sinusoidal, stored) positions,
pre-norm layers whose attention has no key bias. Each family adds what reads its states
(Whisper: a LayerNorm and the decoder's cross-attention; Qwen2-Audio: pairs averaged, a
LayerNorm and a projector)."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from engine.models.audio_config import AudioConfig


@dataclasses.dataclass(slots=True)
class EncoderLayer:
    ln1: tuple[torch.Tensor, torch.Tensor]
    qkv_w: torch.Tensor  # q, k, v stacked: [3 * d, d]
    qkv_b: torch.Tensor  # k has no bias: zeros in its third
    out: tuple[torch.Tensor, torch.Tensor]
    ln2: tuple[torch.Tensor, torch.Tensor]
    fc1: tuple[torch.Tensor, torch.Tensor]
    fc2: tuple[torch.Tensor, torch.Tensor]


def audio_act(name: str, x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x) if name == "gelu" else F.relu(x) if name == "relu" else F.silu(x)


def encoder_weight_names(audio: AudioConfig, prefix: str) -> list[str]:
    """The encoder's tensors under ``prefix`` (its final LayerNorm included)."""
    names = [prefix + n for n in ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
                                  "embed_positions.weight", "layer_norm.weight", "layer_norm.bias")]
    for i in range(audio.encoder_layers):
        p = f"{prefix}layers.{i}."
        names.append(p + "self_attn.k_proj.weight")
        for part in ("self_attn.q_proj", "self_attn.v_proj", "self_attn.out_proj",
                     "self_attn_layer_norm", "final_layer_norm", "fc1", "fc2"):
            names += [p + part + ".weight", p + part + ".bias"]
    return names


class AudioEncoder:
    """Log-mel frames ``[mel, frames]`` -> the states after the last layer, ``[n, d]`` for
    the first ``n`` positions (a mask that hides the rest as keys gives these states)."""

    def __init__(self, cfg: AudioConfig, get, prefix: str) -> None:
        self.cfg = cfg

        def wb(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            return get(prefix + name + ".weight"), get(prefix + name + ".bias")

        self.conv1, self.conv2 = wb("conv1"), wb("conv2")
        self.positions = get(prefix + "embed_positions.weight")
        self.norm = wb("layer_norm")
        self.layers = []
        for i in range(cfg.encoder_layers):
            p = f"layers.{i}."
            q, v = wb(p + "self_attn.q_proj"), wb(p + "self_attn.v_proj")
            k = get(prefix + p + "self_attn.k_proj.weight")
            self.layers.append(EncoderLayer(
                ln1=wb(p + "self_attn_layer_norm"),
                qkv_w=torch.cat([q[0], k, v[0]]).contiguous(),
                qkv_b=torch.cat([q[1], torch.zeros_like(q[1]), v[1]]),
                out=wb(p + "self_attn.out_proj"), ln2=wb(p + "final_layer_norm"),
                fc1=wb(p + "fc1"), fc2=wb(p + "fc2")))

    @torch.inference_mode()
    def states(self, features: torch.Tensor, n: int) -> torch.Tensor:
        cfg = self.cfg
        d, heads = cfg.d_model, cfg.encoder_attention_heads
        x = features.to(self.conv1[0].dtype).unsqueeze(0)  # [1, mel, frames]
        x = F.gelu(F.conv1d(x, *self.conv1, padding=1))
        x = F.gelu(F.conv1d(x, *self.conv2, stride=2, padding=1))
        x = x[0, :, :n].transpose(0, 1).contiguous() + self.positions[:n]  # [n, d]
        for layer in self.layers:
            h = F.layer_norm(x, (d,), *layer.ln1)
            # [1, heads, n, head_dim] each: four dimensions take torch's flash kernel on the
            # CPU (three fall back to the materialized softmax, 3.6x slower at 1,500).
            q, k, v = F.linear(h, layer.qkv_w, layer.qkv_b).view(
                1, n, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(d // heads))
            x = x + F.linear(o[0].transpose(0, 1).reshape(n, d), *layer.out)
            h = F.layer_norm(x, (d,), *layer.ln2)
            x = x + F.linear(audio_act(cfg.activation_function, F.linear(h, *layer.fc1)), *layer.fc2)
        return x


__all__ = ["AudioEncoder", "EncoderLayer", "audio_act", "encoder_weight_names"]
