"""The tiny GPT-2 and OPT models of :func:`engine.models.testing.write_tiny_model`: their
config.json and random weights, under the names transformers saves them with."""

from __future__ import annotations

from typing import Any

import torch

# Learned absolute positions and LayerNorm (models/layers/absolute.py): GPT-2
# (Conv1D weights, fused c_attn, gelu_new), OPT (position offset 2, ReLU), and OPT in
# OPT-350m's shape (norms after the residual adds, no final norm, a 32-wide embedding
# projected to and from the 64-wide layers).
TINY_ABSOLUTE_ARCHITECTURES = ("gpt2", "opt", "opt_postnorm")


def absolute_hf_config(arch: str, vocab_size: int) -> dict[str, Any]:
    """config.json of a tiny GPT-2 or OPT (4 layers, 64 wide, 4 heads), in the field
    names their transformers config classes write."""
    common = {"vocab_size": vocab_size, "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "float32",
              "tie_word_embeddings": True}
    if arch == "gpt2":
        return common | {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_head": 4,
            "n_layer": 4, "n_inner": 128, "n_positions": 512, "layer_norm_epsilon": 1e-5,
            "activation_function": "gelu_new",
        }
    if arch in ("opt", "opt_postnorm"):
        post = arch == "opt_postnorm"
        return common | {
            "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 64,
            "num_attention_heads": 4, "num_hidden_layers": 4, "ffn_dim": 128,
            "max_position_embeddings": 512, "activation_function": "relu", "pad_token_id": 1,
            "do_layer_norm_before": not post, "word_embed_proj_dim": 32 if post else 64,
        }
    raise ValueError(f"unknown tiny architecture {arch!r}; choose from {TINY_ABSOLUTE_ARCHITECTURES}")


def absolute_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """A tiny GPT-2's or OPT's tensors under the names transformers saves them with
    (GPT-2's Conv1D weights ``[in, out]``)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm(prefix: str, n: int) -> dict[str, torch.Tensor]:
        # Neither ones nor zeros, so a model that skips a norm's weight or bias fails.
        return {prefix + ".weight": rand(n, std=0.1) + 1.0, prefix + ".bias": rand(n, std=0.1)}

    def linear(prefix: str, out: int, inp: int, conv1d: bool = False) -> dict[str, torch.Tensor]:
        w = rand(inp, out) if conv1d else rand(out, inp)
        return {prefix + ".weight": w, prefix + ".bias": rand(out, std=0.05)}

    # Tied heads: the token embedding small, as _weights explains; the position rows large
    # (std 0.3), so the residual stream moves with the position: with them small too,
    # greedy decoding of these tiny models settles on repeating one token.
    vocab, w = cfg["vocab_size"], {}
    if cfg["model_type"] == "gpt2":
        hidden, inter = cfg["n_embd"], cfg["n_inner"]
        w["transformer.wte.weight"] = rand(vocab, hidden, std=0.02)
        w["transformer.wpe.weight"] = rand(cfg["n_positions"], hidden, std=0.3)
        for i in range(cfg["n_layer"]):
            p = f"transformer.h.{i}."
            w |= norm(p + "ln_1", hidden) | norm(p + "ln_2", hidden)
            w |= linear(p + "attn.c_attn", 3 * hidden, hidden, conv1d=True)
            w |= linear(p + "attn.c_proj", hidden, hidden, conv1d=True)
            w |= linear(p + "mlp.c_fc", inter, hidden, conv1d=True)
            w |= linear(p + "mlp.c_proj", hidden, inter, conv1d=True)
        w |= norm("transformer.ln_f", hidden)
        return {k: v.contiguous() for k, v in w.items()}
    hidden, inter, proj = cfg["hidden_size"], cfg["ffn_dim"], cfg["word_embed_proj_dim"]
    d = "model.decoder."
    w[d + "embed_tokens.weight"] = rand(vocab, proj, std=0.02)
    w[d + "embed_positions.weight"] = rand(cfg["max_position_embeddings"] + 2, hidden, std=0.3)  # offset 2
    if proj != hidden:
        w[d + "project_in.weight"] = rand(hidden, proj, std=0.2)
        w[d + "project_out.weight"] = rand(proj, hidden, std=0.2)
    for i in range(cfg["num_hidden_layers"]):
        p = f"{d}layers.{i}."
        w |= norm(p + "self_attn_layer_norm", hidden) | norm(p + "final_layer_norm", hidden)
        for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
            w |= linear(p + "self_attn." + n, hidden, hidden)
        w |= linear(p + "fc1", inter, hidden) | linear(p + "fc2", hidden, inter)
    if cfg["do_layer_norm_before"]:
        w |= norm(d + "final_layer_norm", hidden)
    return {k: v.contiguous() for k, v in w.items()}


__all__ = ["TINY_ABSOLUTE_ARCHITECTURES", "absolute_hf_config", "absolute_weights"]
