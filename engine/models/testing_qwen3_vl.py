"""Tiny Qwen3-VL checkpoints written by transformers' own ``Qwen3VLForConditionalGeneration``
(and ``Qwen3VLMoeForConditionalGeneration``), with random weights over the tiny models'
tokenizer and the Qwen-VL vision tokens, for tests/test_qwen3_vl.py.

The tower is small but keeps every Qwen3-VL part: patches of 4 pixels merged 2 x 2, a
learned 4 x 4 position grid that each image's own grid resamples (images of 2 x 2 to
16 x 16 patches), three blocks of which blocks 0 and 2 feed DeepStack mergers, and the
decoder's interleaved M-RoPE ([6, 5, 5] over head_dim 32's 16 frequencies)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer

from engine.models.testing import (
    QWEN_VL_TOKENS,
    TINY_QWEN_VL_MAX_PIXELS,
    TINY_QWEN_VL_MIN_PIXELS,
    TINY_QWEN_VL_PATCH,
    write_tiny_model,
)

TINY_QWEN3_VL = ("qwen3_vl", "qwen3_vl_moe")
DEEPSTACK = (0, 2)


def write_tiny_qwen3_vl(path: str | Path, kind: str = "qwen3_vl", *, seed: int = 0,
                        chat_template: str | None = None, hub_layout: bool = True,
                        vision: dict | None = None, max_pixels: int = TINY_QWEN_VL_MAX_PIXELS) -> Path:
    """A tiny random Qwen3-VL (``kind="qwen3_vl"``, a Qwen3 decoder) or Qwen3-VL-MoE
    (``"qwen3_vl_moe"``, Qwen3-MoE's experts, one dense layer) in folder ``path`` as
    transformers' ``save_pretrained`` writes it, with the tiny tokenizer (plus the vision
    tokens) and a ``Qwen2VLImageProcessor`` of patch 4 and the tiny Qwen-VL pixel budget.
    ``hub_layout``: the MoE's stacked experts transposed as the hub's checkpoints hold them
    (``[E, hidden, 2 * inter]``), where transformers 5 saves ``[E, 2 * inter, hidden]``.
    ``vision``: the tower's config over the tiny one's (bench/vision_qwen.py writes the
    released towers' shapes), with the processor's ``max_pixels``."""
    # transformers is heavy and only the VLM tests need it: imported here, on use.
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )

    if kind not in TINY_QWEN3_VL:
        raise ValueError(f"unknown tiny Qwen3-VL kind {kind!r}; choose from {TINY_QWEN3_VL}")
    path = Path(path)
    moe = kind == "qwen3_vl_moe"
    write_tiny_model(path, "qwen3_moe" if moe else "qwen3", seed=seed, chat_template=chat_template)
    tok = Tokenizer.from_str((path / "tokenizer.json").read_text())
    tok.add_special_tokens([AddedToken(t, special=True) for t in QWEN_VL_TOKENS])
    ids = {t: tok.token_to_id(t) for t in QWEN_VL_TOKENS}
    (path / "tokenizer.json").write_text(tok.to_str())
    text = json.loads((path / "config.json").read_text())
    drop = ("architectures", "model_type", "rope_theta", "torch_dtype", "use_sliding_window", "norm_topk_prob")
    text_cfg = {k: v for k, v in text.items() if k not in drop}
    if moe:  # 2 * inter != hidden: the two layouts of the stacked experts differ in shape
        text_cfg["moe_intermediate_size"] = 24
    text_cfg.update(vocab_size=max(ids.values()) + 1, tie_word_embeddings=False)
    text_cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                                   "mrope_section": [6, 5, 5], "mrope_interleaved": True}
    tower = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=4,
                 patch_size=TINY_QWEN_VL_PATCH, temporal_patch_size=2, spatial_merge_size=2,
                 in_channels=3, out_hidden_size=text["hidden_size"], num_position_embeddings=16,
                 deepstack_visual_indexes=list(DEEPSTACK), hidden_act="gelu_pytorch_tanh")
    tower.update(vision or {})
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"],
                  vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    config_cls, model_cls = ((Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration) if moe
                             else (Qwen3VLConfig, Qwen3VLForConditionalGeneration))
    cfg = config_cls(text_config=text_cfg, vision_config=tower, **tokens)
    cfg.dtype = "float32"
    torch.manual_seed(seed)
    model = model_cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            in_tower = "visual" in name
            if "norm" in name:
                p.normal_(1.0, 0.1) if name.endswith("weight") else p.normal_(0.0, 0.1)
            elif "pos_embed" in name or "embed_tokens" in name:
                p.normal_(0.0, 0.5)
            elif p.dim() > 1:
                p.normal_(0.0, 0.15 if in_tower else 0.2)
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    if moe and hub_layout:
        from safetensors.torch import load_file, save_file

        weights = load_file(str(path / "model.safetensors"))
        for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            weights[name] = weights[name].transpose(1, 2).contiguous()
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    Qwen2VLImageProcessor(patch_size=tower["patch_size"], temporal_patch_size=2, merge_size=2,
                          min_pixels=TINY_QWEN_VL_MIN_PIXELS, max_pixels=max_pixels,
                          image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(path)
    return path


__all__ = ["DEEPSTACK", "TINY_QWEN3_VL", "write_tiny_qwen3_vl"]
