"""Gemma 3 checkpoints written by transformers (and sentence-transformers), with random
weights over the tiny models' tokenizer, for the tests (tiny shapes) and benchmarks (real
ones):

* :func:`write_gemma3_vision`: ``Gemma3ForConditionalGeneration``, with Gemma 3's image
  tokens and runs of newlines added to the tokenizer (single tokens, as Gemma's tokenizer
  writes them), Gemma 3's chat template and image processor (tests/test_gemma3_vision.py,
  bench/vision_gemma3.py);
* :func:`write_embedding_gemma`: EmbeddingGemma's sentence-transformers folder, a
  bidirectional ``Gemma3TextModel``, mean pooling, two Dense modules and Normalize
  (tests/test_embedding_gemma.py, bench/embedding_gemma.py)."""

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


def write_embedding_gemma(root: Path, *, text: dict[str, Any] | None = None, dense_mult: int = 3,
                          std: float | None = 0.3) -> Path:
    """A sentence-transformers folder under ``root`` (``root / "st"``, returned): the tiny
    Gemma 3's text config with ``text`` over it as a bidirectional ``Gemma3TextModel``, mean
    pooling, Dense ``hidden -> dense_mult * hidden -> hidden`` without bias (EmbeddingGemma's
    768 -> 3072 -> 768), Normalize. ``std``: the matrices' spread (None: transformers' own
    init). The tokenizer carries no chat template, as EmbeddingGemma's folder reads its
    texts (sentence-transformers 6 would wrap each text in the tiny model's ChatML)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules
    from transformers import AutoTokenizer, Gemma3TextConfig, Gemma3TextModel

    root = Path(root)
    text_folder = write_tiny_model(root / "text", "gemma3")
    raw = json.loads((text_folder / "config.json").read_text())
    raw.update(text or {})
    config = Gemma3TextConfig(**{k: v for k, v in raw.items()
                                 if k not in ("architectures", "model_type", "transformers_version")},
                              use_bidirectional_attention=True)
    torch.manual_seed(0)
    model = Gemma3TextModel(config)
    if std is not None:
        with torch.no_grad():
            for _, p in model.named_parameters():
                p.normal_(0.0, std) if p.dim() > 1 else p.normal_(0.0, 0.1)
    hf = root / "hf"
    model.save_pretrained(hf)
    AutoTokenizer.from_pretrained(text_folder).save_pretrained(hf)
    (hf / "chat_template.jinja").unlink(missing_ok=True)
    tok_config = json.loads((hf / "tokenizer_config.json").read_text())
    tok_config.pop("chat_template", None)
    (hf / "tokenizer_config.json").write_text(json.dumps(tok_config))
    word = modules.Transformer(str(hf))
    dim = word.get_embedding_dimension()
    identity = torch.nn.Identity()
    dense = [modules.Dense(dim, dense_mult * dim, bias=False, activation_function=identity),
             modules.Dense(dense_mult * dim, dim, bias=False, activation_function=identity)]
    if std is not None:
        for layer in dense:
            torch.nn.init.normal_(layer.linear.weight, 0.0, 0.2)
    st = SentenceTransformer(modules=[word, modules.Pooling(dim, "mean"), *dense, modules.Normalize()],
                             device="cpu")
    st.save(str(root / "st"))
    return root / "st"


__all__ = ["GEMMA3_IMAGE_MARKERS", "NEWLINE_RUNS", "write_embedding_gemma", "write_gemma3_vision"]
