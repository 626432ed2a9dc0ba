"""Tiny deterministic models for tests: random weights, a few layers, a real tokenizer.

``write_tiny_model(path, arch)`` writes a complete Hugging Face folder (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with a ChatML chat template,
generation_config.json) that both this engine and transformers load. The same ``arch`` and
``seed`` always give the same bytes, so tests are reproducible.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.models.config import ModelConfig, MoeConfig
from engine.models.layers.moe import expert_weight_names, layer_prefix
from engine.models.testing_absolute import (
    TINY_ABSOLUTE_ARCHITECTURES,
    absolute_hf_config,
    absolute_weights,
)

TINY_ARCHITECTURES = ("llama", "llama3", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3",
                      "phi4", "smollm3", "granite", "olmo2", "olmo3")
# Mixture-of-experts models (kept apart so the dense suites do not grow by their cost):
# Mixtral with 8 experts, top 2, every layer sparse; Qwen3-MoE with 8 experts, top 3,
# renormalised, its middle layer dense (mlp_only_layers); Qwen2-MoE with 6 experts, top 2,
# not renormalised, a gated shared expert and every second layer sparse
# (decoder_sparse_step 2).
TINY_MOE_ARCHITECTURES = ("mixtral", "qwen3_moe", "qwen2_moe")
# GPT-2 and OPT: TINY_ABSOLUTE_ARCHITECTURES (engine.models.testing_absolute), kept apart too.

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A small English corpus is enough for a byte-level BPE to learn real merges; the vocab
# stays small (384) so the lm_head is cheap and tests run in seconds.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny language model used for testing the engine.",
    "Paged attention stores keys and values in fixed size blocks.",
    "Continuous batching lets new requests join while others are decoding.",
    "Numbers like 12345 and 67890, symbols like {}, [], () and unicode: café, naïve, 日本語.",
    "import trio\nasync def main():\n    async with trio.open_nursery() as nursery:\n        pass\n",
] * 4
TINY_VOCAB_SIZE = 384
MISTRAL_WINDOW = 8  # the tiny Mistral's sliding window, in tokens
GEMMA_WINDOW = 8  # the tiny Gemmas' local layers' window
PHI3_ORIGINAL_POSITIONS = 64  # the tiny Phi-3's longrope switch point (max positions 512)


def _tokenizer_json() -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return tok.to_str()


def _hf_config(arch: str, vocab_size: int) -> dict[str, Any]:
    base: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "hidden_act": "silu",
    }
    if arch == "llama":
        base.update(architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=True)
    elif arch == "llama3":
        base.update(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            num_key_value_heads=1,  # MQA: GQA ratio 4
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    elif arch == "mistral":
        base.update(
            architectures=["MistralForCausalLM"],
            model_type="mistral",
            # Shorter than most test prompts, so the window is exercised, not just allowed.
            sliding_window=MISTRAL_WINDOW,
        )
    elif arch == "qwen2":
        base.update(
            architectures=["Qwen2ForCausalLM"],
            model_type="qwen2",
            tie_word_embeddings=True,
            use_sliding_window=False,
        )
    elif arch == "qwen3":
        base.update(
            architectures=["Qwen3ForCausalLM"],
            model_type="qwen3",
            head_dim=32,  # Qwen3 decouples head_dim from hidden_size / heads
            attention_bias=False,
            use_sliding_window=False,
        )
    elif arch == "granite":
        base.update(
            architectures=["GraniteForCausalLM"],
            model_type="granite",
            # Granite 3's kinds of values: embeddings scaled up, block outputs down, logits
            # divided; the attention scale apart from head_dim ** -0.5 (0.25 here).
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.2,
            logits_scaling=8.0,
        )
    elif arch in ("olmo2", "olmo3"):
        base.update(
            architectures=["Olmo2ForCausalLM" if arch == "olmo2" else "Olmo3ForCausalLM"],
            model_type=arch,
            pad_token_id=0,
        )
        if arch == "olmo3":
            # Sliding and full layers alternate (write_tiny_model lays them out; OLMo 3 has
            # three sliding to one full), YaRN on the full layers only.
            # OLMo 3's base (500000): transformers gives it to the sliding layers whatever
            # rope_theta says, as the released configs do both.
            base.update(sliding_window=GEMMA_WINDOW, rope_theta=500_000.0,
                        rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                      "original_max_position_embeddings": 256})
    elif arch == "smollm3":
        base.update(
            architectures=["SmolLM3ForCausalLM"],
            model_type="smollm3",
            # Every second layer attends without RoPE (SmolLM3-3B: every fourth, listed in
            # no_rope_layers; transformers derives the list from the interval).
            no_rope_layer_interval=2,
            rope_theta=5_000_000.0,
            pad_token_id=0,  # transformers' default (128004) is past the tiny vocabulary
        )
    elif arch == "gemma":
        base.update(
            architectures=["GemmaForCausalLM"],
            model_type="gemma",
            head_dim=32,  # apart from hidden / heads (16): Gemma 1 scales by head_dim ** -0.5
            # The releases' legacy value, which means the tanh approximation.
            hidden_act="gelu",
            tie_word_embeddings=False,  # as below
            pad_token_id=0,
        )
    elif arch in ("gemma2", "gemma3"):
        base.update(
            head_dim=16,  # transformers' Gemma default is 256
            hidden_activation="gelu_pytorch_tanh",
            # Real Gemmas tie the head (as the tiny Llama does); tied, these random weights
            # only ever repeat the last token, which would make greedy parity vacuous.
            tie_word_embeddings=False,
            # Apart from head_dim (16), so a model that scales by head_dim ** -0.5 fails.
            query_pre_attn_scalar=24 if arch == "gemma2" else 20,
            # Layer 0 slides over 8 tokens, layer 1 sees everything.
            sliding_window=GEMMA_WINDOW,
            pad_token_id=0,
        )
        if arch == "gemma2":
            base.update(
                architectures=["Gemma2ForCausalLM"],
                model_type="gemma2",
                # Far lower than Gemma 2's 50 and 30, so that the caps bend this tiny
                # model's scores and logits (a model that skips one fails the tests).
                attn_logit_softcapping=3.0,
                final_logit_softcapping=10.0,
            )
        else:
            base.update(
                architectures=["Gemma3ForCausalLM"],
                model_type="gemma3_text",
                sliding_window_pattern=2,
                # Global layers: base 1e6 and linear scaling (Gemma 3 4B+ scale by 8);
                # local layers: their own base, unscaled.
                rope_theta=1_000_000.0,
                rope_local_base_freq=10_000.0,
                rope_scaling={"rope_type": "linear", "factor": 2.0},
            )
    elif arch in ("phi3", "phi4"):
        # "phi4": Phi-4-mini's layout, Phi-3's class with RoPE on 3/4 of each head (12 of 16).
        partial = 0.75 if arch == "phi4" else 1.0
        half = int(base["hidden_size"] // base["num_attention_heads"] * partial) // 2
        base.update(
            **({"partial_rotary_factor": partial} if arch == "phi4" else {}),
            architectures=["Phi3ForCausalLM"],
            model_type="phi3",
            pad_token_id=0,
            original_max_position_embeddings=PHI3_ORIGINAL_POSITIONS,
            # longrope: per-frequency divisors, short below the original length and long
            # past it; max/original = 8 gives cos/sin an attention factor of sqrt(1.5).
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0 + 0.05 * i for i in range(half)],
                "long_factor": [1.0 + 0.5 * i for i in range(half)],
            },
        )
    elif arch == "mixtral":
        base.update(
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            intermediate_size=64,  # each expert's
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=None,
        )
    elif arch == "qwen3_moe":
        base.update(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            num_hidden_layers=3,
            head_dim=32,
            attention_bias=False,
            use_sliding_window=False,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )
    elif arch == "qwen2_moe":
        base.update(
            architectures=["Qwen2MoeForCausalLM"],
            model_type="qwen2_moe",
            use_sliding_window=False,
            qkv_bias=True,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            mlp_only_layers=[],
        )
    else:
        raise ValueError(
            f"unknown tiny architecture {arch!r}; choose from "
            f"{TINY_ARCHITECTURES + TINY_MOE_ARCHITECTURES}"
        )
    return base


def _weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim", hidden // heads)
    vocab = cfg["vocab_size"]
    qwen2 = cfg["model_type"] in ("qwen2", "qwen2_moe")
    qwen3 = cfg["model_type"] in ("qwen3", "qwen3_moe")
    olmo = cfg["model_type"] in ("olmo2", "olmo3")
    gemma = cfg["model_type"] in ("gemma", "gemma2", "gemma3_text")
    phi3 = cfg["model_type"] == "phi3"
    moe = ModelConfig.from_hf(cfg).moe

    def rand(*shape: int, std: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm(n: int) -> torch.Tensor:
        # Not all ones, so a model that skips a norm weight fails the parity tests. Gemma
        # stores w and multiplies by 1 + w.
        return rand(n, std=0.1) + (0.0 if gemma else 1.0)

    # A tied head scores each token by its similarity to the residual stream, which holds
    # the input token's own embedding: at std 0.5 that term dominates and greedy decoding
    # repeats one token forever. At 0.02 the layers' outputs dominate and outputs vary.
    embed_std = 0.02 if cfg["tie_word_embeddings"] else 0.5
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(vocab, hidden, std=embed_std)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if not olmo:  # OLMo norms after each block only
            w[p + "input_layernorm.weight"] = norm(hidden)
        w[p + "post_attention_layernorm.weight"] = norm(hidden)
        w[p + "self_attn.q_proj.weight"] = rand(heads * head_dim, hidden)
        w[p + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden)
        w[p + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden)
        w[p + "self_attn.o_proj.weight"] = rand(hidden, heads * head_dim)
        if qwen2:
            w[p + "self_attn.q_proj.bias"] = rand(heads * head_dim)
            w[p + "self_attn.k_proj.bias"] = rand(kv_heads * head_dim)
            w[p + "self_attn.v_proj.bias"] = rand(kv_heads * head_dim)
        if qwen3 or cfg["model_type"] == "gemma3_text":
            w[p + "self_attn.q_norm.weight"] = norm(head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(head_dim)
        if gemma and cfg["model_type"] != "gemma":  # Gemma 2/3's sandwich norms
            w[p + "pre_feedforward_layernorm.weight"] = norm(hidden)
            w[p + "post_feedforward_layernorm.weight"] = norm(hidden)
        if olmo:  # q and k normed across all their heads; a norm after the MLP
            w[p + "self_attn.q_norm.weight"] = norm(heads * head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(kv_heads * head_dim)
            w[p + "post_feedforward_layernorm.weight"] = norm(hidden)
        if moe is not None and i in moe.sparse_layers:
            w.update(_moe_weights(moe, i, hidden, rand))
            continue
        w[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        w[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        w[p + "mlp.down_proj.weight"] = rand(hidden, inter)
        if phi3:  # Phi-3 ships q/k/v and gate/up fused
            w[p + "self_attn.qkv_proj.weight"] = torch.cat(
                [w.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
            )
            w[p + "mlp.gate_up_proj.weight"] = torch.cat(
                [w.pop(p + "mlp.gate_proj.weight"), w.pop(p + "mlp.up_proj.weight")]
            )
    w["model.norm.weight"] = norm(hidden)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = rand(vocab, hidden, std=0.5)
    return {k: v.contiguous() for k, v in w.items()}


def _moe_weights(
    moe: MoeConfig, layer: int, hidden: int, rand: Callable[..., torch.Tensor]
) -> dict[str, torch.Tensor]:
    p = layer_prefix(moe, layer)
    # A router 4x the other weights' scale gives logits of std ~2.5: each token has clear
    # favourites, so low-precision rounding rarely swaps two experts at the top-k edge.
    w = {p + "gate.weight": rand(moe.num_experts, hidden, std=1.0)}
    inter = moe.intermediate_size
    for e in range(moe.num_experts):
        gate, up, down = expert_weight_names(moe, layer, e)
        w[gate] = rand(inter, hidden)
        w[up] = rand(inter, hidden)
        w[down] = rand(hidden, inter, std=0.15)
    if moe.shared_expert_intermediate_size:
        shared = moe.shared_expert_intermediate_size
        w[p + "shared_expert.gate_proj.weight"] = rand(shared, hidden)
        w[p + "shared_expert.up_proj.weight"] = rand(shared, hidden)
        w[p + "shared_expert.down_proj.weight"] = rand(hidden, shared)
        w[p + "shared_expert_gate.weight"] = rand(1, hidden, std=0.3)
    return w


def write_tiny_model(
    path: str | Path, arch: str = "llama", *, seed: int = 0, overrides: dict[str, Any] | None = None,
    chat_template: str | None = None,
) -> Path:
    """Write a tiny random-weight model of ``arch`` into folder ``path`` and return it.

    ``overrides`` replaces config.json fields before the weights are drawn (benchmarks use
    it for larger shapes: more layers, wider experts). ``chat_template`` replaces the
    ChatML template in tokenizer_config.json (tests give a real checkpoint's)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer_json = _tokenizer_json()
    vocab_size = len(json.loads(tokenizer_json)["model"]["vocab"])
    absolute = arch in TINY_ABSOLUTE_ARCHITECTURES
    cfg = (absolute_hf_config if absolute else _hf_config)(arch, vocab_size) | (overrides or {})
    if arch == "olmo3" and "layer_types" not in (overrides or {}):
        # Alternate sliding and full layers over however many the overrides ask for.
        cfg["layer_types"] = [("sliding_attention", "full_attention")[i % 2] for i in range(cfg["num_hidden_layers"])]
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    weights = (absolute_weights if absolute else _weights)(cfg, seed)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "tokenizer.json").write_text(tokenizer_json)
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|endoftext|>",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "add_bos_token": False,
                "chat_template": chat_template if chat_template is not None else CHATML_TEMPLATE,
                "model_max_length": cfg.get("max_position_embeddings", cfg.get("n_positions")),
            },
            indent=2,
        )
    )
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 2}, indent=2)
    )
    return path


