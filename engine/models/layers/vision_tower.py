"""The CLIP / SigLIP vision transformer the vision-language families put in front of their
decoders (LLaVA's tower, Gemma 3's): patch embedding, position embedding, pre-norm
encoder layers. Each family adds what reads its hidden states (a projector)."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from engine.errors import CorruptModelError
from engine.models.vision_config import VisionConfig

TOWER = "vision_tower."


def vision_act(name: str, x: torch.Tensor) -> torch.Tensor:
    """A tower's or projector's activation by its transformers name."""
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    return F.gelu(x)


@dataclasses.dataclass(slots=True)
class VisionLayer:
    ln1: tuple[torch.Tensor, torch.Tensor]
    ln2: tuple[torch.Tensor, torch.Tensor]
    qkv_w: torch.Tensor  # q, k, v stacked: [3 * hidden, hidden]
    qkv_b: torch.Tensor
    out_w: torch.Tensor
    out_b: torch.Tensor
    fc1: tuple[torch.Tensor, torch.Tensor]
    fc2: tuple[torch.Tensor, torch.Tensor]


class ViTEncoder:
    """CLIP's or SigLIP's vision transformer, its first ``layers`` layers, over weights named
    ``vision_tower.*`` (``get`` fetches one in the model dtype).

    The two differ only before the first layer: CLIP prepends a CLS position and runs a
    pre-norm, SigLIP's patch conv has a bias. Their layers are the same pre-norm blocks."""

    def __init__(self, vision: VisionConfig, get, layers: int) -> None:
        self.cfg = vision
        v = TOWER
        clip = vision.tower == "clip"
        self.class_embedding = get(v + "embeddings.class_embedding") if clip else None
        self.patch_weight = get(v + "embeddings.patch_embedding.weight")
        self.patch_bias = None if clip else get(v + "embeddings.patch_embedding.bias")
        self.position_embedding = get(v + "embeddings.position_embedding.weight")
        self.pre_norm = (get(v + "pre_layrnorm.weight"), get(v + "pre_layrnorm.bias")) if clip else None
        self.layers = [self._layer(get, i) for i in range(layers)]
        expected = (vision.image_size // vision.patch_size) ** 2 + clip
        if self.position_embedding.shape[0] != expected:
            raise CorruptModelError(
                f"vision_tower position_embedding has {self.position_embedding.shape[0]} rows; "
                f"image_size/patch_size give {expected}")

    @staticmethod
    def _layer(get, i: int) -> VisionLayer:
        p = f"{TOWER}encoder.layers.{i}."

        def wb(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            return get(p + name + ".weight"), get(p + name + ".bias")

        q, k, vv = wb("self_attn.q_proj"), wb("self_attn.k_proj"), wb("self_attn.v_proj")
        out = wb("self_attn.out_proj")
        return VisionLayer(
            ln1=wb("layer_norm1"), ln2=wb("layer_norm2"),
            qkv_w=torch.cat([q[0], k[0], vv[0]]).contiguous(), qkv_b=torch.cat([q[1], k[1], vv[1]]),
            out_w=out[0], out_b=out[1], fc1=wb("mlp.fc1"), fc2=wb("mlp.fc2"),
        )

    @torch.inference_mode()
    def hidden_states(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        """transformers' ``hidden_states`` of the tower: the embeddings, then each built
        layer's output [N, P, D]."""
        cfg = self.cfg
        n = pixels.shape[0]
        patches = F.conv2d(pixels.to(self.patch_weight.dtype), self.patch_weight, self.patch_bias,
                           stride=cfg.patch_size)
        x = patches.flatten(2).transpose(1, 2)  # [N, P, D]
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(n, 1, -1), x], dim=1)
        x = x + self.position_embedding
        if self.pre_norm is not None:
            x = F.layer_norm(x, (cfg.hidden_size,), *self.pre_norm, eps=cfg.layer_norm_eps)
        states = [x]
        for layer in self.layers:
            x = self._block(layer, x)
            states.append(x)
        return states

    def _block(self, layer: VisionLayer, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        n, t, d = x.shape
        heads = cfg.num_attention_heads
        h = F.layer_norm(x, (d,), *layer.ln1, eps=cfg.layer_norm_eps)
        q, k, v = F.linear(h, layer.qkv_w, layer.qkv_b).view(n, t, 3, heads, d // heads).unbind(2)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=1 / math.sqrt(d // heads))
        x = x + F.linear(o.transpose(1, 2).reshape(n, t, d), layer.out_w, layer.out_b)
        h = F.layer_norm(x, (d,), *layer.ln2, eps=cfg.layer_norm_eps)
        h = F.linear(vision_act(cfg.hidden_act, F.linear(h, *layer.fc1)), *layer.fc2)
        return x + h


__all__ = ["TOWER", "ViTEncoder", "VisionLayer", "vision_act"]
