"""The config.json fields a GGUF architecture's metadata gives beyond the common ones
(engine.models.gguf_convert reads those): GPT-2's own names, the experts of Mixtral and
the Qwen MoE families, Gemma's windows and caps, Qwen3.5's Gated DeltaNet layers, and
RoPE scaling. ``fields`` is the converter's typed view of the file's metadata
(``gguf_convert._Fields``: ``get(key, default)`` raising CorruptModelError for a missing
key without a default)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.errors import CorruptModelError, UnsupportedModelError


def qwen35_config(fields: Any, arch: str, config: dict[str, Any], path: Path) -> dict[str, Any]:
    """Qwen3.5's Gated DeltaNet fields from llama.cpp's ``ssm.*`` keys (group count: key
    heads; time-step rank: value heads; state size: the key head's width; inner size: all
    value heads' width), its layer kinds from ``attention.recurrent_layers`` where the file
    lists them, else from ``full_attention_interval`` (every interval-th layer attends, as
    llama.cpp lays them out then), the rotated share of a head
    from ``rope.dimension_count``. llama.cpp's converter reorders each key head's value
    heads from grouped (a key head's value heads together) to tiled (the i-th value head
    of every key head, then the next), so its binary ops broadcast; the weights stay in
    that order and ``linear_value_heads_tiled`` tells the mixer (engine.models.deltanet_config)."""
    layers, head_dim = config["num_hidden_layers"], config["head_dim"]
    interval = int(fields.get(f"{arch}.full_attention_interval", 4))
    # Newer converters list each block's kind (true: recurrent; the decoder's come first).
    recurrent = fields.get(f"{arch}.attention.recurrent_layers", None)
    if recurrent is None:
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    elif len(recurrent) < layers:
        raise CorruptModelError(f"{path}: {arch}.attention.recurrent_layers lists {len(recurrent)} blocks, "
                                f"the decoder has {layers}")
    k_heads = int(fields.get(f"{arch}.ssm.group_count"))
    v_heads = int(fields.get(f"{arch}.ssm.time_step_rank"))
    inner = int(fields.get(f"{arch}.ssm.inner_size"))
    if not k_heads or not v_heads or v_heads % k_heads or inner % v_heads:
        raise CorruptModelError(f"{path}: {arch}.ssm.group_count {k_heads}, time_step_rank {v_heads} and "
                                f"inner_size {inner} do not describe whole key and value heads")
    rotary = int(fields.get(f"{arch}.rope.dimension_count", head_dim // 4))
    extra: dict[str, Any] = {
        "layer_types": ["linear_attention" if recurrent[i] else "full_attention" for i in range(layers)],
        "linear_num_key_heads": k_heads,
        "linear_num_value_heads": v_heads,
        "linear_key_head_dim": int(fields.get(f"{arch}.ssm.state_size")),
        "linear_value_head_dim": inner // v_heads,
        "linear_conv_kernel_dim": int(fields.get(f"{arch}.ssm.conv_kernel")),
        "linear_value_heads_tiled": v_heads != k_heads,
        "partial_rotary_factor": rotary / head_dim,
    }
    if not config["intermediate_size"]:  # Qwen3.5-MoE: the experts' width stands for it
        extra["intermediate_size"] = config.get("moe_intermediate_size", 0)
    return extra


def gpt2_config(fields: Any, dtype: str, names: dict[str, Any]) -> dict[str, Any]:
    """A GPT2Config's fields from llama.cpp's ``gpt2.*`` keys."""
    bos = fields.get("tokenizer.ggml.bos_token_id", None)
    eos = int(fields.get("tokenizer.ggml.eos_token_id"))
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": int(names["token_embd.weight"].shape[1]),  # ggml shape [hidden, vocab]
        "n_embd": int(fields.get("gpt2.embedding_length")),
        "n_inner": int(fields.get("gpt2.feed_forward_length")),
        "n_layer": int(fields.get("gpt2.block_count")),
        "n_head": int(fields.get("gpt2.attention.head_count")),
        "n_positions": int(fields.get("gpt2.context_length")),
        "layer_norm_epsilon": float(fields.get("gpt2.attention.layer_norm_epsilon")),
        "activation_function": "gelu_new",
        # llama.cpp's converter writes the tied head out as output.weight (a copy of the
        # embedding); a file without it ties.
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": eos,
        "torch_dtype": dtype,
    }


def moe_config(fields: Any, arch: str, names: dict[str, Any]) -> dict[str, Any]:
    experts = int(fields.get(f"{arch}.expert_count"))
    used = int(fields.get(f"{arch}.expert_used_count"))
    if arch == "llama":
        # Mixtral: every layer sparse, experts of feed_forward_length, top-k renormalised.
        return {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": experts,
            "num_experts_per_tok": used,
        }
    if arch == "granitemoe":  # every layer sparse, softmax over the top-k logits (renormalised)
        gate = names.get("blk.0.ffn_gate_exps.weight")
        return {"num_local_experts": experts, "num_experts_per_tok": used,
                "intermediate_size": int(gate.shape[1]) if gate is not None else int(
                    fields.get(f"{arch}.feed_forward_length"))}
    if arch not in ("qwen2moe", "qwen3moe", "qwen35moe"):
        raise UnsupportedModelError(f"GGUF architecture {arch!r} with experts is not supported")
    layers = int(fields.get(f"{arch}.block_count"))
    gate = names.get("blk.0.ffn_gate_exps.weight")
    # llama.cpp renormalises the top-k weights for qwen3moe and not for qwen2moe unless
    # the file says otherwise (as the Hugging Face configs of those families do).
    norm = bool(fields.get(f"{arch}.expert_weights_norm", arch in ("qwen3moe", "qwen35moe")))
    config: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": int(
            fields.get(f"{arch}.expert_feed_forward_length", 0) or (gate.shape[1] if gate is not None else 0)
        ),
        "norm_topk_prob": norm,
        "decoder_sparse_step": 1,
        # A layer without a router keeps a dense MLP.
        "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names],
    }
    if arch in ("qwen2moe", "qwen35moe"):
        shared = names.get("blk.0.ffn_gate_shexp.weight")
        config["shared_expert_intermediate_size"] = int(
            fields.get(f"{arch}.expert_shared_feed_forward_length", 0)
            or (shared.shape[1] if shared is not None else 0)
        )
        if arch == "qwen2moe":
            config["qkv_bias"] = "blk.0.attn_q.bias" in names
    return config


def layer_types(fields: Any, arch: str, layers: int, default_pattern: int) -> list[str]:
    """Per-layer attention kinds from ``attention.sliding_window_pattern`` (a period, or
    one flag per layer, true = sliding), else llama.cpp's built-in period for ``arch``."""
    pattern = fields.get(f"{arch}.attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [bool((i + 1) % int(pattern)) for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def gemma_config(fields: Any, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    if arch == "gemma":  # Gemma 1: GeGLU; no windows, caps or scalar (it scales by head_dim)
        return {"hidden_act": "gelu_pytorch_tanh"}
    layers, hidden, heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    # GGUF has no query_pre_attn_scalar: llama.cpp scales by head_dim ** -0.5 except for
    # the 27B models (46 layers for Gemma 2, 62 for Gemma 3), scaled by (hidden/heads) ** -0.5.
    is_27b = layers == (46 if arch == "gemma2" else 62)
    extra: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // heads if is_27b else config["head_dim"],
        "sliding_window": int(fields.get(f"{arch}.attention.sliding_window")),
        "layer_types": layer_types(fields, arch, layers, 2 if arch == "gemma2" else 6),
    }
    if arch == "gemma2":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = fields.get(f"{arch}.{key}", None)
            extra[key] = None if value is None else float(value)
    else:
        # llama.cpp's local-layer base is 10000 unless the file says otherwise.
        extra["rope_local_base_freq"] = float(fields.get(f"{arch}.rope.freq_base_swa", 10000.0))
    return extra


def rope_scaling(fields: Any, arch: str, path: Path) -> dict[str, Any] | None:
    kind = fields.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = float(fields.get(f"{arch}.rope.scaling.factor"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = int(fields.get(f"{arch}.rope.scaling.original_context_length"))
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise UnsupportedModelError(f"{path}: RoPE scaling type {kind!r} is not supported")


__all__ = ["gemma_config", "gpt2_config", "layer_types", "moe_config", "qwen35_config", "rope_scaling"]
