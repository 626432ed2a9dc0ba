"""The model's shape, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.errors import CorruptModelError, UnsupportedModelError
from engine.models import audio_config as audio
from engine.models.absolute_config import ABSOLUTE_ARCHITECTURES, AbsoluteConfig, absolute_fields
from engine.models.decoder_fields import (
    GEMMA_FAMILY,
    MlaConfig,
    bidirectional_window,
    check_biases,
    gpt_neox_raw,
    granite_hybrid_raw,
    granite_multipliers,
    mla_fields,
    nope_layers,
    rotary_dim,
)
from engine.models.deltanet_config import DeltaNetConfig, deltanet_fields
from engine.models.encoder_config import (
    DECODER_CLASSIFIER_ARCHITECTURES,
    ENCODER_ARCHITECTURES,
    ModernBertConfig,
    decoder_classifier_fields,
    encoder_fields,
    matryoshka,
)
from engine.models.mamba_config import (
    FalconH1Multipliers,
    Mamba1Config,
    MambaConfig,
    falcon_h1_multipliers,
    mamba1_fields,
    mamba_fields,
    recurrent_raw,
)
from engine.models.moe_config import MoeConfig
from engine.models.vision_config import (
    IDEFICS3_ARCHITECTURES,
    INTERNVL_ARCHITECTURES,
    QWEN_VL_ARCHITECTURES,
    VISION_ARCHITECTURES,
    Gemma3VisionConfig,
    Idefics3VisionConfig,
    InternVLVisionConfig,
    QwenVisionConfig,
    VisionConfig,
    gemma3_vision_config,
    idefics3_parts,
    internvl_parts,
    qwen_vl_parts,
)

# Hugging Face architecture -> family. The Llama family's decoder layer is the Llama layer
# with small variations: Qwen2 adds q/k/v biases, Qwen3 per-head RMSNorm on q and k,
# Mistral a sliding window, Phi-3 stores q/k/v and gate/up fused, SmolLM3 leaves RoPE out of
# every fourth layer (ModelConfig.nope_layers), Granite scales embeddings, block outputs,
# attention scores and logits by its multipliers. Gemma has its own layer
# (models/gemma.py): "1 + w" norms in fp32, GeGLU, scaled embeddings; Gemma 2/3 add four
# norms per layer, soft-capping and local/global layers.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "SmolLM3ForCausalLM": "smollm3",
    # ERNIE 4.5's dense models (models/ernie.py): the Llama layer, RoPE on interleaved pairs.
    "Ernie4_5ForCausalLM": "ernie4_5",
    # ... and its MoE models: softmax routing with a selection bias, ungated shared experts.
    "Ernie4_5_MoeForCausalLM": "ernie4_5_moe",
    "GraniteForCausalLM": "granite",
    "GraniteMoeForCausalLM": "granite_moe",  # Granite's multipliers, MoE on every layer
    # Granite 4 (models/granite4.py): Granite's layer with its MLP named shared_mlp, Mamba-2
    # in place of attention in the hybrid ("h") models' layers, experts in the MoE ones.
    "GraniteMoeHybridForCausalLM": "granite_hybrid",
    # NVIDIA's Nemotron-H (models/nemotron_h.py): Mamba-2, attention and MLP layers, one block each.
    "NemotronHForCausalLM": "nemotron_h",
    # TII's Falcon-H1 (models/falcon_h1.py): attention and a Mamba-2 mixer side by side in
    # every layer, muP multipliers throughout.
    "FalconH1ForCausalLM": "falcon_h1",
    "Mamba2ForCausalLM": "mamba2",  # Mamba-2 alone (models/nemotron_h.py): a Mamba block a layer
    "MambaForCausalLM": "mamba",  # Mamba-1's selective scan, a block a layer (models/nemotron_h.py)
    "FalconMambaForCausalLM": "falcon_mamba",  # ... with dt, B and C RMS-normed
    "JambaForCausalLM": "jamba",  # Mamba-1 and positionless attention layers, experts (models/jamba.py)
    # Qwen3.5 (models/qwen3_5.py): Gated DeltaNet layers between gated attention layers.
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",  # its MLPs Qwen2-MoE's routed and gated shared experts
    "Qwen3NextForCausalLM": "qwen3_next",  # Qwen3.5-MoE's layers, its DeltaNet projections grouped by key head
    # OLMo (models/olmo.py): norms after each block, q/k normed across all heads.
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo3",
    # EXAONE 4 (models/olmo.py too): OLMo's layout with Llama's norms, per-head q/k norms,
    # and global layers without RoPE between sliding ones.
    "Exaone4ForCausalLM": "exaone4",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    # Mixture of experts (engine/models/layers/moe.py): the Llama layer with a routed expert MLP.
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    # OLMoE (models/olmoe.py): the Llama layer with q/k norms across all heads, experts on
    # every layer.
    "OlmoeForCausalLM": "olmoe",
    # GLM-4.5 / 4.6 (and -Air): the Llama layer with a partial rotary (half of each head by
    # default), optional q/k norms, and DeepSeek-V3's MoE routing (sigmoid scores, a
    # selection bias, expert groups, a scaling factor) with an ungated shared expert, after
    # first_k_dense_replace dense layers.
    "Glm4MoeForCausalLM": "glm4_moe",
    # GLM-4 (-0414, GLM-Z1; models/glm4.py): the Llama layer with norms after each block
    # too, gate/up stored fused, RoPE on interleaved pairs of half of each head.
    "Glm4ForCausalLM": "glm4",
    # Cohere's Command R (models/cohere.py): attention and the MLP side by side on one
    # LayerNorm, RoPE on interleaved pairs, scaled logits; Command R7B and A (Cohere2) add
    # sliding layers, the global ones without RoPE.
    # StarCoder2 (models/starcoder2.py): LayerNorm with biases, biases on every projection,
    # a plain GELU MLP (c_fc, c_proj), a sliding window on every layer.
    "Starcoder2ForCausalLM": "starcoder2",
    # GPT-NeoX (models/gpt_neox.py: Pythia, Dolly, RedPajama-INCITE): attention and the MLP
    # side by side on two LayerNorms, a quarter of each head rotated, biases throughout.
    "GPTNeoXForCausalLM": "gpt_neox",
    # Phi-1, 1.5 and 2 (models/phi.py): attention and a plain MLP side by side on one
    # LayerNorm, part of each head rotated, biases throughout, the head's too.
    "PhiForCausalLM": "phi",
    "CohereForCausalLM": "cohere",
    "Cohere2ForCausalLM": "cohere2",
    # DeepSeek-V3 and R1 (and Kimi K2's layers; models/deepseek.py): multi-head latent attention, GLM-4.5's
    # routing (which is DeepSeek-V3's) with ungated shared experts.
    "DeepseekV3ForCausalLM": "deepseek_v3",
    # DeepSeek-V2 (V2-Lite, Coder-V2): the same attention, softmax routing with groups.
    "DeepseekV2ForCausalLM": "deepseek_v2",
    # gpt-oss (models/gpt_oss.py): biased attention with sinks, every layer a biased MoE
    # with a clamped SwiGLU, sliding and full layers alternating.
    "GptOssForCausalLM": "gpt_oss",
}

# Vision-language checkpoints served as their text model (ModelConfig.text_of): the
# language model's config (text_config, which must be of the named model_type) and weights
# only. The vision tower is not loaded, so a request's image is refused as for any
# text-only model (a 400), never dropped.
TEXT_PART_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", "gemma3_text"),
    "Mistral3ForConditionalGeneration": ("MistralForCausalLM", "mistral"),
    "Qwen3_5ForConditionalGeneration": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "Qwen3_5MoeForConditionalGeneration": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
    audio.QWEN2_AUDIO: ("Qwen2ForCausalLM", "qwen2"),  # with its audio tower (audio_config.py)
}
# The same decoders saved without their LM head (transformers' base classes), as embedding
# models such as Qwen3-Embedding are: weights without the "model." prefix, no lm_head.
# They pool (engine.models.pooling); they cannot generate.
BASE_MODEL_ARCHITECTURES = {
    "LlamaModel": "llama",
    "MistralModel": "mistral",
    "Qwen2Model": "qwen2",
    "Qwen3Model": "qwen3",
    "Gemma3TextModel": "gemma3",  # EmbeddingGemma
}

# The rope_scaling types models/layers/rope.py computes (``su`` is Phi-3's older name of longrope).
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope", "su")

# hidden_act values -> the MLP's gated activation.
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES' values
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None  # the model's window, for the layers that have one
    # Per layer: the sliding window it attends within (its last N positions), 0 for full
    # attention. Mistral windows every layer, Qwen2/3 the layers from max_window_layers on.
    layer_windows: tuple[int, ...]
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None  # as written in config.json, e.g. "bfloat16"
    # The gated MLP's: "silu" (SwiGLU) or "gelu_tanh" (GeGLU); GPT-2's and OPT's plain MLP's:
    # "gelu_tanh", "gelu" or "relu".
    activation: str = "silu"
    # Gemma: attention scale is query_pre_attn_scalar ** -0.5 (else head_dim ** -0.5);
    # soft-capping cap * tanh(x / cap) of attention scores and of final logits (0: none).
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0
    # Gemma 3: the RoPE base of the sliding (local) layers, which take no rope scaling;
    # None: every layer uses rope_theta and rope_scaling.
    rope_local_theta: float | None = None
    moe: MoeConfig | None = None  # the sparse MLP of a mixture-of-experts model
    # Layers that attend without RoPE (SmolLM3's NoPE layers: every fourth by default).
    nope_layers: tuple[int, ...] = ()
    # The share of each head RoPE rotates (its first values); 0: all head_dim of them. Below
    # head_dim: a partial rotary (Phi-4-mini's partial_rotary_factor 0.75).
    rotary_dim: int = 0
    # Granite's multipliers (1 elsewhere): embeddings x embedding_multiplier, each block's
    # output x residual_multiplier before it joins the residual stream, logits / logits_scaling;
    # attention_multiplier is the attention scale in place of head_dim ** -0.5 (None: that).
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_multiplier: float | None = None
    logit_scale: float = 1.0  # Cohere's: logits x logit_scale (in the model dtype)
    parallel_residual: bool = False  # GPT-NeoX's use_parallel_residual: x + attn(ln1(x)) + mlp(ln2(x))
    # A decoder with a sequence classifier head (DECODER_CLASSIFIER_ARCHITECTURES): it pools
    # its last token through ``score`` (num_labels, labels). Converted from a causal LM's two
    # tokens (classifier_from_tokens: [false, true]), its head is the true token's LM-head row
    # less the false one's; the loader reads their ids from the tokenizer.
    # A vision-language checkpoint served as its text model (TEXT_PART_ARCHITECTURES): its
    # architecture name; the loader reads the language model's weights out of it.
    text_of: str | None = None
    seq_classifier: bool = False
    classifier_from_tokens: tuple[str, str] | None = None
    classifier_token_ids: tuple[int, int] | None = None

    @property
    def rope_dim(self) -> int:
        """The values of each head that RoPE rotates (a cos/sin table's width)."""
        return self.rotary_dim or self.head_dim
    # Encoders (ENCODER_ARCHITECTURES): learned absolute positions, token types, LayerNorm.
    type_vocab_size: int = 0
    # "bert", or "roberta" (RoBERTa, XLM-RoBERTa): a token's position row is pad_token_id + 1
    # + its index among the sequence's non-pad tokens (a pad token's is pad_token_id), the
    # weights sit under "roberta." in a head's checkpoint, and a sequence classifier's head
    # is classifier.dense + tanh + classifier.out_proj on the first token (no pooler).
    encoder_kind: str = "bert"
    pad_token_id: int | None = None
    # Output classes of a sequence classifier (cross-encoder); 0 for other models.
    num_labels: int = 0
    # Their names, by index (config.json's id2label; transformers' LABEL_i where it has none).
    labels: tuple[str, ...] = ()
    # The [SEP] id that closes segment A of a BERT pair: token types are 1 after it. Set by
    # the loader from the tokenizer (config.json does not name it); None: single segments.
    sep_token_id: int | None = None
    # The embedding may be cut to its first N dimensions (Matryoshka training), as
    # config.json's is_matryoshka / matryoshka_dimensions say; None: every dimension only.
    matryoshka_dimensions: tuple[int, ...] | None = None
    # A decoder saved without its LM head (BASE_MODEL_ARCHITECTURES): it only pools.
    base_model: bool = False
    # Every token attends to every other (EmbeddingGemma's use_bidirectional_attention;
    # sliding layers within the window either side): prompts prefill whole, uncached.
    bidirectional: bool = False
    # DeepSeek-V3's multi-head latent attention (decoder_fields.MlaConfig); None elsewhere.
    mla: MlaConfig | None = None
    # Granite 4's and Nemotron-H's Mamba-2 layers (mamba_config.MambaConfig), Qwen3.5's
    # Gated DeltaNet layers (deltanet_config.DeltaNetConfig); None: every layer attends.
    mamba: MambaConfig | None = None
    deltanet: DeltaNetConfig | None = None
    falcon_h1: FalconH1Multipliers | None = None  # Falcon-H1's multipliers (mamba_config)
    mamba1: Mamba1Config | None = None  # Mamba-1's selective-scan layers (Mamba, FalconMamba)
    # A multimodal model's encoder: a vision tower (LLaVA, Qwen-VL, Gemma 3, SmolVLM) or an audio
    # tower (Qwen2-Audio); None for a text-only model.
    vision: (VisionConfig | QwenVisionConfig | Gemma3VisionConfig | Idefics3VisionConfig
             | InternVLVisionConfig | audio.AudioConfig | None) = None
    # GPT-2 and OPT (ABSOLUTE_ARCHITECTURES): learned positions, LayerNorm; None otherwise.
    absolute: AbsoluteConfig | None = None
    # ModernBERT (models/modernbert.py): its local layers, their window and RoPE base, its
    # biases and classifier pooling; None for every other model.
    modernbert: ModernBertConfig | None = None

    @property
    def recurrent(self) -> MambaConfig | DeltaNetConfig | Mamba1Config | None:
        """The layers that keep a recurrent state a request instead of KV blocks (Mamba-2,
        Gated DeltaNet, Mamba-1), or None: what the runner's state slots and the engine's rules read."""
        return self.mamba or self.deltanet or self.mamba1

    @property
    def cache_layers_per_layer(self) -> int:
        """How many of ``num_hidden_layers`` (cache layers) one decoder layer is: two for
        Falcon-H1 (attention, then its mixer's states), one for every other model. A
        pipeline stage holds whole layers."""
        return 2 if self.falcon_h1 is not None else 1

    @property
    def mrope(self) -> bool:
        """Positions are M-RoPE's three streams (Qwen-VL): the runner gives ``[3, T]``."""
        return isinstance(self.vision, QwenVisionConfig)

    @property
    def is_encoder(self) -> bool:
        """A bidirectional encoder: no KV cache, no chunking, no generation."""
        return self.architecture in ENCODER_ARCHITECTURES.values()

    @property
    def released_window(self) -> int:
        """The window every layer slides (its smallest), 0 when some layer sees the whole
        context: KV blocks before a request's last ``released_window`` positions are
        read by no layer, so the scheduler gives them back to the pool."""
        return min(self.layer_windows) if self.layer_windows and all(self.layer_windows) else 0

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a parsed ``config.json``; raises a typed error naming the problem."""
        archs = raw.get("architectures") or []
        text_part = next((a for a in archs if a in TEXT_PART_ARCHITECTURES), None)
        if text_part is not None:
            return _text_part_config(raw, text_part)
        if any(a in VISION_ARCHITECTURES for a in archs):
            return _llava_config(raw)
        qwen_vl = next((QWEN_VL_ARCHITECTURES[a] for a in archs if a in QWEN_VL_ARCHITECTURES), None)
        if qwen_vl is not None:
            return _qwen_vl_config(raw, qwen_vl)
        tiled = next((IDEFICS3_ARCHITECTURES[a] for a in archs if a in IDEFICS3_ARCHITECTURES), None)
        if tiled is not None:  # Idefics3 / SmolVLM: a Llama decoder
            text, tiles = idefics3_parts(raw, tiled)
            lm = ModelConfig.from_hf(text)
            if lm.is_encoder or lm.architecture != "llama":
                raise UnsupportedModelError(f"{tiled} over a {lm.architecture} language model is not supported")
            return dataclasses.replace(lm, vision=tiles)
        if any(a in INTERNVL_ARCHITECTURES for a in archs):  # over Qwen2 / Qwen3 / Llama
            text, internvl = internvl_parts(raw)
            lm = ModelConfig.from_hf(text)
            if lm.is_encoder or lm.architecture not in ("qwen2", "qwen3", "llama"):
                raise UnsupportedModelError(f"InternVL over a {lm.architecture} language model is not supported")
            return dataclasses.replace(lm, vision=internvl)
        encoder = next((a for a in archs if a in ENCODER_ARCHITECTURES), None)
        if encoder is not None:
            return cls(**encoder_fields(raw, encoder))
        absolute = next((ABSOLUTE_ARCHITECTURES[a] for a in archs if a in ABSOLUTE_ARCHITECTURES), None)
        if absolute is not None:
            return cls(**absolute_fields(raw, absolute))
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        base = arch is None and any(a in BASE_MODEL_ARCHITECTURES for a in archs)
        if base:
            arch = next(BASE_MODEL_ARCHITECTURES[a] for a in archs if a in BASE_MODEL_ARCHITECTURES)
        if arch == "granite_hybrid":
            raw = granite_hybrid_raw(raw)
        elif arch == "qwen3_5_moe":  # every MLP is the experts': no dense width
            raw = {"intermediate_size": raw.get("moe_intermediate_size", 0), **raw}
        elif arch == "gpt_neox":
            raw = gpt_neox_raw(raw)
        raw = recurrent_raw(raw, arch)  # Nemotron-H, Falcon-H1, the Mamba families
        classifier = {}
        if arch is None and any(a in DECODER_CLASSIFIER_ARCHITECTURES for a in archs):
            arch = next(DECODER_CLASSIFIER_ARCHITECTURES[a] for a in archs if a in DECODER_CLASSIFIER_ARCHITECTURES)
            classifier = decoder_classifier_fields(raw)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; supported: "
                f"{', '.join(sorted({**SUPPORTED_ARCHITECTURES, **ABSOLUTE_ARCHITECTURES, **BASE_MODEL_ARCHITECTURES, **DECODER_CLASSIFIER_ARCHITECTURES, **ENCODER_ARCHITECTURES}))}"
            )
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
            bidirectional, window = bidirectional_window(raw, arch, int(window) if window else 0)
            max_positions = int(raw.get("max_position_embeddings", 2048))
            layers = int(raw["num_hidden_layers"])
            rope_theta, rope_scaling, local_theta = _rope(raw, arch)
            activation = _activation(raw, arch)
            gemma = arch in GEMMA_FAMILY
            head_dim = int(raw.get("head_dim") or hidden // heads)
            attention_bias = bool(raw.get("attention_bias", raw.get("qkv_bias", arch in ("qwen2", "qwen2_moe", "gpt_oss"))))
            if arch == "starcoder2":  # its use_bias puts biases on every projection
                attention_bias = bool(raw.get("use_bias", True))
            elif arch == "phi":  # always
                attention_bias = True
            check_biases(raw, arch, attention_bias)
            nope = nope_layers(raw, arch, layers)
            windows = _layer_windows(raw, arch, int(window) if window else 0, layers, nope)
            if arch in ("exaone4", "cohere2") and window:  # its global layers take no RoPE in a hybrid model
                nope = tuple(i for i, w in enumerate(windows) if not w)
            mla = mla_fields(raw, arch)  # DeepSeek-V3's key width, KV heads and rotated share
            head_dim = mla.get("head_dim", head_dim)
            rotary = mla.get("rotary_dim") or rotary_dim(raw, arch, head_dim)
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=int(mla.get("num_key_value_heads") or raw.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=_max_positions(max_positions, rope_scaling),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                # Qwen2-MoE names its q/k/v bias switch qkv_bias (default on).
                attention_bias=attention_bias,
                qk_norm=(arch in ("qwen3", "qwen3_moe", "gemma3", "olmo2", "olmo3", "exaone4", "olmoe", "qwen3_5", "qwen3_5_moe", "qwen3_next")
                         or (arch == "glm4_moe" and bool(raw.get("use_qk_norm")))),
                sliding_window=int(window) if window else None,
                layer_windows=windows,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
                activation=activation,
                # Gemma 1 scales by head_dim ** -0.5; Gemma 2 and 3 name their scalar.
                query_pre_attn_scalar=(float(head_dim if arch == "gemma" else raw["query_pre_attn_scalar"])
                                       if gemma else None),
                attn_logit_softcapping=float(raw.get("attn_logit_softcapping") or 0.0) if gemma else 0.0,
                final_logit_softcapping=float(raw.get("final_logit_softcapping") or 0.0) if gemma else 0.0,
                rope_local_theta=local_theta,
                moe=MoeConfig.from_hf(raw, arch, int(raw["num_hidden_layers"])),
                nope_layers=nope,
                rotary_dim=rotary,
                bidirectional=bidirectional,
                **({"rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6))} | granite_multipliers(raw, arch)),
                **classifier,
                matryoshka_dimensions=matryoshka(raw, hidden),
                base_model=base,
                mla=mla.get("mla"),
                mamba=mamba_fields(raw, arch),
                deltanet=deltanet_fields(raw, arch),
                falcon_h1=falcon_h1_multipliers(raw, arch),
                mamba1=mamba1_fields(raw, arch),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptModelError(f"config.json is missing or has a bad field: {exc}") from exc


def _layer_windows(raw: dict[str, Any], arch: str, window: int, layers: int,
                   nope: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), as transformers assigns them."""
    if not window:
        return (0,) * layers
    types = raw.get("layer_types")
    if types is not None:
        if len(types) != layers:
            raise ValueError(f"layer_types lists {len(types)} layers, the model has {layers}")
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    if arch in ("exaone4", "cohere2"):  # transformers' default: every sliding_window_pattern-th layer global
        return tuple(window if (i + 1) % int(raw.get("sliding_window_pattern", 4)) else 0 for i in range(layers))
    if arch == "olmo3":  # transformers' default: every fourth layer global, the rest slide
        return tuple(window if (i + 1) % 4 else 0 for i in range(layers))
    if arch == "smollm3":  # transformers' default: the NoPE layers slide
        return tuple(window if i in nope else 0 for i in range(layers))
    if arch in ("gemma2", "gpt_oss"):  # transformers' default: even layers slide, odd ones see all
        return tuple(window if (i + 1) % 2 else 0 for i in range(layers))
    if arch == "gemma3":  # every sliding_window_pattern-th layer is global
        pattern = int(raw.get("sliding_window_pattern", 6))
        return tuple(window if (i + 1) % pattern else 0 for i in range(layers))
    if arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        # Qwen: the first max_window_layers layers attend fully, the rest slide.
        first = int(raw.get("max_window_layers", 28))
        return tuple(window if i >= first else 0 for i in range(layers))
    return (window,) * layers


def _rope(raw: dict[str, Any], arch: str) -> tuple[float, dict[str, Any] | None, float | None]:
    """``(rope_theta, rope_scaling, local rope_theta)`` from either config format."""
    scaling = raw.get("rope_scaling") or None
    theta = raw.get("rope_theta")
    local = raw.get("rope_local_base_freq") if arch == "gemma3" else None
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and theta is None:
        # transformers v5 moved theta and scaling under rope_parameters, per layer type
        # for Gemma 3: {"full_attention": {...}, "sliding_attention": {...}}.
        if "full_attention" in params:
            sliding = params.get("sliding_attention") or {}
            if sliding.get("rope_type", "default") != "default":
                raise UnsupportedModelError("rope scaling on sliding-window layers is not supported")
            local = sliding.get("rope_theta", local)
            params = params["full_attention"]
        theta = params.get("rope_theta")
        if params.get("rope_type", "default") != "default":
            scaling = dict(params)
    if arch == "gemma3" and local is None:
        local = 10000.0  # transformers' default local base for Gemma 3
    if arch == "gpt_oss":  # GptOssConfig's defaults: base 150000, YaRN x32 of 4096 untruncated
        theta = 150000.0 if theta is None else theta
        if scaling is None and not (isinstance(params, dict) and params.get("rope_type")):
            scaling = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                       "truncate": False, "original_max_position_embeddings": 4096}
    if theta is None:
        theta = 1_000_000.0 if arch == "gemma3" else 10000.0  # transformers' defaults
    if arch == "olmo3" and local is None:
        local = theta  # OLMo 3's sliding layers: the same base, without the full layers' scaling
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_scaling type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
            )
        if kind == "su" or (arch == "phi3" and kind == "yarn"):
            kind = "longrope"  # Phi-3's older names, as transformers renames them
        scaling = {k: v for k, v in scaling.items() if k != "type"} | {"rope_type": kind}
        if kind in ("llama3", "yarn", "longrope"):
            # As transformers: a top-level original_max_position_embeddings (Phi-3 keeps
            # it there, 4096 by default) wins; else the trained length.
            top = raw.get("original_max_position_embeddings", 4096 if arch == "phi3" else None)
            if top is not None:
                scaling["original_max_position_embeddings"] = int(top)
            scaling.setdefault("original_max_position_embeddings", int(raw.get("max_position_embeddings", 2048)))
        # The trained length, which longrope's and dynamic NTK's formulas read.
        scaling.setdefault("max_position_embeddings", int(raw.get("max_position_embeddings", 2048)))
    return float(theta), scaling, None if local is None else float(local)


