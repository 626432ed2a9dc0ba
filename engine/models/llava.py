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

import torch
import torch.nn.functional as F

from engine.models.config import ModelConfig
from engine.models.layers.decoder import Decoder, decoder_weight_names
from engine.models.layers.shard import ShardedWeights
from engine.models.layers.vision_tower import ViTEncoder, vision_act
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


class VisionTower(ViTEncoder):
    """CLIP's or SigLIP's vision transformer up to the feature layer LLaVA reads, plus the
    projector: pixels [N, C, H, W] -> embeddings [N, num_image_tokens, text hidden]."""

    def __init__(self, vision: VisionConfig, get) -> None:
        super().__init__(vision, get, vision.layers_needed)
        p = "multi_modal_projector."
        bias = vision.projector_bias
        self.proj1 = (get(p + "linear_1.weight"), get(p + "linear_1.bias") if bias else None)
        self.proj2 = (get(p + "linear_2.weight"), get(p + "linear_2.bias") if bias else None)

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        states = self.hidden_states(pixels)
        total = cfg.num_hidden_layers + 1
        feats = torch.cat([states[i % total] for i in cfg.feature_layers], dim=-1)
        if cfg.select_strategy == "default":
            feats = feats[:, 1:]
        h = F.linear(feats, *self.proj1)
        return F.linear(vision_act(cfg.projector_act, h), *self.proj2)


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
