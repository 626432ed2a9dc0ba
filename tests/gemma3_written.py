"""A tiny Gemma 3 vision-language model written by transformers
(``Gemma3ForConditionalGeneration`` with random weights, a 2-layer SigLIP at 56 pixels, 4
placeholders an image: engine.models.testing_gemma3), and transformers' own processor and
model for it: the oracle of tests/test_gemma3_vision.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from template_data import GEMMA_3, checkpoint_template

from engine.models.testing_gemma3 import GEMMA3_IMAGE_MARKERS, write_gemma3_vision

IMAGE_MARKERS = GEMMA3_IMAGE_MARKERS
MM_TOKENS = 4


def write_tiny_gemma3_vision(folder: Path) -> Path:
    return write_gemma3_vision(folder, checkpoint_template(GEMMA_3), mm_tokens=MM_TOKENS)


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
                                image_seq_length=model.config.mm_tokens_per_image)
    return model, processor