def _max_positions(max_positions: int, scaling: dict[str, Any] | None) -> int:
    """The context the positional encoding serves. YaRN and dynamic NTK exist to stretch
    it: as vLLM does, ``factor`` times the trained length (transformers sets no bound)."""
    if not scaling or scaling.get("factor") is None:
        return max_positions  # yarn without a factor derives it from max_positions itself
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "dynamic":
        return int(max_positions * float(scaling["factor"]))
    if kind == "yarn" and scaling.get("original_max_position_embeddings"):
        stretched = int(float(scaling["original_max_position_embeddings"]) * float(scaling["factor"]))
        return max(max_positions, stretched)
    return max_positions


def _activation(raw: dict[str, Any], arch: str) -> str:
    name = raw.get("hidden_activation") or raw.get("hidden_act")
    if arch in GEMMA_FAMILY:
        name = name or "gelu_pytorch_tanh"
        if arch == "gemma" and name == "gelu":
            # Gemma 1's releases say "gelu" and mean the tanh approximation (transformers'
            # GemmaConfig and vLLM both read it so).
            name = "gelu_pytorch_tanh"
    if arch in ("gpt_neox", "phi"):  # a plain MLP: exact GELU (NeoX's default) or the tanh one (Phi's)
        act = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
        name = name or ("gelu" if arch == "gpt_neox" else "gelu_new")
        if name not in act:
            raise UnsupportedModelError(f"hidden activation {name!r} is not supported for {arch}; "
                                        f"supported: {', '.join(act)}")
        return act[name]
    name = name or ("gelu_pytorch_tanh" if arch == "starcoder2" else "silu")  # transformers' defaults
    # Gemma's layer computes GeGLU, every other family's SwiGLU: another activation would
    # run as the wrong one, so it is refused (fail closed).
    computed = "gelu_tanh" if arch in GEMMA_FAMILY or arch == "starcoder2" else "silu"
    if _ACTIVATIONS.get(name) != computed:
        names = [n for n, a in _ACTIVATIONS.items() if a == computed]
        raise UnsupportedModelError(
            f"hidden activation {name!r} is not supported for {arch}; supported: {', '.join(names)}"
        )
    return computed


