"""Tiny deterministic models for tests: random weights, a few layers, a real tokenizer.

``write_tiny_model(path, arch)`` writes a complete Hugging Face folder (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with a ChatML chat template,
generation_config.json) that both this engine and transformers load. The same ``arch`` and
``seed`` always give the same bytes, so tests are reproducible.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

TINY_ARCHITECTURES = ("llama", "llama3", "mistral", "qwen2", "qwen3")

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


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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
            architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None
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
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {TINY_ARCHITECTURES}")
    return base


def _weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim", hidden // heads)
    vocab = cfg["vocab_size"]
    qwen2 = cfg["model_type"] == "qwen2"
    qwen3 = cfg["model_type"] == "qwen3"

    def rand(*shape: int, std: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm(n: int) -> torch.Tensor:
        # Not all ones, so a model that skips a norm weight fails the parity tests.
        return 1.0 + rand(n, std=0.1)

    # A tied head scores each token by its similarity to the residual stream, which holds
    # the input token's own embedding: at std 0.5 that term dominates and greedy decoding
    # repeats one token forever. At 0.02 the layers' outputs dominate and outputs vary.
    embed_std = 0.02 if cfg["tie_word_embeddings"] else 0.5
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(vocab, hidden, std=embed_std)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
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
        if qwen3:
            w[p + "self_attn.q_norm.weight"] = norm(head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(head_dim)
        w[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        w[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        w[p + "mlp.down_proj.weight"] = rand(hidden, inter)
    w["model.norm.weight"] = norm(hidden)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = rand(vocab, hidden, std=0.5)
    return {k: v.contiguous() for k, v in w.items()}


def write_tiny_model(path: str | Path, arch: str = "llama", *, seed: int = 0) -> Path:
    """Write a tiny random-weight model of ``arch`` into folder ``path`` and return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer_json = _tokenizer_json()
    vocab_size = len(json.loads(tokenizer_json)["model"]["vocab"])
    cfg = _hf_config(arch, vocab_size)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(_weights(cfg, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
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
                "chat_template": CHATML_TEMPLATE,
                "model_max_length": cfg["max_position_embeddings"],
            },
            indent=2,
        )
    )
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 2}, indent=2)
    )
    return path
