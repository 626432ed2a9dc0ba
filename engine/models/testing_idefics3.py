"""Tiny Idefics3 / SmolVLM checkpoints written by transformers' own
``Idefics3ForConditionalGeneration`` / ``SmolVLMForConditionalGeneration``, with random
weights over the tiny Llama's tokenizer plus the image frame tokens, for
tests/test_idefics3.py and bench/vision_tiles.py.

The tower sees tiles of 48 pixels in patches of 8 (6 x 6 patches, pixel-shuffled 2 x 2
into 9 placeholders a tile); the image processor resizes an image's longest edge to 96
pixels and cuts it into up to 2 x 2 tiles, plus the whole image as one more."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer

from engine.models.testing import write_tiny_model

TINY_TILE = 48
TINY_LONGEST_EDGE = 96
FRAME_TOKENS = ("<fake_token_around_image>", "<global-img>", "<image>", "<end_of_utterance>",
                *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)))


def write_tiny_idefics3(path: str | Path, kind: str = "smolvlm", *, seed: int = 0,
                        vision: dict[str, Any] | None = None, tile: int = TINY_TILE,
                        longest_edge: int = TINY_LONGEST_EDGE, scale_factor: int = 2) -> Path:
    """A tiny random SmolVLM (``kind="smolvlm"``) or Idefics3 (``"idefics3"``) in folder
    ``path``: transformers' ``save_pretrained`` layout, the tiny Llama tokenizer with the
    frame tokens, SmolVLM's chat template (transformers' ``DEFAULT_CHAT_TEMPLATE``) and the
    model's image processor. ``vision``: the tower's config over the tiny one's (a bench
    writes a released tower's shape), with its ``tile`` and the processor's ``longest_edge``."""
    # transformers is heavy and only the VLM tests need it: imported here, on use.
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
        SmolVLMImageProcessor,
    )
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    if kind not in ("smolvlm", "idefics3"):
        raise ValueError(f"unknown tiny kind {kind!r}; choose smolvlm or idefics3")
    path = Path(path)
    write_tiny_model(path, "llama", seed=seed, chat_template=DEFAULT_CHAT_TEMPLATE)
    tok = Tokenizer.from_str((path / "tokenizer.json").read_text())
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in FRAME_TOKENS])
    (path / "tokenizer.json").write_text(tok.to_str())
    text = json.loads((path / "config.json").read_text())
    text.update(vocab_size=tok.get_vocab_size(), tie_word_embeddings=False)
    text_cfg = {k: v for k, v in text.items() if k not in ("architectures", "torch_dtype")}
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 image_size=tile, patch_size=8)
    tower.update(vision or {})
    config_cls, model_cls, processor_cls = (
        (SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMImageProcessor) if kind == "smolvlm"
        else (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor))
    cfg = config_cls(text_config=text_cfg, vision_config=tower, scale_factor=scale_factor,
                     image_token_id=tok.token_to_id("<image>"), tie_word_embeddings=False)
    cfg.dtype = "float32"
    torch.manual_seed(seed)
    model = model_cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1) if name.endswith("weight") else p.normal_(0.0, 0.1)
            elif p.dim() > 1:
                p.normal_(0.0, 0.2 if "vision_model" in name else 0.15)
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    tok_config.update(fake_image_token="<fake_token_around_image>", image_token="<image>",
                      global_image_token="<global-img>", end_of_utterance_token="<end_of_utterance>")
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    processor_cls(size={"longest_edge": longest_edge}, max_image_size={"longest_edge": tile},
                  do_image_splitting=True).save_pretrained(path)
    return path


__all__ = ["FRAME_TOKENS", "TINY_LONGEST_EDGE", "TINY_TILE", "write_tiny_idefics3"]
