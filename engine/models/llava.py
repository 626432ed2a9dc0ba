"""LLaVA: a CLIP or SigLIP vision tower and a two-layer projector in front of a Llama-family
decoder (the generic one, :class:`~engine.models.layers.decoder.Decoder`).

An image enters the prompt as ``VisionConfig.num_image_tokens`` placeholder tokens. The
runner encodes the image (:meth:`LlavaModel.encode_images`: CLIP's patch embedding, its
pre-norm transformer up to the feature layer, the projector) and the decoder's input
embeddings at the placeholder positions are replaced by the result
(:meth:`LlavaModel.forward`'s ``mm_embeds``); everything after that is the text model.

Weights arrive under the names the loader gives them (:func:`normalize_llava_names`):
``vision_tower.*`` (CLIPVisionModel or SiglipVisionModel without its ``vision_model.``
prefix),
``multi_modal_projector.*`` and the decoder's own ``model.*`` / ``lm_head.weight``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from engine.errors import CorruptModelError
from engine.models.config import ModelConfig
from engine.models.layers.decoder import Decoder, decoder_weight_names
from engine.models.layers.shard import ShardedWeights
from engine.models.vision_config import VisionConfig
from engine.ops import Ops


def normalize_llava_names(name: str) -> str:
    """A LLaVA checkpoint's tensor name under the engine's names; transformers 4 and 5
    nest the parts differently (``language_model.model.X`` vs ``model.language_model.X``)."""
    for old, new in (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    ):
        if name.startswith(old):
            name = new + name[len(old):]
            break
    return name.replace("vision_tower.vision_model.", "vision_tower.", 1)


def vision_weight_names(vision: VisionConfig) -> list[str]:
    """The vision tower's and projector's tensors the engine reads."""
    v = "vision_tower."
    names = [v + "embeddings.patch_embedding.weight", v + "embeddings.position_embedding.weight"]
    if vision.tower == "clip":
        names += [v + "embeddings.class_embedding", v + "pre_layrnorm.weight", v + "pre_layrnorm.bias"]
    else:  # SigLIP: no CLS position and no pre-norm; its patch conv has a bias
        names.append(v + "embeddings.patch_embedding.bias")
    for i in range(vision.layers_needed):
        p = f"{v}encoder.layers.{i}."
        for part in ("layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2", "self_attn.q_proj",
                     "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"):
            names += [p + part + ".weight", p + part + ".bias"]
    for lin in ("linear_1", "linear_2"):
        names.append(f"multi_modal_projector.{lin}.weight")
        if vision.projector_bias:
            names.append(f"multi_modal_projector.{lin}.bias")
    return names


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    return F.gelu(x)


@dataclasses.dataclass(slots=True)
class _VisionLayer:
    ln1: tuple[torch.Tensor, torch.Tensor]
    ln2: tuple[torch.Tensor, torch.Tensor]
    qkv_w: torch.Tensor  # q, k, v stacked: [3 * hidden, hidden]
    qkv_b: torch.Tensor
    out_w: torch.Tensor
    out_b: torch.Tensor
    fc1: tuple[torch.Tensor, torch.Tensor]
    fc2: tuple[torch.Tensor, torch.Tensor]


class VisionTower:
    """CLIP's or SigLIP's vision transformer up to the feature layer LLaVA reads, plus the
    projector: pixels [N, C, H, W] -> embeddings [N, num_image_tokens, text hidden].

    The two differ only before the first layer: CLIP prepends a CLS position and runs a
    pre-norm, SigLIP's patch conv has a bias. Their layers are the same pre-norm blocks
    (SigLIP's post-norm and pooling head come after the hidden states LLaVA reads)."""

    def __init__(self, vision: VisionConfig, get) -> None:
        self.cfg = vision
        v = "vision_tower."
        clip = vision.tower == "clip"
        self.class_embedding = get(v + "embeddings.class_embedding") if clip else None
        self.patch_weight = get(v + "embeddings.patch_embedding.weight")
        self.patch_bias = None if clip else get(v + "embeddings.patch_embedding.bias")
        self.position_embedding = get(v + "embeddings.position_embedding.weight")
        self.pre_norm = (get(v + "pre_layrnorm.weight"), get(v + "pre_layrnorm.bias")) if clip else None
        self.layers = [self._layer(get, i) for i in range(vision.layers_needed)]
        p = "multi_modal_projector."
        bias = vision.projector_bias
        self.proj1 = (get(p + "linear_1.weight"), get(p + "linear_1.bias") if bias else None)
        self.proj2 = (get(p + "linear_2.weight"), get(p + "linear_2.bias") if bias else None)
        expected = (vision.image_size // vision.patch_size) ** 2 + clip
        if self.position_embedding.shape[0] != expected:
            raise CorruptModelError(
                f"vision_tower position_embedding has {self.position_embedding.shape[0]} rows; "
                f"image_size/patch_size give {expected}")

    @staticmethod
    def _layer(get, i: int) -> _VisionLayer:
        p = f"vision_tower.encoder.layers.{i}."

        def wb(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            return get(p + name + ".weight"), get(p + name + ".bias")

        q, k, vv = wb("self_attn.q_proj"), wb("self_attn.k_proj"), wb("self_attn.v_proj")
        out = wb("self_attn.out_proj")
        return _VisionLayer(
            ln1=wb("layer_norm1"), ln2=wb("layer_norm2"),
            qkv_w=torch.cat([q[0], k[0], vv[0]]).contiguous(), qkv_b=torch.cat([q[1], k[1], vv[1]]),
            out_w=out[0], out_b=out[1], fc1=wb("mlp.fc1"), fc2=wb("mlp.fc2"),
        )

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
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
        states = [x]  # transformers' hidden_states: embeddings, then each layer's output
        for layer in self.layers:
            x = self._block(layer, x)
            states.append(x)
        total = cfg.num_hidden_layers + 1
        feats = torch.cat([states[i % total] for i in cfg.feature_layers], dim=-1)
        if cfg.select_strategy == "default":
            feats = feats[:, 1:]
        h = F.linear(feats, *self.proj1)
        return F.linear(_act(cfg.projector_act, h), *self.proj2)

    def _block(self, layer: _VisionLayer, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        n, t, d = x.shape
        heads = cfg.num_attention_heads
        h = F.layer_norm(x, (d,), *layer.ln1, eps=cfg.layer_norm_eps)
        q, k, v = F.linear(h, layer.qkv_w, layer.qkv_b).view(n, t, 3, heads, d // heads).unbind(2)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=1 / math.sqrt(d // heads))
        x = x + F.linear(o.transpose(1, 2).reshape(n, t, d), layer.out_w, layer.out_b)
        h = F.layer_norm(x, (d,), *layer.ln2, eps=cfg.layer_norm_eps)
        h = F.linear(_act(cfg.hidden_act, F.linear(h, *layer.fc1)), *layer.fc2)
        return x + h


class LlavaModel(Decoder):
    """The Llama-family decoder with a CLIP or SigLIP vision tower whose outputs replace the
    input embeddings at image placeholder positions."""

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        assert isinstance(config.vision, VisionConfig)
        return decoder_weight_names(config) + vision_weight_names(config.vision)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        return normalize_llava_names(name)

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], ops: Ops, *,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__(config, weights, ops, dtype=dtype, device=device)
        assert isinstance(config.vision, VisionConfig)
        self.vision = VisionTower(config.vision, ShardedWeights(weights, dtype, self.device))

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] float pixels -> [N, num_image_tokens, hidden] in the model dtype."""
        return self.vision(pixels.to(self.device))