IMAGE_TOKEN = "<image>"
TINY_IMAGE_SIZE = 28  # pixels square, 2 x 2 patches of 14: 4 placeholder tokens per image


def write_tiny_llava(path: str | Path, *, seed: int = 0, tower: str = "clip",
                     chat_template: str | None = None) -> Path:
    """A tiny random LLaVA (a vision tower + projector + the tiny Llama) in folder ``path``,
    in the layout transformers' ``save_pretrained`` writes: config.json from ``LlavaConfig``,
    model.safetensors, the tiny tokenizer with an ``<image>`` token and the tower's image
    processor (preprocessor_config.json) giving 28 x 28 pixels.

    ``tower="clip"``: a CLIP tower read at layer -2 without its CLS position (LLaVA-1.5's
    shape), a ``CLIPImageProcessor`` that crops. ``"siglip"``: a SigLIP tower read whole at
    its last layer (strategy ``full``, as LLaVA-style models over SigLIP do), a
    ``SiglipImageProcessor`` that resizes. ``chat_template``: as :func:`write_tiny_model`'s."""
    # transformers is heavy and only the VLM tests need it: imported here, on use.
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        SiglipImageProcessor,
        SiglipVisionConfig,
    )

    path = Path(path)
    write_tiny_model(path, "llama3", seed=seed, chat_template=chat_template)
    tok = Tokenizer.from_str((path / "tokenizer.json").read_text())
    tok.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True)])
    image_id = tok.token_to_id(IMAGE_TOKEN)
    (path / "tokenizer.json").write_text(tok.to_str())
    text = json.loads((path / "config.json").read_text())
    text["vocab_size"] = image_id + 1
    clip = tower == "clip"
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                 image_size=TINY_IMAGE_SIZE, patch_size=14)
    if clip:
        vision = CLIPVisionConfig(**sizes, projection_dim=32, layer_norm_eps=1e-5)
    else:
        vision = SiglipVisionConfig(**sizes, layer_norm_eps=1e-6, vision_use_head=False)
    text_cfg = LlamaConfig(**{k: v for k, v in text.items() if k not in ("architectures", "model_type")})
    cfg = LlavaConfig(vision_config=vision, text_config=text_cfg, image_token_index=image_id,
                      vision_feature_layer=-2 if clip else -1,
                      vision_feature_select_strategy="default" if clip else "full",
                      projector_hidden_act="gelu", image_seq_length=4)
    cfg.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw["architectures"] = ["LlavaForConditionalGeneration"]
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    gen = torch.Generator().manual_seed(seed + 1)

    def rand(*shape: int, std: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    lm = _weights(text, seed)
    weights = {f"language_model.{k}": v for k, v in lm.items()}
    # The image token's row exists in a real checkpoint too; its value is never read.
    embed = weights["language_model.model.embed_tokens.weight"]
    weights["language_model.model.embed_tokens.weight"] = torch.cat([embed, rand(image_id + 1 - embed.shape[0], embed.shape[1])])
    if "language_model.lm_head.weight" in weights:
        head = weights["language_model.lm_head.weight"]
        weights["language_model.lm_head.weight"] = torch.cat([head, rand(image_id + 1 - head.shape[0], head.shape[1], std=0.5)])
    d, inter, hidden = vision.hidden_size, vision.intermediate_size, text["hidden_size"]
    v = "vision_tower."
    weights[v + "embeddings.patch_embedding.weight"] = rand(d, 3, 14, 14, std=0.2)
    weights[v + "embeddings.position_embedding.weight"] = rand(4 + clip, d, std=0.5)
    if clip:
        weights[v + "embeddings.class_embedding"] = rand(d, std=0.5)
    else:
        weights[v + "embeddings.patch_embedding.bias"] = rand(d, std=0.1)
    for name in ("pre_layrnorm", "post_layernorm") if clip else ("post_layernorm",):
        weights[v + name + ".weight"] = 1 + rand(d, std=0.1)
        weights[v + name + ".bias"] = rand(d, std=0.1)
    for i in range(vision.num_hidden_layers):
        p = f"{v}encoder.layers.{i}."
        for name in ("layer_norm1", "layer_norm2"):
            weights[p + name + ".weight"] = 1 + rand(d, std=0.1)
            weights[p + name + ".bias"] = rand(d, std=0.1)
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            weights[p + f"self_attn.{name}.weight"] = rand(d, d, std=0.2)
            weights[p + f"self_attn.{name}.bias"] = rand(d, std=0.1)
        weights[p + "mlp.fc1.weight"] = rand(inter, d, std=0.2)
        weights[p + "mlp.fc1.bias"] = rand(inter, std=0.1)
        weights[p + "mlp.fc2.weight"] = rand(d, inter, std=0.2)
        weights[p + "mlp.fc2.bias"] = rand(d, std=0.1)
    weights["multi_modal_projector.linear_1.weight"] = rand(hidden, d, std=0.3)
    weights["multi_modal_projector.linear_1.bias"] = rand(hidden, std=0.1)
    weights["multi_modal_projector.linear_2.weight"] = rand(hidden, hidden, std=1.5)
    weights["multi_modal_projector.linear_2.bias"] = rand(hidden, std=0.1)
    save_file({k: t.contiguous() for k, t in weights.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    if clip:
        CLIPImageProcessor(size={"shortest_edge": TINY_IMAGE_SIZE},
                           crop_size={"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE}).save_pretrained(path)
    else:
        SiglipImageProcessor(size={"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE}).save_pretrained(path)
    return path


QWEN_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
TINY_QWEN_VL = ("qwen2_vl", "qwen2_5_vl")
# The tiny Qwen-VL towers' patches: 4 x 4 pixels, 2 frames, merged 2 x 2 into one token,
# so an image's sides are rounded to multiples of 8 pixels; the processor keeps each
# image between 8 x 8 and 64 x 64 pixels' worth (min_pixels / max_pixels).
TINY_QWEN_VL_PATCH = 4
TINY_QWEN_VL_MIN_PIXELS = 8 * 8
TINY_QWEN_VL_MAX_PIXELS = 64 * 64


def write_tiny_qwen_vl(path: str | Path, kind: str = "qwen2_vl", *, seed: int = 0,
                       chat_template: str | None = None) -> Path:
    """A tiny random Qwen2-VL (``kind="qwen2_vl"``: LayerNorm/QuickGELU vision blocks) or
    Qwen2.5-VL (``"qwen2_5_vl"``: RMSNorm/SwiGLU blocks, windowed attention but for the
    ``fullatt_block_indexes`` layers) in folder ``path``, as transformers 5's
    ``save_pretrained`` lays it out: config.json (``text_config`` with M-RoPE's
    ``mrope_section``, ``vision_config``), model.safetensors under ``model.language_model.*``
    / ``model.visual.*`` / ``lm_head.weight``, the tiny tokenizer with the vision tokens
    and a ``Qwen2VLImageProcessor`` (preprocessor_config.json) with a small pixel budget.
    ``chat_template``: as :func:`write_tiny_model`'s."""
    # transformers is heavy and only the VLM tests need it: imported here, on use.
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen2VLImageProcessor

    if kind not in TINY_QWEN_VL:
        raise ValueError(f"unknown tiny Qwen-VL kind {kind!r}; choose from {TINY_QWEN_VL}")
    path = Path(path)
    write_tiny_model(path, "qwen2", seed=seed, chat_template=chat_template)
    tok = Tokenizer.from_str((path / "tokenizer.json").read_text())
    tok.add_special_tokens([AddedToken(t, special=True) for t in QWEN_VL_TOKENS])
    ids = {t: tok.token_to_id(t) for t in QWEN_VL_TOKENS}
    (path / "tokenizer.json").write_text(tok.to_str())
    text = json.loads((path / "config.json").read_text())
    vocab = max(ids.values()) + 1
    # Untied: with a tied head these random weights mostly repeat the last token.
    text.update(vocab_size=vocab, tie_word_embeddings=False, model_type="qwen2")
    text_cfg = {k: v for k, v in text.items() if k not in ("architectures", "model_type", "rope_theta",
                                                              "torch_dtype")}
    # head_dim 16: 8 frequencies, 2 rotated by the temporal position, 3 by the height, 3
    # by the width.
    text_cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                                   "mrope_section": [2, 3, 3]}
    common = dict(depth=3, num_heads=4, patch_size=TINY_QWEN_VL_PATCH, temporal_patch_size=2,
                  spatial_merge_size=2, in_channels=3)
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"],
                  vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    d, hidden = 32, text["hidden_size"]
    if kind == "qwen2_vl":
        vision = dict(common, embed_dim=d, hidden_size=hidden, mlp_ratio=2, hidden_act="quick_gelu")
        cfg = Qwen2VLConfig(text_config=text_cfg, vision_config=vision, **tokens)
        arch = "Qwen2VLForConditionalGeneration"
    else:
        # Windows of 16 pixels: 2 x 2 merged tokens (4 x 4 patches); block 1 sees the whole
        # image, blocks 0 and 2 their window only.
        vision = dict(common, hidden_size=d, intermediate_size=48, out_hidden_size=hidden,
                      hidden_act="silu", window_size=16, fullatt_block_indexes=[1])
        cfg = Qwen2_5_VLConfig(text_config=text_cfg, vision_config=vision, **tokens)
        arch = "Qwen2_5_VLForConditionalGeneration"
    cfg.dtype = "float32"
    cfg.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw["architectures"] = [arch]
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    gen = torch.Generator().manual_seed(seed + 1)

    def rand(*shape: int, std: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    lm = _weights(text, seed)
    weights = {k.replace("model.", "model.language_model.", 1): v for k, v in lm.items()}
    v = "model.visual."
    weights[v + "patch_embed.proj.weight"] = rand(d, 3, 2, TINY_QWEN_VL_PATCH, TINY_QWEN_VL_PATCH, std=0.2)
    layer_norm = kind == "qwen2_vl"

    def norm(name: str, n: int) -> None:
        weights[name + ".weight"] = 1 + rand(n, std=0.1)
        if layer_norm:
            weights[name + ".bias"] = rand(n, std=0.1)

    def linear(name: str, out: int, inp: int, std: float = 0.2) -> None:
        weights[name + ".weight"] = rand(out, inp, std=std)
        weights[name + ".bias"] = rand(out, std=0.1)

    for i in range(common["depth"]):
        p = f"{v}blocks.{i}."
        norm(p + "norm1", d)
        norm(p + "norm2", d)
        linear(p + "attn.qkv", 3 * d, d)
        linear(p + "attn.proj", d, d)
        if kind == "qwen2_vl":
            linear(p + "mlp.fc1", 2 * d, d)
            linear(p + "mlp.fc2", d, 2 * d)
        else:
            linear(p + "mlp.gate_proj", 48, d)
            linear(p + "mlp.up_proj", 48, d)
            linear(p + "mlp.down_proj", d, 48)
    norm(v + "merger.ln_q", d)
    linear(v + "merger.mlp.0", 4 * d, 4 * d, std=0.15)
    linear(v + "merger.mlp.2", hidden, 4 * d, std=0.6)
    save_file({k: t.contiguous() for k, t in weights.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    Qwen2VLImageProcessor(patch_size=TINY_QWEN_VL_PATCH, temporal_patch_size=2, merge_size=2,
                          min_pixels=TINY_QWEN_VL_MIN_PIXELS,
                          max_pixels=TINY_QWEN_VL_MAX_PIXELS).save_pretrained(path)
    return path
