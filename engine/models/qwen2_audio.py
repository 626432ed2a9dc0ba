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

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from engine.audio import audio_tokens
from engine.models.audio_config import AudioConfig
from engine.models.config import ModelConfig
from engine.models.layers.audio_tower import AudioEncoder, encoder_weight_names
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
    return encoder_weight_names(audio, TOWER) + [PROJECTOR + "weight", PROJECTOR + "bias"]


class AudioTower(AudioEncoder):
    """Log-mel frames ``[mel, frames]`` and the clip's own frame count -> its embeddings
    ``[audio_tokens(frames), text hidden]``."""

    def __init__(self, cfg: AudioConfig, get) -> None:
        super().__init__(cfg, get, TOWER)
        self.projector = (get(PROJECTOR + "weight"), get(PROJECTOR + "bias"))

    @torch.inference_mode()
    def __call__(self, features: torch.Tensor, frames: int) -> torch.Tensor:
        d = self.cfg.d_model
        x = self.states(features, (frames - 1) // 2 + 1)  # the clip's own positions
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
