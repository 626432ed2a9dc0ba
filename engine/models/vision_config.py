"""The vision towers' shapes a vision-language model's ``config.json`` gives
(:class:`VisionConfig` for LLaVA, :class:`QwenVisionConfig` for Qwen2-VL / Qwen2.5-VL /
Qwen3-VL, :class:`Gemma3VisionConfig` for Gemma 3); ``ModelConfig.from_hf``
(engine.models.config) reads them into ``ModelConfig.vision``."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.errors import CorruptModelError, UnsupportedModelError

# Vision-language models: a vision tower and projector in front of a decoder of the
# families above (models/llava.py). The language model's config is their text_config.
VISION_ARCHITECTURES = {"LlavaForConditionalGeneration": "llava"}
# Qwen2-VL, Qwen2.5-VL and Qwen3-VL (models/qwen_vl.py): a vision transformer with 2-D
# rotary positions and a patch merger in front of a Qwen2 / Qwen3 decoder with M-RoPE.
QWEN_VL_ARCHITECTURES = {
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe",
}
# Each kind's language model, as ModelConfig.from_hf reads its text_config.
QWEN_VL_TEXT = {"qwen2_vl": "Qwen2ForCausalLM", "qwen2_5_vl": "Qwen2ForCausalLM",
                "qwen3_vl": "Qwen3ForCausalLM", "qwen3_vl_moe": "Qwen3MoeForCausalLM"}


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
    """Qwen2-VL's / Qwen2.5-VL's / Qwen3-VL's vision transformer, its patch merger, and
    M-RoPE.

    Images keep their own size (a multiple of ``patch_size * spatial_merge_size`` pixels
    per side, as the image processor resizes them): an image of ``h x w`` patches becomes
    ``h * w / spatial_merge_size**2`` placeholder tokens."""

    kind: str  # "qwen2_vl", "qwen2_5_vl", "qwen3_vl" or "qwen3_vl_moe"
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
    # Qwen3-VL: the streams take frequencies in turn (T, H, W, T, H, W, ...) within
    # 3 * section, the rest the temporal stream's; Qwen2-VL's sections are consecutive.
    mrope_interleaved: bool = False
    # Qwen3-VL: a learned num_position_embeddings table (a square grid, resampled to each
    # image's patches), a patch embedding with a bias, and the blocks whose outputs a
    # merger of their own adds to the first decoder layers' hidden states (DeepStack).
    num_position_embeddings: int = 0
    deepstack_visual_indexes: tuple[int, ...] = ()

    @property
    def qwen3(self) -> bool:
        return self.kind.startswith("qwen3")

    @property
    def num_image_tokens(self) -> None:
        """Placeholder tokens per image: none fixed (each image's own grid decides)."""
        return None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Gemma3VisionConfig:
    """Gemma 3's vision tower (SigLIP, every layer and its post-norm: ``tower``), the
    projector that pools its patches to ``mm_tokens_per_image`` and projects them, and
    the tokens around an image: the chat template writes ``boi_token_id``
    (``<start_of_image>``), which the engine widens, as Gemma 3's processor does, to two
    newlines, itself, ``mm_tokens_per_image`` placeholders (``image_token_id``,
    ``<image_soft_token>``), ``eoi_token_id`` and two newlines. The placeholders of one
    image attend to each other both ways (prefill only)."""

    tower: VisionConfig
    mm_tokens_per_image: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    kind: str = "gemma3"
    # An image's placeholders attend to each other both ways: the scheduler prefills them
    # in one chunk (SchedulerConfig.whole_images).
    bidirectional_images: bool = True

    @property
    def num_image_tokens(self) -> int:
        return self.mm_tokens_per_image

    @property
    def patches_per_side(self) -> int:
        return self.tower.image_size // self.tower.patch_size

    @property
    def pool(self) -> int:
        """The side of the average pool from the patch grid to the placeholders' grid."""
        return self.patches_per_side // int(round(self.mm_tokens_per_image ** 0.5))


def siglip_tower(vis: dict[str, Any], image_token_id: int, *, layers: int, intermediate: int,
                 image_size: int, patch_size: int) -> VisionConfig:
    """A whole SigLIP tower read from a ``vision_config`` (Gemma 3's, Idefics3's), the
    family's transformers defaults where it is silent: every layer's output, no projector
    of its own."""
    layers = int(vis.get("num_hidden_layers", layers))
    return VisionConfig(
        hidden_size=int(vis.get("hidden_size", 1152)),
        intermediate_size=int(vis.get("intermediate_size", intermediate)),
        num_hidden_layers=layers,
        num_attention_heads=int(vis.get("num_attention_heads", 16)),
        image_size=int(vis.get("image_size", image_size)),
        patch_size=int(vis.get("patch_size", patch_size)),
        num_channels=int(vis.get("num_channels", 3)),
        layer_norm_eps=float(vis.get("layer_norm_eps", 1e-6)),
        hidden_act=str(vis.get("hidden_act", "gelu_pytorch_tanh")),
        feature_layers=(layers,), select_strategy="full", projector_act="none",
        projector_bias=False, image_token_id=image_token_id, tower="siglip")


def gemma3_vision_config(raw: dict[str, Any]) -> Gemma3VisionConfig:
    """Gemma 3's ``vision_config`` and image tokens from its outer config.json (the
    defaults are transformers' ``Gemma3Config``'s)."""
    try:
        vis = dict(raw["vision_config"])
        if vis.get("model_type", "siglip_vision_model") != "siglip_vision_model":
            raise UnsupportedModelError(f"Gemma 3 with a {vis['model_type']!r} vision tower is "
                                        "not supported (SigLIP is)")
        tower = siglip_tower(vis, int(raw.get("image_token_index", 262144)), layers=27,
                             intermediate=4304, image_size=896, patch_size=14)
        vision = Gemma3VisionConfig(
            tower=tower, mm_tokens_per_image=int(raw.get("mm_tokens_per_image", 256)),
            image_token_id=tower.image_token_id,
            boi_token_id=int(raw.get("boi_token_index", 255999)),
            eoi_token_id=int(raw.get("eoi_token_index", 256000)))
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptModelError(f"config.json is missing or has a bad Gemma 3 vision field: {exc}") from exc
    side = int(round(vision.mm_tokens_per_image ** 0.5))
    if side * side != vision.mm_tokens_per_image or vision.patches_per_side % side:
        raise CorruptModelError(
            f"Gemma 3: mm_tokens_per_image ({vision.mm_tokens_per_image}) is not a square grid "
            f"that divides the {vision.patches_per_side} x {vision.patches_per_side} patches")
    if tower.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
        raise UnsupportedModelError(f"Gemma 3 vision activation {tower.hidden_act!r} is not supported")
    return vision


def qwen_vl_parts(raw: dict[str, Any], kind: str) -> tuple[dict[str, Any], QwenVisionConfig]:
    """A Qwen-VL ``config.json``'s language model config (``text_config`` in transformers
    5, the top level in older configs; M-RoPE's fields taken out) and vision config."""
    try:
        vis = dict(raw["vision_config"])
        text = dict(raw.get("text_config") or {k: v for k, v in raw.items() if k != "vision_config"})
        text["architectures"] = [QWEN_VL_TEXT[kind]]
        text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        if raw.get("tie_word_embeddings"):
            text["tie_word_embeddings"] = True
        text.setdefault("torch_dtype", raw.get("torch_dtype") or raw.get("dtype"))
        # M-RoPE's section list rides in rope_scaling ({"type": "mrope"}, transformers 4)
        # or rope_parameters (transformers 5); the frequencies are the default ones.
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or raw.get("rope_scaling") or {})
        section = tuple(int(s) for s in rope.pop("mrope_section", ()))
        if not section:
            raise UnsupportedModelError(f"{kind} without rope mrope_section is not supported")
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
            raise UnsupportedModelError(
                f"{kind} with rope type {rope.get('rope_type', rope.get('type'))!r} is not supported")
        text.pop("rope_scaling", None)
        text.pop("rope_parameters", None)
        text["rope_theta"] = float(rope.get("rope_theta", text.get("rope_theta", raw.get("rope_theta", 1e6))))
        vision_rope = vis.get("rope_parameters") or {}
        qwen2 = kind == "qwen2_vl"
        qwen3 = kind.startswith("qwen3")
        width = int(vis["embed_dim"] if qwen2 else vis["hidden_size"])
        act = "quick_gelu" if qwen2 else "gelu_pytorch_tanh" if qwen3 else "silu"
        vision = QwenVisionConfig(
            kind=kind,
            depth=int(vis["depth"]),
            hidden_size=width,
            intermediate_size=int(width * vis.get("mlp_ratio", 4)) if qwen2 else int(vis["intermediate_size"]),
            num_heads=int(vis["num_heads"]),
            patch_size=int(vis.get("patch_size", 16 if qwen3 else 14)),
            temporal_patch_size=int(vis.get("temporal_patch_size", 2)),
            spatial_merge_size=int(vis.get("spatial_merge_size", 2)),
            in_channels=int(vis.get("in_channels", vis.get("in_chans", 3))),
            hidden_act=str(vis.get("hidden_act", act)),
            out_hidden_size=int(vis["hidden_size"] if qwen2 else vis["out_hidden_size"]),
            rope_theta=float(vision_rope.get("rope_theta", 10000.0)),
            window_size=int(vis.get("window_size", 112)) if kind == "qwen2_5_vl" else 0,
            fullatt_block_indexes=(tuple(int(i) for i in vis.get("fullatt_block_indexes", ()))
                                   if kind == "qwen2_5_vl" else ()),
            image_token_id=int(raw.get("image_token_id", 151655)),
            vision_start_token_id=int(raw.get("vision_start_token_id", 151652)),
            vision_end_token_id=int(raw.get("vision_end_token_id", 151653)),
            mrope_section=section,
            mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
            num_position_embeddings=int(vis.get("num_position_embeddings", 2304)) if qwen3 else 0,
            deepstack_visual_indexes=(tuple(int(i) for i in vis.get("deepstack_visual_indexes", (8, 16, 24)))
                                      if qwen3 else ()),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptModelError(f"config.json is missing or has a bad {kind} field: {exc}") from exc
    if vision.hidden_act not in ("quick_gelu", "gelu", "silu", "gelu_pytorch_tanh"):
        raise UnsupportedModelError(f"{kind} vision activation {vision.hidden_act!r} is not supported")
    if vision.hidden_size % vision.num_heads or (vision.hidden_size // vision.num_heads) % 4:
        raise CorruptModelError(f"{kind} vision width {vision.hidden_size} over {vision.num_heads} "
                                "heads: the head size must be a multiple of 4 (2-D RoPE)")
    if qwen3:
        side = int(round(vision.num_position_embeddings ** 0.5))
        if side * side != vision.num_position_embeddings or side < 2:
            raise CorruptModelError(f"{kind} num_position_embeddings {vision.num_position_embeddings} "
                                    "is not a square grid")
        bad = [i for i in vision.deepstack_visual_indexes if not 0 <= i < vision.depth]
        if bad:
            raise CorruptModelError(f"{kind} deepstack_visual_indexes {bad} are not blocks of the "
                                    f"{vision.depth}")
    return text, vision


# Idefics3 and SmolVLM (models/idefics3.py): a SigLIP tower over each tile of an image cut
# into tiles (and the whole image shrunk to one), pixel-shuffled and projected, in front of
# a Llama decoder.
IDEFICS3_ARCHITECTURES = {"Idefics3ForConditionalGeneration": "idefics3",
                          "SmolVLMForConditionalGeneration": "smolvlm"}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Idefics3VisionConfig:
    """Idefics3's / SmolVLM's tower (SigLIP, every layer, then ``post_layernorm``: ``tower``)
    and connector: each tile's ``(image_size / patch_size)**2`` patch states are
    pixel-shuffled (``scale_factor x scale_factor`` neighbours concatenated) and projected
    to the decoder's width, ``num_image_tokens`` placeholders a tile. The image processor
    cuts an image into rows x columns tiles plus the whole image (the global tile); the
    prompt frames them with ``<fake_token_around_image>``, ``<row_R_col_C>`` and
    ``<global-img>`` tokens (engine.image_tiles)."""

    tower: VisionConfig
    scale_factor: int
    image_token_id: int
    kind: str = "idefics3"  # or "smolvlm"

    @property
    def num_image_tokens(self) -> int:
        """Placeholders a tile."""
        side = self.tower.image_size // self.tower.patch_size
        return side * side // (self.scale_factor * self.scale_factor)


def idefics3_parts(raw: dict[str, Any], kind: str) -> tuple[dict[str, Any], Idefics3VisionConfig]:
    """An Idefics3 / SmolVLM ``config.json``'s language model config (``text_config``, a
    Llama) and its tower and connector (transformers' defaults where it is silent)."""
    try:
        text = dict(raw["text_config"])
        vis = dict(raw.get("vision_config") or {})
        text.setdefault("architectures", ["LlamaForCausalLM"])
        text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        text.setdefault("torch_dtype", raw.get("torch_dtype") or raw.get("dtype"))
        tower = siglip_tower(vis, int(raw.get("image_token_id", 128257)), layers=12,
                             intermediate=3072, image_size=224, patch_size=32)
        vision = Idefics3VisionConfig(tower=tower, scale_factor=int(raw.get("scale_factor", 2)),
                                      image_token_id=tower.image_token_id, kind=kind)
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptModelError(f"config.json is missing or has a bad {kind} field: {exc}") from exc
    side = tower.image_size // tower.patch_size
    if side < 1 or side % vision.scale_factor or tower.image_size % tower.patch_size:
        raise CorruptModelError(f"{kind}: image_size {tower.image_size} / patch_size {tower.patch_size} "
                                f"is not a whole grid that scale_factor {vision.scale_factor} divides")
    if tower.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
        raise UnsupportedModelError(f"{kind} vision activation {tower.hidden_act!r} is not supported")
    return text, vision


# InternVL (models/internvl.py): InternViT over each tile of an image (and a thumbnail),
# pixel-shuffled and projected, in front of a Qwen2 / Qwen3 / Llama decoder.
INTERNVL_ARCHITECTURES = {"InternVLForConditionalGeneration": "internvl"}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class InternVLVisionConfig:
    """InternVL's tower (InternViT: a CLS position, learned positions, pre-norm layers with
    layer scale, optional q/k RMSNorm over the whole width) and projector (LayerNorm,
    Linear, GELU, Linear) after a pixel shuffle of ``downsample_ratio``. The image
    processor (``GotOcr2ImageProcessor``) crops an image into tiles of ``image_size`` plus
    a thumbnail; the prompt writes ``<img>``, ``num_image_tokens`` placeholders a tile,
    ``</img>``."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    norm_type: str  # "layer_norm" or "rms_norm"
    qk_norm: bool
    attention_bias: bool
    hidden_act: str
    final_norm: bool  # use_mean_pooling false: a LayerNorm after the last layer
    downsample_ratio: float
    projector_act: str
    image_token_id: int
    kind: str = "internvl"

    @property
    def scale(self) -> int:
        """The pixel shuffle's block side (1 / downsample_ratio)."""
        return int(round(1 / self.downsample_ratio))

    @property
    def num_image_tokens(self) -> int:
        """Placeholders a tile."""
        side = self.image_size // self.patch_size
        return (side // self.scale) ** 2


def internvl_parts(raw: dict[str, Any]) -> tuple[dict[str, Any], InternVLVisionConfig]:
    """An InternVL ``config.json``'s language model config (``text_config``) and tower."""
    try:
        text = dict(raw["text_config"])
        vis = dict(raw.get("vision_config") or {})
        text.setdefault("architectures", [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                           "llama": "LlamaForCausalLM"}.get(text.get("model_type", "qwen2"),
                                                                            "Qwen2ForCausalLM")])
        text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        text.setdefault("torch_dtype", raw.get("torch_dtype") or raw.get("dtype"))

        def side(value: Any, default: int) -> int:
            value = default if value is None else value
            if isinstance(value, (list, tuple)):
                if len(set(value)) != 1:
                    raise UnsupportedModelError(f"InternVL with a non-square {value} is not supported")
                value = value[0]
            return int(value)

        vision = InternVLVisionConfig(
            hidden_size=int(vis.get("hidden_size", 1024)),
            intermediate_size=int(vis.get("intermediate_size", 4096)),
            num_hidden_layers=int(vis.get("num_hidden_layers", 24)),
            num_attention_heads=int(vis.get("num_attention_heads", 16)),
            image_size=side(vis.get("image_size"), 448), patch_size=side(vis.get("patch_size"), 14),
            num_channels=int(vis.get("num_channels", 3)),
            layer_norm_eps=float(vis.get("layer_norm_eps", 1e-6)),
            norm_type=str(vis.get("norm_type", "layer_norm")),
            qk_norm=bool(vis.get("use_qk_norm", False)),
            attention_bias=bool(vis.get("attention_bias", False)),
            hidden_act=str(vis.get("hidden_act", "gelu")),
            final_norm=not vis.get("use_mean_pooling", True),
            downsample_ratio=float(raw.get("downsample_ratio", 0.5)),
            projector_act=str(raw.get("projector_hidden_act", "gelu")),
            image_token_id=int(raw.get("image_token_id", 151667)))
        layer = raw.get("vision_feature_layer", -1)
        strategy = raw.get("vision_feature_select_strategy", "default")
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptModelError(f"config.json is missing or has a bad InternVL field: {exc}") from exc
    if layer != -1 or strategy != "default":
        raise UnsupportedModelError(f"InternVL with vision_feature_layer {layer!r} / select strategy "
                                    f"{strategy!r} is not supported (-1, default are)")
    if vision.norm_type not in ("layer_norm", "rms_norm") or vis.get("use_mask_token") or not vis.get(
            "use_absolute_position_embeddings", True):
        raise UnsupportedModelError("InternVL's tower: norm_type layer_norm or rms_norm with absolute "
                                    "positions and no mask token is supported")
    grid = vision.image_size // vision.patch_size
    if vision.image_size % vision.patch_size or grid % vision.scale or vision.scale * vision.downsample_ratio != 1:
        raise CorruptModelError(f"InternVL: image_size {vision.image_size} / patch_size {vision.patch_size} "
                                f"is not a grid that downsample_ratio {vision.downsample_ratio} shuffles")
    for act in (vision.hidden_act, vision.projector_act):
        if act not in ("gelu", "gelu_pytorch_tanh", "quick_gelu"):
            raise UnsupportedModelError(f"InternVL activation {act!r} is not supported")
    return text, vision
