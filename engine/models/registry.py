"""The model registry: which class builds the model a config describes.

Every family module is imported here and only here; a family never imports another, nor
this registry. Adding a family is one module and one entry in :data:`MODEL_CLASSES`.

A model class offers, besides its constructor ``(config, weights, ops, *, dtype, device)``
(the decoders also take ``tp``), two class-level hooks the loader reads through
:func:`model_class`: ``weight_names(config)`` (the checkpoint tensors it reads, in
checkpoint order) and ``checkpoint_name(name)`` (a stored tensor's name under those).
"""

from __future__ import annotations

import torch

from engine.errors import CorruptModelError, UnsupportedModelError
from engine.models.audio_config import AudioConfig
from engine.models.bert import BertModel
from engine.models.cohere import CohereModel
from engine.models.config import ModelConfig
from engine.models.deepseek import DeepseekModel
from engine.models.ernie import ErnieModel
from engine.models.falcon_h1 import FalconH1Model
from engine.models.gemma import Gemma3VisionModel, GemmaModel
from engine.models.glm4 import Glm4Model
from engine.models.gpt2 import GPT2Model
from engine.models.gpt_bigcode import GPTBigCodeModel
from engine.models.gpt_neox import GPTNeoXModel
from engine.models.gpt_oss import GptOssModel
from engine.models.granite4 import GraniteHybridModel
from engine.models.idefics3 import Idefics3Model
from engine.models.internvl import InternVLModel
from engine.models.jamba import JambaModel
from engine.models.layers.decoder import Decoder
from engine.models.layers.shard import check_tensor_parallel
from engine.models.llama import LlamaModel
from engine.models.llava import LlavaModel
from engine.models.modernbert import ModernBertModel
from engine.models.nemotron_h import Mamba2Model, MambaModel, NemotronHModel
from engine.models.olmo import OlmoModel
from engine.models.olmoe import OlmoeModel
from engine.models.opt import OPTModel
from engine.models.phi import PhiModel
from engine.models.qwen2_audio import Qwen2AudioModel
from engine.models.qwen3_5 import Qwen35Model
from engine.models.qwen_vl import QwenVLModel
from engine.models.starcoder2 import Starcoder2Model
from engine.models.vision_config import (
    Gemma3VisionConfig,
    Idefics3VisionConfig,
    InternVLVisionConfig,
)
from engine.models.whisper import WhisperModel
from engine.ops import Ops
from engine.parallel import SINGLE, TensorParallel

# Architecture name -> model class. The names are ModelConfig.architecture's (the
# families of engine.models.config's *_ARCHITECTURES), and for a vision-language model,
# whose config.architecture is its text decoder's, the model's own (see architecture_name).
MODEL_CLASSES: dict[str, type] = {
    "llama": LlamaModel,
    "mistral": LlamaModel,
    "qwen2": LlamaModel,
    "qwen3": LlamaModel,
    "phi3": LlamaModel,
    "smollm3": LlamaModel,
    "ernie4_5": ErnieModel,
    "ernie4_5_moe": ErnieModel,
    "granite": LlamaModel,
    "granite_moe": LlamaModel,
    "granite_hybrid": GraniteHybridModel,
    "nemotron_h": NemotronHModel,
    "falcon_h1": FalconH1Model,
    "mamba2": Mamba2Model,
    "mamba": MambaModel,
    "falcon_mamba": MambaModel,
    "jamba": JambaModel,
    "qwen3_5": Qwen35Model,
    "qwen3_5_moe": Qwen35Model,
    "qwen3_next": Qwen35Model,
    "olmo2": OlmoModel,
    "olmo3": OlmoModel,
    "exaone4": OlmoModel,
    "mixtral": LlamaModel,
    "qwen2_moe": LlamaModel,
    "qwen3_moe": LlamaModel,
    "olmoe": OlmoeModel,
    "glm4_moe": LlamaModel,
    "glm4": Glm4Model,
    "starcoder2": Starcoder2Model,
    "gpt_neox": GPTNeoXModel,
    "phi": PhiModel,
    "cohere": CohereModel,
    "cohere2": CohereModel,
    "deepseek_v3": DeepseekModel,
    "deepseek_v2": DeepseekModel,
    "gpt_oss": GptOssModel,
    "gemma": GemmaModel,
    "gemma2": GemmaModel,
    "gemma3": GemmaModel,
    "gpt2": GPT2Model,
    "opt": OPTModel,
    "gpt_bigcode": GPTBigCodeModel,
    "bert": BertModel,
    "bert_classifier": BertModel,
    "bert_token_classifier": BertModel,
    "modernbert": ModernBertModel,
    "modernbert_classifier": ModernBertModel,
    "modernbert_token_classifier": ModernBertModel,
    "llava": LlavaModel,
    "gemma3_vision": Gemma3VisionModel,
    "qwen2_vl": QwenVLModel,
    "qwen2_5_vl": QwenVLModel,
    "qwen3_vl": QwenVLModel,
    "idefics3": Idefics3Model,
    "internvl": InternVLModel,
    "qwen3_vl_moe": QwenVLModel,
    "qwen2_audio": Qwen2AudioModel,
    "whisper": WhisperModel,
}


def architecture_name(config: ModelConfig) -> str:
    """The name :data:`MODEL_CLASSES` files ``config``'s model under."""
    if config.mrope:
        return config.vision.kind  # type: ignore[union-attr]  # QwenVisionConfig: "qwen2_vl", "qwen3_vl", ...
    if isinstance(config.vision, Gemma3VisionConfig):
        return "gemma3_vision"
    if isinstance(config.vision, Idefics3VisionConfig):
        return "idefics3"  # SmolVLM's too
    if isinstance(config.vision, InternVLVisionConfig):
        return "internvl"
    if isinstance(config.vision, AudioConfig):
        return config.vision.kind
    if config.vision is not None:
        return "llava"
    return config.architecture


def model_class(config: ModelConfig) -> type:
    """The class that builds ``config``'s model."""
    name = architecture_name(config)
    try:
        return MODEL_CLASSES[name]
    except KeyError:
        raise UnsupportedModelError(f"no model class for architecture {name!r}") from None


def build_model(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    ops: Ops,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    tp: TensorParallel = SINGLE,
) -> Decoder | BertModel | ModernBertModel:
    """Build the decoder (or encoder) for ``config``, or with ``tp`` rank ``tp.rank``'s
    slice of it; raises a typed error for an unusable config (one that cannot be split
    over ``tp.world_size`` ranks included)."""
    check_tensor_parallel(config, tp)
    cls = model_class(config)
    if config.is_encoder:
        return cls(config, weights, ops, dtype=dtype, device=device)
    if config.num_hidden_layers < 1:
        raise CorruptModelError("config.json: num_hidden_layers must be at least 1")
    if config.num_attention_heads % config.num_key_value_heads:
        raise CorruptModelError(
            f"config.json: num_attention_heads ({config.num_attention_heads}) is not a multiple "
            f"of num_key_value_heads ({config.num_key_value_heads})"
        )
    if config.vision is not None and not isinstance(config.vision, Gemma3VisionConfig):
        # LLaVA and Qwen-VL: one rank only (check_tensor_parallel refuses more).
        return cls(config, weights, ops, dtype=dtype, device=device)
    return cls(config, weights, ops, dtype=dtype, device=device, tp=tp)


__all__ = ["MODEL_CLASSES", "architecture_name", "build_model", "model_class"]
