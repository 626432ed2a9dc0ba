"""gpt-oss checkpoints written by transformers, with random weights over the tiny models'
tokenizer, for the tests (tiny shapes) and benchmarks (real ones).

:func:`write_gpt_oss` saves ``GptOssForCausalLM`` at a test-friendly spread (matrices
0.3; biases, sinks and router biases 1, so each of them moves the answer; norms around
1), and with ``mxfp4`` its experts as the released checkpoints keep them: random MXFP4
blocks and power-of-two scales (``*_blocks``, ``*_scales``) and a ``quantization_config``
naming ``mxfp4``, which transformers and the engine both dequantize as they load.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from engine.models.testing import write_tiny_model

# A tiny gpt-oss: two layers (one sliding over 4 tokens, one full), 4 experts, top 2.
TINY_GPT_OSS = dict(vocab_size=384, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=4, max_position_embeddings=256,
                    tie_word_embeddings=False)
# The released checkpoints' quantization_config (what is not converted stays dense).
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def write_gpt_oss(folder: str | Path, *, config: dict[str, Any] | None = None, seed: int = 0,
                  mxfp4: bool = False, spread: float = 0.3) -> Any:
    """Write a random gpt-oss of :data:`TINY_GPT_OSS` with ``config`` over it into
    ``folder``; returns transformers' model (eval mode, never stopping at an EOS), whose
    experts, with ``mxfp4``, are the dequantized blocks written."""
    from transformers import GptOssConfig, GptOssForCausalLM

    folder = Path(folder)
    torch.manual_seed(seed)
    hf = GptOssForCausalLM(GptOssConfig(**(TINY_GPT_OSS | (config or {}))))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif p.dim() > 1 and not name.endswith("_bias"):
                p.normal_(0.0, spread)
            else:  # q/k/v/o and expert biases, router biases, sinks
                p.normal_(0.0, 1.0)
    hf.save_pretrained(folder)
    tokenizer = write_tiny_model(folder.parent / f"{folder.name}-tokenizer", "llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    if mxfp4:
        _to_mxfp4(hf, folder, seed)
    hf.generation_config.eos_token_id = None
    return hf.eval()


def _to_mxfp4(hf: Any, folder: Path, seed: int) -> None:
    """Replace the saved experts by random MXFP4 blocks and scales, and ``hf``'s experts by
    their values (as transformers' own dequantization computes them)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(seed + 1)
    files = sorted(folder.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"{folder}: expected one safetensors file, found {len(files)}")
    tensors = load_file(str(files[0]))
    for layer in hf.model.layers:
        experts = layer.mlp.experts
        for proj in ("gate_up_proj", "down_proj"):
            param = getattr(experts, proj)  # [E, in, out]
            e, k, n = param.shape
            blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(124, 128, (e, n, k // 32), generator=g, dtype=torch.uint8)
            name = next(key for key, value in tensors.items() if value.shape == param.shape
                        and key.endswith(f"layers.{layer.self_attn.layer_idx}.mlp.experts.{proj}"))
            del tensors[name]
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            with torch.no_grad():
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, str(files[0]), metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = MXFP4_CONFIG
    (folder / "config.json").write_text(json.dumps(raw, indent=2))


__all__ = ["MXFP4_CONFIG", "TINY_GPT_OSS", "write_gpt_oss"]
