"""A tiny Gemma 3 vision-language model written by transformers
(``Gemma3ForConditionalGeneration`` with random weights, a 2-layer SigLIP at 56 pixels, 4
placeholders an image), and transformers' own processor and model for it: the oracle of
tests/test_gemma3_vision.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from template_data import GEMMA_3, checkpoint_template
from tokenizers import AddedToken, Tokenizer

from engine.models.testing import write_tiny_model

IMAGE_MARKERS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
# Runs of newlines as single tokens, as Gemma's tokenizer writes them: the processor's
# "\n\n" around an image then merges with a newline beside it.
NEWLINE_RUNS = ("\n\n", "\n\n\n", "\n\n\n\n")
IMAGE_SIZE = 56  # 4 x 4 patches of 14, pooled 2 x 2 into 4 placeholders
MM_TOKENS = 4


def write_tiny_gemma3_vision(folder: Path) -> Path:
    """The model, its tokenizer (the tiny one plus Gemma 3's image tokens and newline runs),
    Gemma 3's chat template and image processor, saved into ``folder``."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    text_folder = write_tiny_model(folder.parent / f"{folder.name}-text", "gemma3")
    tok = Tokenizer.from_file(str(text_folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in IMAGE_MARKERS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NEWLINE_RUNS])
    boi, eoi, soft = (tok.token_to_id(t) for t in IMAGE_MARKERS)
    text = json.loads((text_folder / "config.json").read_text())
    text["vocab_size"] = tok.get_vocab_size()
    text_config = Gemma3TextConfig(**{k: v for k, v in text.items()
                                      if k not in ("architectures", "model_type", "transformers_version")})
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=14,
                                vision_use_head=False)
    config = Gemma3Config(text_config=text_config, vision_config=vision, mm_tokens_per_image=MM_TOKENS,
                          boi_token_index=boi, eoi_token_index=eoi, image_token_index=soft,
                          tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3 if "vision_tower" not in name else 0.1)
            elif "norm" in name:
                p.normal_(0.0 if "vision_tower" not in name else 1.0, 0.1)
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    tok_config = json.loads((text_folder / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = checkpoint_template(GEMMA_3)
    tok_config["extra_special_tokens"] = {"boi_token": IMAGE_MARKERS[0], "eoi_token": IMAGE_MARKERS[1],
                                          "image_token": IMAGE_MARKERS[2]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    Gemma3ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(folder)
    return folder


def hf_gemma3_vision(folder: Path) -> tuple[Any, Any]:
    """transformers' model (fp32, eval) and Gemma 3 processor over ``folder``."""
    from transformers import (
        AutoImageProcessor,
        AutoTokenizer,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
    )

    model = Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = Gemma3Processor(image_processor=AutoImageProcessor.from_pretrained(folder),
                                tokenizer=tokenizer, chat_template=tokenizer.chat_template,
                                image_seq_length=MM_TOKENS)
    return model, processor