_VISION_ACTIVATIONS = ("quick_gelu", "gelu", "gelu_pytorch_tanh")


def _text_part_config(raw: dict[str, Any], arch: str) -> ModelConfig:
    """The text model of a vision-language checkpoint (TEXT_PART_ARCHITECTURES)."""
    causal, model_type = TEXT_PART_ARCHITECTURES[arch]
    text = audio.qwen2_audio_text(raw) if arch == audio.QWEN2_AUDIO else raw.get("text_config")
    if not isinstance(text, dict):
        raise CorruptModelError(f"{arch}: config.json has no text_config")
    if text.get("model_type", model_type) != model_type:
        raise UnsupportedModelError(f"{arch} with a {text['model_type']!r} language model is not supported "
                                    f"({model_type!r} is)")
    text = dict(text, architectures=[causal])
    if "tie_word_embeddings" in raw:  # transformers ties the head by the outer config's flag
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    for key in ("torch_dtype", "dtype", "eos_token_id", "bos_token_id"):
        if key in raw and key not in text:
            text[key] = raw[key]
    config = dataclasses.replace(ModelConfig.from_hf(text), text_of=arch)
    if arch == "Gemma3ForConditionalGeneration" and raw.get("vision_config") is not None:
        # Its SigLIP tower and projector serve images (models/gemma3_vision.py).
        vision = gemma3_vision_config(raw)
        if not 0 <= vision.image_token_id < config.vocab_size:
            raise UnsupportedModelError(
                f"Gemma 3: the image token ({vision.image_token_id}) is outside the language "
                f"model's vocabulary ({config.vocab_size})")
        windows = [w for w in config.layer_windows if w]
        if windows and min(windows) <= vision.mm_tokens_per_image:
            raise UnsupportedModelError(
                f"Gemma 3: an image's {vision.mm_tokens_per_image} tokens do not fit the "
                f"sliding window ({min(windows)})")
        config = dataclasses.replace(config, vision=vision)
    elif arch == audio.QWEN2_AUDIO and raw.get("audio_config") is not None:
        config = dataclasses.replace(config, vision=audio.qwen2_audio_config(raw, config.vocab_size))
    return config


