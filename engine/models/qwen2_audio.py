"""Qwen2-Audio: Whisper's encoder over a clip's log-mel frames, pairs of its positions
averaged, and one linear projector, in front of a Qwen2 decoder (the generic
:class:`~engine.models.layers.decoder.Decoder`).

A clip enters the prompt as :func:`~engine.models.audio_config.audio_tokens` placeholder
tokens. The runner encodes it (:meth:`Qwen2AudioModel.encode_image_inputs`, the entry the
runner takes for inputs of their own sizes) and the decoder's input embeddings at the
placeholder positions are replaced by the result.

transformers pads every clip to the 30-second window and masks the padding's positions
out of the encoder's attention. Here the encoder runs on the clip's own positions only:
a masked key adds nothing to any query, each kept position's convolutions read the frames
kept (the clip's frames and the two after them, padding as the feature extractor wrote
it; ``engine.audio``), and the pairs averaged are all within the clip. So the result is
transformers' for a fraction of the work on a short clip.

Weights arrive under transformers 4's names (``audio_tower.*``,
``multi_modal_projector.linear.*``, ``language_model.model.*``) or transformers 5's
(``model.audio_tower.*``, ``model.multi_modal_projector.*``, ``model.language_model.*``);
the loader moves the decoder's to ``model.*`` and :func:`qwen2_audio_name` the rest.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from engine.audio import audio_tokens
from engine.models.audio_config import AudioConfig
from engine.models.config import ModelConfig
from engine.models.layers.decoder import Decoder, decoder_weight_names
from engine.models.layers.shard import ShardedWeights
from engine.ops import Ops

TOWER = "audio_tower."
PROJECTOR = "multi_modal_projector.linear."


def qwen2_audio_name(name: str) -> str:
    """A checkpoint tensor's name with transformers 5's ``model.`` prefix of the tower
    and projector dropped."""
    for prefix in ("model.audio_tower.", "model.multi_modal_projector."):
        if name.startswith(prefix):
            return name[len("model."):]
    return name


def audio_weight_names(audio: AudioConfig) -> list[str]:
    """The audio tower's and projector's tensors."""
    t = TOWER
    names = [t + "conv1.weight", t + "conv1.bias", t + "conv2.weight", t + "conv2.bias",
             t + "embed_positions.weight", t + "layer_norm.weight", t + "layer_norm.bias"]
    for i in range(audio.encoder_layers):
        p = f"{t}layers.{i}."
        names += [p + "self_attn.k_proj.weight"]
        for part in ("self_attn.q_proj", "self_attn.v_proj", "self_attn.out_proj",
                     "self_attn_layer_norm", "final_layer_norm", "fc1", "fc2"):
            names += [p + part + ".weight", p + part + ".bias"]
    return names + [PROJECTOR + "weight", PROJECTOR + "bias"]


@dataclasses.dataclass(slots=True)
class _Layer:
    ln1: tuple[torch.Tensor, torch.Tensor]
    qkv_w: torch.Tensor  # q, k, v stacked: [3 * d, d]
    qkv_b: torch.Tensor  # k has no bias: zeros in its third
    out: tuple[torch.Tensor, torch.Tensor]
    ln2: tuple[torch.Tensor, torch.Tensor]
    fc1: tuple[torch.Tensor, torch.Tensor]
    fc2: tuple[torch.Tensor, torch.Tensor]


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x) if name == "gelu" else F.relu(x) if name == "relu" else F.silu(x)


class AudioTower:
    """Log-mel frames ``[mel, frames]`` and the clip's own frame count -> its embeddings
    ``[audio_tokens(frames), text hidden]``."""

    def __init__(self, cfg: AudioConfig, get) -> None:
        self.cfg = cfg
        t = TOWER

        def wb(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            return get(name + ".weight"), get(name + ".bias")

        self.conv1, self.conv2 = wb(t + "conv1"), wb(t + "conv2")
        self.positions = get(t + "embed_positions.weight")
        self.norm = wb(t + "layer_norm")
        self.projector = (get(PROJECTOR + "weight"), get(PROJECTOR + "bias"))
        self.layers = []
        for i in range(cfg.encoder_layers):
            p = f"{t}layers.{i}."
            q, v = wb(p + "self_attn.q_proj"), wb(p + "self_attn.v_proj")
            k = get(p + "self_attn.k_proj.weight")
            self.layers.append(_Layer(
                ln1=wb(p + "self_attn_layer_norm"),
                qkv_w=torch.cat([q[0], k, v[0]]).contiguous(),
                qkv_b=torch.cat([q[1], torch.zeros_like(q[1]), v[1]]),
                out=wb(p + "self_attn.out_proj"), ln2=wb(p + "final_layer_norm"),
                fc1=wb(p + "fc1"), fc2=wb(p + "fc2")))

    @torch.inference_mode()
    def __call__(self, features: torch.Tensor, frames: int) -> torch.Tensor:
        cfg = self.cfg
        d, heads = cfg.d_model, cfg.encoder_attention_heads
        x = features.to(self.conv1[0].dtype).unsqueeze(0)  # [1, mel, kept frames]
        x = F.gelu(F.conv1d(x, *self.conv1, padding=1))
        x = F.gelu(F.conv1d(x, *self.conv2, stride=2, padding=1))
        n = (frames - 1) // 2 + 1  # the clip's own positions
        x = x[0, :, :n].transpose(0, 1).contiguous() + self.positions[:n]  # [n, d]
        for layer in self.layers:
            h = F.layer_norm(x, (d,), *layer.ln1)
            # [1, heads, n, head_dim] each: four dimensions take torch's flash kernel on the
            # CPU (three fall back to the materialized softmax, 3.6x slower at 1,500).
            q, k, v = F.linear(h, layer.qkv_w, layer.qkv_b).view(1, n, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(d // heads))
            x = x + F.linear(o[0].transpose(0, 1).reshape(n, d), *layer.out)
            h = F.layer_norm(x, (d,), *layer.ln2)
            x = x + F.linear(_act(cfg.activation_function, F.linear(h, *layer.fc1)), *layer.fc2)
        tokens = audio_tokens(frames)
        x = x[: 2 * tokens].view(tokens, 2, d).mean(1)  # AvgPool1d(2, stride 2)
        x = F.layer_norm(x, (d,), *self.norm)
        return F.linear(x, *self.projector)


class Qwen2AudioModel(Decoder):
    """The Qwen2 decoder with Qwen2-Audio's audio tower, whose outputs replace the input
    embeddings at audio placeholder positions."""

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        assert isinstance(config.vision, AudioConfig)
        return decoder_weight_names(config) + audio_weight_names(config.vision)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        return qwen2_audio_name(name)

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], ops: Ops, *,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__(config, weights, ops, dtype=dtype, device=device)
        assert isinstance(config.vision, AudioConfig)
        self.audio = AudioTower(config.vision, ShardedWeights(weights, dtype, self.device))

    def encode_image_inputs(self, clips: Sequence[Any]) -> list[torch.Tensor]:
        """``ImageInput``s of clips (``pixels``: float32 log-mel frames of ``shape``
        ``(mel, kept frames)``; ``grid``: ``(frames,)``, the clip's own) -> one
        ``[tokens, hidden]`` embedding per clip, in the model dtype."""
        out = []
        for clip in clips:
            features = torch.frombuffer(bytearray(clip.pixels), dtype=torch.float32).view(clip.shape)
            out.append(self.audio(features.to(self.device), int(clip.grid[0])))
        return out


__all__ = ["AudioTower", "Qwen2AudioModel", "audio_weight_names", "qwen2_audio_name"]
