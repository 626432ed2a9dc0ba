"""Tiny InternVL checkpoints written by transformers' own ``InternVLForConditionalGeneration``,
with random weights over the tiny Qwen2's tokenizer plus InternVL's image tokens, for
tests/test_internvl.py.

The tower sees tiles of 32 pixels in patches of 8 (4 x 4 patches, shuffled 2 x 2 into 4
placeholders a tile); the image processor crops an image into up to 4 tiles on the grid
nearest its aspect ratio, plus a thumbnail when there are several."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer

from engine.models.testing import write_tiny_model

INTERNVL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>",
                   "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
# InternVL's chat template writes an image part as <IMG_CONTEXT> and a newline.
INTERNVL_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<IMG_CONTEXT>\\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def write_tiny_internvl(path: str | Path, *, seed: int = 0, text_arch: str = "qwen2",
                        vision: dict[str, Any] | None = None, max_patches: int = 4,
                        text: dict[str, Any] | None = None) -> Path:
    """A tiny random InternVL in folder ``path``: transformers' ``save_pretrained`` layout
    over the tiny ``text_arch`` decoder (qwen2, qwen3), InternVL's image tokens in the
    tokenizer (and its config's ``extra_special_tokens``, as the processor reads them),
    an InternVL chat template, and a ``GotOcr2ImageProcessor`` of 32-pixel tiles.
    ``vision``: the tower's config over the tiny one's (a bench writes a released tower's
    shape), ``max_patches`` the processor's most tiles, ``text`` the decoder's config over
    the tiny one's."""
    # transformers is heavy and only the VLM tests need it: imported here, on use.
    from transformers import GotOcr2ImageProcessor, InternVLConfig, InternVLForConditionalGeneration

    path = Path(path)
    write_tiny_model(path, text_arch, seed=seed, chat_template=INTERNVL_TEMPLATE)
    tok = Tokenizer.from_str((path / "tokenizer.json").read_text())
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in INTERNVL_TOKENS.values()])
    (path / "tokenizer.json").write_text(tok.to_str())
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    tok_config["extra_special_tokens"] = INTERNVL_TOKENS
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    raw = json.loads((path / "config.json").read_text())
    raw.update(text or {})
    raw.update(vocab_size=tok.get_vocab_size(), tie_word_embeddings=False)
    text_cfg = {k: v for k, v in raw.items() if k not in ("architectures", "torch_dtype")}
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 image_size=[32, 32], patch_size=[8, 8], attention_bias=True)
    tower.update(vision or {})
    side = tower["image_size"][0] if isinstance(tower["image_size"], list) else tower["image_size"]
    patch = tower["patch_size"][0] if isinstance(tower["patch_size"], list) else tower["patch_size"]
    cfg = InternVLConfig(text_config=text_cfg, vision_config=tower, downsample_ratio=0.5,
                         image_token_id=tok.token_to_id("<IMG_CONTEXT>"),
                         image_seq_length=(side // patch // 2) ** 2,
                         tie_word_embeddings=False)
    cfg.dtype = "float32"
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1) if name.endswith("weight") else p.normal_(0.0, 0.1)
            elif "lambda" in name:
                p.normal_(0.5, 0.2)
            elif p.dim() > 1:
                p.normal_(0.0, 0.2 if "vision_tower" in name else 0.15)
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    GotOcr2ImageProcessor(size={"height": side, "width": side}, crop_to_patches=True, min_patches=1,
                          max_patches=max_patches).save_pretrained(path)
    return path


__all__ = ["INTERNVL_TEMPLATE", "INTERNVL_TOKENS", "write_tiny_internvl"]