def _llava_config(raw: dict[str, Any]) -> ModelConfig:
    """LLaVA: the language model's config from ``text_config`` plus the vision tower's."""
    try:
        text = dict(raw["text_config"])
        vis = dict(raw["vision_config"])
        text.setdefault("architectures", ["LlamaForCausalLM"])
        text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        text.setdefault("torch_dtype", raw.get("torch_dtype") or raw.get("dtype"))
        tower = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}.get(
            vis.get("model_type", "clip_vision_model"))
        if tower is None:
            raise UnsupportedModelError(f"LLaVA with a {vis.get('model_type')!r} vision tower "
                                        "is not supported (CLIP and SigLIP are)")
        # transformers' defaults of each tower's config class.
        eps, act = (1e-5, "quick_gelu") if tower == "clip" else (1e-6, "gelu_pytorch_tanh")
        layers = raw.get("vision_feature_layer", -2)
        layers = tuple(int(i) for i in layers) if isinstance(layers, list) else (int(layers),)
        vision = VisionConfig(
            hidden_size=int(vis["hidden_size"]),
            intermediate_size=int(vis["intermediate_size"]),
            num_hidden_layers=int(vis["num_hidden_layers"]),
            num_attention_heads=int(vis["num_attention_heads"]),
            image_size=int(vis["image_size"]),
            patch_size=int(vis["patch_size"]),
            num_channels=int(vis.get("num_channels", 3)),
            layer_norm_eps=float(vis.get("layer_norm_eps", eps)),
            hidden_act=str(vis.get("hidden_act", act)),
            feature_layers=layers,
            select_strategy=str(raw.get("vision_feature_select_strategy", "default")),
            projector_act=str(raw.get("projector_hidden_act", "gelu")),
            projector_bias=bool(raw.get("multimodal_projector_bias", True)),
            image_token_id=int(raw.get("image_token_index", raw.get("image_token_id", 32000))),
            tower=tower,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptModelError(f"config.json is missing or has a bad LLaVA field: {exc}") from exc
    for act in (vision.hidden_act, vision.projector_act):
        if act not in _VISION_ACTIVATIONS:
            raise UnsupportedModelError(f"LLaVA activation {act!r} is not supported")
    if vision.select_strategy not in ("default", "full"):
        raise UnsupportedModelError(
            f"vision_feature_select_strategy {vision.select_strategy!r} is not supported")
    if any(not -vision.num_hidden_layers - 1 <= i <= vision.num_hidden_layers
           for i in vision.feature_layers):
        raise CorruptModelError(f"vision_feature_layer {vision.feature_layers} is out of range")
    lm = ModelConfig.from_hf(text)
    if lm.is_encoder or lm.architecture in GEMMA_FAMILY or lm.moe is not None:
        raise UnsupportedModelError(f"LLaVA over a {lm.architecture} language model is not supported")
    return dataclasses.replace(lm, vision=vision)


def _qwen_vl_config(raw: dict[str, Any], kind: str) -> ModelConfig:
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL: a Qwen2 or Qwen3 decoder with M-RoPE, plus the
    vision tower's config (vision_config.qwen_vl_parts)."""
    text, vision = qwen_vl_parts(raw, kind)
    lm = ModelConfig.from_hf(text)
    if 2 * sum(vision.mrope_section) != lm.head_dim:
        raise CorruptModelError(
            f"mrope_section {list(vision.mrope_section)} covers {sum(vision.mrope_section)} "
            f"frequencies; head_dim {lm.head_dim} has {lm.head_dim // 2}")
    if lm.moe is not None and kind == "qwen3_vl_moe":  # stacked experts, top-k always renormalised
        lm = dataclasses.replace(lm, moe=dataclasses.replace(lm.moe, naming="qwen_stacked", norm_topk_prob=True))
    return dataclasses.replace(lm, vision=vision)
