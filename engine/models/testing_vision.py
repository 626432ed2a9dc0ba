"""Gemma 3 vision-language checkpoints written by transformers, for the tests
(tests/test_gemma3_vision.py: a tiny one) and benchmarks (bench/vision_gemma3.py: larger
shapes): ``Gemma3ForConditionalGeneration`` with random weights over the tiny models'
tokenizer, Gemma 3's image tokens and runs of newlines added to it (single tokens, as
Gemma's tokenizer writes them), Gemma 3's chat template and image processor."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer

from engine.models.testing import write_tiny_model

GEMMA3_IMAGE_MARKERS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
# Runs of newlines as single tokens: the processor's "\n\n" around an image then merges
# with a newline beside it.
NEWLINE_RUNS = ("\n\n", "\n\n\n", "\n\n\n\n")


def write_gemma3_vision(folder: Path, chat_template: str, *, image_size: int = 56,
                        mm_tokens: int = 4, text: dict[str, Any] | None = None,
                        vision: dict[str, Any] | None = None) -> Path:
    """The model in ``folder``: the tiny Gemma 3's text config with ``text`` over it, a
    SigLIP of ``vision`` (default: 2 layers of 32) at ``image_size`` pixels in patches of
    14, pooled to ``mm_tokens`` placeholders. Weights random at a test-friendly spread
    (matrices 0.3, the tower's 0.1; norms around their identity)."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    folder = Path(folder)
    text_folder = write_tiny_model(folder.parent / f"{folder.name}-text", "gemma3")
    tok = Tokenizer.from_file(str(text_folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in GEMMA3_IMAGE_MARKERS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NEWLINE_RUNS])
    boi, eoi, soft = (tok.token_to_id(t) for t in GEMMA3_IMAGE_MARKERS)
    raw = json.loads((text_folder / "config.json").read_text())
    raw.update(text or {})
    raw["vocab_size"] = max(int(raw["vocab_size"]), tok.get_vocab_size())
    text_config = Gemma3TextConfig(**{k: v for k, v in raw.items()
                                      if k not in ("architectures", "model_type", "transformers_version")})
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    tower.update(vision or {})
    config = Gemma3Config(
        text_config=text_config,
        vision_config=SiglipVisionConfig(**tower, image_size=image_size, patch_size=14,
                                         vision_use_head=False),
        mm_tokens_per_image=mm_tokens, boi_token_index=boi, eoi_token_index=eoi,
        image_token_index=soft, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            tower_param = "vision_tower" in name
            if p.dim() > 1:
                p.normal_(0.0, 0.1 if tower_param else 0.3)
            elif "norm" in name:
                p.normal_(1.0 if tower_param else 0.0, 0.1)
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    tok_config = json.loads((text_folder / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = chat_template
    tok_config["extra_special_tokens"] = dict(zip(("boi_token", "eoi_token", "image_token"),
                                                  GEMMA3_IMAGE_MARKERS, strict=True))
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    Gemma3ImageProcessor(size={"height": image_size, "width": image_size}).save_pretrained(folder)
    return folder


__all__ = ["GEMMA3_IMAGE_MARKERS", "NEWLINE_RUNS", "write_gemma3_vision"]
