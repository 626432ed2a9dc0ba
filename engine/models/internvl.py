"""InternVL (InternVL3 and 3.5 in transformers' format): InternViT over each tile of an
image, a pixel shuffle and a projector, in front of a Qwen2 / Qwen3 / Llama decoder (the
generic one, :class:`~engine.models.layers.decoder.Decoder`).

The image processor (``GotOcr2ImageProcessor``) crops an image into tiles of the tower's
size on the grid closest to its aspect ratio, plus a thumbnail of the whole when there
are several; the prompt holds ``<img>``, ``num_image_tokens`` placeholders a tile, and
``</img>`` (engine.image_tiles.ContextImagePreprocessor). The runner encodes an image's
tiles (:meth:`InternVLModel.encode_image_inputs`):

* InternViT: the patch embedding (a convolution with a bias), a CLS position in front,
  learned positions; each layer ``x + lambda_1 * attn(norm(x))`` then ``x + lambda_2 *
  mlp(norm(x))`` (LayerNorm, or RMSNorm for InternViT-6B, whose q and k are also
  RMS-normed over the whole width before the heads split); attention scaled by
  ``head_dim ** -0.5``; a LayerNorm after the last layer unless ``use_mean_pooling``;
* the CLS row dropped, the ``side x side`` states pixel-shuffled by ``downsample_ratio``
  (transformers' ``pixel_shuffle``: each 2 x 2 block one vector), then LayerNorm, Linear,
  GELU, Linear to the decoder's width.

Weights: transformers 5's ``model.vision_tower.*`` / ``model.multi_modal_projector.*`` /
``model.language_model.*``, and the 4.5x ``-hf`` folders' ``vision_tower.*`` /
``multi_modal_projector.*`` / ``language_model.model.*`` (:func:`normalize_internvl_names`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from engine.errors import CorruptModelError
from engine.models.config import ModelConfig
from engine.models.layers.decoder import Decoder, decoder_weight_names
from engine.models.layers.shard import ShardedWeights
from engine.models.vision_config import InternVLVisionConfig
from engine.ops import Ops
from engine.pixels import unpack

TOWER = "vision_tower."
PROJ = "multi_modal_projector."


def normalize_internvl_names(name: str) -> str:
    """An InternVL checkpoint's tensor name under the engine's names."""
    for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                     ("language_model.lm_head.", "lm_head."), ("model.vision_tower.", TOWER),
                     ("model.multi_modal_projector.", PROJ)):
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _layer_names(vision: InternVLVisionConfig, i: int) -> list[str]:
    p = f"{TOWER}encoder.layer.{i}."
    norm = [".weight", ".bias"] if vision.norm_type == "layer_norm" else [".weight"]
    names = [p + n + s for n in ("layernorm_before", "layernorm_after") for s in norm]
    for lin in ("q_proj", "k_proj", "v_proj"):
        names.append(p + f"attention.{lin}.weight")
        if vision.attention_bias:
            names.append(p + f"attention.{lin}.bias")
    if vision.qk_norm:
        names += [p + "attention.q_norm.weight", p + "attention.k_norm.weight"]
    names += [p + "attention.projection_layer.weight", p + "attention.projection_layer.bias",
              p + "lambda_1", p + "lambda_2"]
    return names + [p + f"mlp.{fc}.{s}" for fc in ("fc1", "fc2") for s in ("weight", "bias")]


def internvl_weight_names(vision: InternVLVisionConfig) -> list[str]:
    """The tower's and projector's tensors the engine reads."""
    e = TOWER + "embeddings."
    names = [e + "cls_token", e + "position_embeddings", e + "patch_embeddings.projection.weight",
             e + "patch_embeddings.projection.bias"]
    for i in range(vision.num_hidden_layers):
        names += _layer_names(vision, i)
    if vision.final_norm:
        names += [TOWER + "layernorm.weight", TOWER + "layernorm.bias"]
    return names + [PROJ + f"{n}.{s}" for n in ("layer_norm", "linear_1", "linear_2") for s in ("weight", "bias")]


def internvl_pixel_shuffle(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """transformers' InternVL ``pixel_shuffle``: [N, side, side, C] -> [N, side * ratio,
    side * ratio, C / ratio**2]."""
    n, w, h, c = x.shape
    x = x.reshape(n, w, int(h * ratio), int(c / ratio)).permute(0, 2, 1, 3)
    x = x.reshape(n, int(h * ratio), int(w * ratio), int(c / (ratio * ratio)))
    return x.permute(0, 2, 1, 3)


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    return F.gelu(x, approximate="tanh" if name == "gelu_pytorch_tanh" else "none")


class InternViT:
    """InternViT over whole tiles and the projector: tiles [N, C, S, S] ->
    [N, num_image_tokens, text hidden]."""

    def __init__(self, vision: InternVLVisionConfig, get) -> None:
        self.cfg = vision
        e = TOWER + "embeddings."
        self.cls = get(e + "cls_token").reshape(1, 1, -1)
        self.positions = get(e + "position_embeddings").reshape(1, -1, vision.hidden_size)
        self.patch = (get(e + "patch_embeddings.projection.weight"), get(e + "patch_embeddings.projection.bias"))
        grid = vision.image_size // vision.patch_size
        if self.positions.shape[1] != grid * grid + 1:
            raise CorruptModelError(f"InternVL position_embeddings has {self.positions.shape[1]} rows; "
                                    f"image_size / patch_size give {grid * grid + 1}")
        self.layers = [{n.rsplit(f"layer.{i}.", 1)[1]: get(n) for n in _layer_names(vision, i)}
                       for i in range(vision.num_hidden_layers)]
        self.final = (get(TOWER + "layernorm.weight"), get(TOWER + "layernorm.bias")) if vision.final_norm else None
        self.proj = {n: (get(f"{PROJ}{n}.weight"), get(f"{PROJ}{n}.bias")) for n in ("layer_norm", "linear_1", "linear_2")}

    def _norm(self, x: torch.Tensor, layer: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        if self.cfg.norm_type == "layer_norm":
            return F.layer_norm(x, (x.shape[-1],), layer[name + ".weight"], layer[name + ".bias"],
                                eps=self.cfg.layer_norm_eps)
        return _rms(x, layer[name + ".weight"], self.cfg.layer_norm_eps)

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        n, d, heads = pixels.shape[0], cfg.hidden_size, cfg.num_attention_heads
        x = F.conv2d(pixels.to(self.patch[0].dtype), *self.patch, stride=cfg.patch_size)
        x = torch.cat([self.cls.expand(n, 1, -1), x.flatten(2).transpose(1, 2)], dim=1) + self.positions
        t = x.shape[1]
        for layer in self.layers:
            h = self._norm(x, layer, "layernorm_before")
            q, k, v = (F.linear(h, layer[f"attention.{p}.weight"], layer.get(f"attention.{p}.bias"))
                       for p in ("q_proj", "k_proj", "v_proj"))
            if cfg.qk_norm:
                q = _rms(q, layer["attention.q_norm.weight"], 1e-6)
                k = _rms(k, layer["attention.k_norm.weight"], 1e-6)
            q, k, v = (y.view(n, t, heads, d // heads).transpose(1, 2) for y in (q, k, v))
            o = F.scaled_dot_product_attention(q, k, v, scale=(d // heads) ** -0.5)
            o = F.linear(o.transpose(1, 2).reshape(n, t, d), layer["attention.projection_layer.weight"],
                         layer["attention.projection_layer.bias"])
            x = x + layer["lambda_1"] * o
            h = self._norm(x, layer, "layernorm_after")
            h = F.linear(_act(cfg.hidden_act, F.linear(h, layer["mlp.fc1.weight"], layer["mlp.fc1.bias"])),
                         layer["mlp.fc2.weight"], layer["mlp.fc2.bias"])
            x = x + layer["lambda_2"] * h
        if self.final is not None:
            x = F.layer_norm(x, (d,), *self.final, eps=cfg.layer_norm_eps)
        side = cfg.image_size // cfg.patch_size
        x = internvl_pixel_shuffle(x[:, 1:].reshape(n, side, side, d), cfg.downsample_ratio).reshape(n, -1, d * cfg.scale ** 2)
        ln, l1, l2 = self.proj["layer_norm"], self.proj["linear_1"], self.proj["linear_2"]
        x = F.layer_norm(x, (x.shape[-1],), *ln, eps=1e-5)
        return F.linear(_act(cfg.projector_act, F.linear(x, *l1)), *l2)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class InternVLModel(Decoder):
    """The decoder with InternViT whose tiles' outputs replace the input embeddings at
    each image's placeholder positions."""

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        assert isinstance(config.vision, InternVLVisionConfig)
        return decoder_weight_names(config) + internvl_weight_names(config.vision)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        return normalize_internvl_names(name)

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], ops: Ops, *,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__(config, weights, ops, dtype=dtype, device=device)
        assert isinstance(config.vision, InternVLVisionConfig)
        self.vision = InternViT(config.vision, ShardedWeights(weights, dtype, self.device))

    def encode_image_inputs(self, images: Sequence[Any]) -> list[torch.Tensor]:
        """``ImageInput``s (pixels: an image's tiles ``(T, C, S, S)``, packed) -> one
        ``[T * num_image_tokens, hidden]`` embedding each; every tile of the step in one batch."""
        tiles = [unpack(im.pixels, im.shape) for im in images]
        out = self.vision(torch.cat(tiles).to(self.device))
        return list(out.reshape(-1, out.shape[-1]).split([t.shape[0] * out.shape[1] for t in tiles]))


__all__ = ["InternVLModel", "internvl_pixel_shuffle", "internvl_weight_names", "normalize_internvl_names"]
