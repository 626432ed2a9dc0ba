"""The vision towers' shapes a vision-language model's ``config.json`` gives
(:class:`VisionConfig` for LLaVA, :class:`QwenVisionConfig` for Qwen2-VL / Qwen2.5-VL);
``ModelConfig.from_hf`` (engine.models.config) reads them into ``ModelConfig.vision``."""

from __future__ import annotations

import dataclasses

# Vision-language models: a vision tower and projector in front of a decoder of the
# families above (models/llava.py). The language model's config is their text_config.
VISION_ARCHITECTURES = {"LlavaForConditionalGeneration": "llava"}
# Qwen2-VL and Qwen2.5-VL (models/qwen_vl.py): a vision transformer with 2-D rotary
# positions and a patch merger in front of a Qwen2 decoder with M-RoPE.
QWEN_VL_ARCHITECTURES = {
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class VisionConfig:
    """LLaVA's vision tower (CLIP or SigLIP) and projector, and how images enter the prompt."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str  # the tower's MLP: "quick_gelu" (CLIP) or "gelu"
    # The tower's hidden states the projector reads: an index into (embeddings, layer 1,
    # ..., layer N) as transformers counts them, negative from the end; several are
    # concatenated on the feature axis.
    feature_layers: tuple[int, ...]
    select_strategy: str  # "default" drops the CLS position, "full" keeps it
    projector_act: str  # between the projector's two linears
    projector_bias: bool
    image_token_id: int  # the placeholder token each image's embeddings replace
    # "clip": a CLS position before the patches, a bias-free patch conv and a pre-norm;
    # "siglip": the patches alone, a patch conv with a bias, no pre-norm.
    tower: str = "clip"

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens (and embeddings) per image: the tower's positions (the CLS
        one included), less the first under the ``default`` strategy (as transformers'
        LLaVA drops it whether or not it is a CLS)."""
        positions = (self.image_size // self.patch_size) ** 2 + (self.tower == "clip")
        return positions - (self.select_strategy == "default")

    @property
    def layers_needed(self) -> int:
        """Encoder layers to run: the deepest feature layer's."""
        n = self.num_hidden_layers
        return max(i % (n + 1) for i in self.feature_layers)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class QwenVisionConfig:
    """Qwen2-VL's / Qwen2.5-VL's vision transformer, its patch merger, and M-RoPE.

    Images keep their own size (a multiple of ``patch_size * spatial_merge_size`` pixels
    per side, as the image processor resizes them): an image of ``h x w`` patches becomes
    ``h * w / spatial_merge_size**2`` placeholder tokens."""

    kind: str  # "qwen2_vl" or "qwen2_5_vl"
    depth: int
    hidden_size: int  # the tower's width
    intermediate_size: int  # of each block's MLP
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    hidden_act: str  # "quick_gelu" (Qwen2-VL) or "silu" (Qwen2.5-VL's SwiGLU)
    out_hidden_size: int  # the merger's output: the language model's hidden size
    rope_theta: float  # the tower's 2-D rotary base
    # Qwen2.5-VL: attention within windows of window_size pixels, but for these blocks.
    window_size: int = 0
    fullatt_block_indexes: tuple[int, ...] = ()
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    # M-RoPE: how many of the decoder's head_dim / 2 frequencies the temporal, height and
    # width positions each rotate (in that order, cycling).
    mrope_section: tuple[int, ...]

    @property
    def num_image_tokens(self) -> None:
        """Placeholder tokens per image: none fixed (each image's own grid decides)."""
        return None
