"""Idefics3 and SmolVLM: a SigLIP tower over each tile of an image, a pixel-shuffle
connector, and a Llama decoder (the generic one, :class:`~engine.models.layers.decoder.Decoder`).

The image processor (``Idefics3ImageProcessor`` / ``SmolVLMImageProcessor``) cuts an image
into rows x columns tiles of ``image_size`` pixels plus the whole image shrunk to one tile;
each tile stands in the prompt as ``num_image_tokens`` placeholders between its frame
tokens (engine.image_tiles). The runner encodes the tiles (:meth:`Idefics3Model.encode_images`):
SigLIP's patch embedding and layers, ``post_layernorm``, then the connector: the
``side x side`` patch states pixel-shuffled (each ``scale x scale`` block of neighbours
concatenated, rows of blocks in order) and projected without a bias to the decoder's width.

The tower's position ids are transformers': the patch grid's fractional coordinates
bucketized into the learned ``side x side`` table (``SmolVLMVisionEmbeddings``). For a
whole tile that is the identity where ``side`` is a power of two; elsewhere (27 patches a
side) float rounding moves some rows, and the engine gathers the table the same way.

Weights: ``model.vision_model.*`` -> ``vision_tower.*``, ``model.connector.*`` ->
``connector.*``, ``model.text_model.*`` -> ``model.*`` (:func:`normalize_idefics3_names`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from engine.models.config import ModelConfig
from engine.models.layers.decoder import Decoder, decoder_weight_names
from engine.models.layers.shard import ShardedWeights
from engine.models.layers.vision_tower import TOWER, ViTEncoder
from engine.models.vision_config import Idefics3VisionConfig
from engine.ops import Ops
from engine.pixels import unpack

PROJECTION = "connector.modality_projection.proj.weight"


def normalize_idefics3_names(name: str) -> str:
    """An Idefics3 / SmolVLM checkpoint's tensor name under the engine's names."""
    for old, new in (("model.vision_model.", TOWER), ("model.text_model.", "model."),
                     ("model.connector.", "connector.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


def idefics3_weight_names(vision: Idefics3VisionConfig) -> list[str]:
    """The tower's and connector's tensors the engine reads."""
    v = TOWER
    names = [v + "embeddings.patch_embedding.weight", v + "embeddings.patch_embedding.bias",
             v + "embeddings.position_embedding.weight"]
    for i in range(vision.tower.num_hidden_layers):
        p = f"{v}encoder.layers.{i}."
        for part in ("layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2", "self_attn.q_proj",
                     "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"):
            names += [p + part + ".weight", p + part + ".bias"]
    return [*names, v + "post_layernorm.weight", v + "post_layernorm.bias", PROJECTION]


def tile_position_ids(side: int) -> torch.Tensor:
    """The position ids transformers gives a whole tile's ``side x side`` patches: each
    patch's fractional row and column (index / side) bucketized at ``k / side``."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    frac = torch.clamp(torch.arange(side, dtype=torch.float32) * (1.0 / side), max=1.0 - 1e-6)
    buckets = torch.bucketize(frac, boundaries, right=True)
    return (buckets[:, None] * side + buckets[None, :]).reshape(-1)


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[N, side*side, D] patch states -> [N, side*side / scale**2, D * scale**2]: each
    ``scale x scale`` block of neighbouring patches one vector, as the connector orders it."""
    n, seq, d = x.shape
    side = int(round(seq ** 0.5))
    x = x.reshape(n, side, side // scale, d * scale).permute(0, 2, 1, 3)
    x = x.reshape(n, side // scale, side // scale, d * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(n, seq // (scale * scale), d * scale * scale)


class TileTower(ViTEncoder):
    """SigLIP over whole tiles, ``post_layernorm``, pixel shuffle and projection: tiles
    [N, C, S, S] -> [N, num_image_tokens, text hidden]."""

    def __init__(self, vision: Idefics3VisionConfig, get) -> None:
        super().__init__(vision.tower, get, vision.tower.num_hidden_layers)
        self.tiles = vision
        side = vision.tower.image_size // vision.tower.patch_size
        self.position_embedding = self.position_embedding[tile_position_ids(side).to(self.position_embedding.device)]
        self.post_norm = (get(TOWER + "post_layernorm.weight"), get(TOWER + "post_layernorm.bias"))
        self.projection = get(PROJECTION)

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        x = self.hidden_states(pixels)[-1]
        x = F.layer_norm(x, (cfg.hidden_size,), *self.post_norm, eps=cfg.layer_norm_eps)
        return F.linear(pixel_shuffle(x, self.tiles.scale_factor), self.projection)


class Idefics3Model(Decoder):
    """The Llama decoder with a tiled SigLIP tower whose outputs replace the input
    embeddings at each tile's placeholder positions."""

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        assert isinstance(config.vision, Idefics3VisionConfig)
        return decoder_weight_names(config) + idefics3_weight_names(config.vision)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        return normalize_idefics3_names(name)

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], ops: Ops, *,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__(config, weights, ops, dtype=dtype, device=device)
        assert isinstance(config.vision, Idefics3VisionConfig)
        self.vision = TileTower(config.vision, ShardedWeights(weights, dtype, self.device))

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Tiles [N, C, S, S] float pixels -> [N, num_image_tokens, hidden] in the model dtype."""
        return self.vision(pixels.to(self.device))

    def encode_image_inputs(self, tiles: Sequence[Any]) -> list[torch.Tensor]:
        """The step's new tiles (``ImageInput``s, their pixels packed: engine.pixels) -> one
        ``[num_image_tokens, hidden]`` embedding each, encoded as one batch."""
        return list(self.encode_images(torch.stack([unpack(t.pixels, t.shape) for t in tiles])))


__all__ = ["Idefics3Model", "idefics3_weight_names", "normalize_idefics3_names", "pixel_shuffle",
           "tile_position_ids"]
