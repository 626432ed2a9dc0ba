"""The chat templates real checkpoints ship, kept in ``tests/data/chat_templates`` (see its
README): tests render prompts with them through transformers, the oracle, and through the
engine."""

from __future__ import annotations

from pathlib import Path

_FOLDER = Path(__file__).resolve().parent / "data" / "chat_templates"

# llava-hf/llava-1.5-7b-hf: images first ("<image>\n" each), then each text part and a space.
LLAVA_1_5 = "llava-1.5-7b-hf.jinja"
# Qwen/Qwen2-VL-7B-Instruct (and Qwen2.5-VL-7B-Instruct): parts back to back.
QWEN2_VL = "qwen2-vl-7b-instruct.jinja"
# google/gemma-3-*-it: parts back to back, each text trimmed.
GEMMA_3 = "gemma-3-it.jinja"
# meta-llama/Meta-Llama-3-8B-Instruct: content read as a string (trimmed).
LLAMA_3 = "meta-llama-3-8b-instruct.jinja"
# mistralai/Mistral-Small-3.1-24B-Instruct-2503: parts, tools, tool calls and results.
MISTRAL_SMALL_3_1 = "mistral-small-3.1-24b-instruct-2503.jinja"
# Qwen/Qwen3-8B: content read as a string (a list becomes ""), tools, calls and results.
QWEN3 = "qwen3-8b.jinja"


def checkpoint_template(name: str) -> str:
    """The template file ``name`` of this folder, as the checkpoint ships it."""
    return (_FOLDER / name).read_text(encoding="utf-8")
