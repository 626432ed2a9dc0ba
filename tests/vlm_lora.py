"""peft adapters over a vision-language model's language model (LLaVA, Qwen-VL, Gemma 3),
as vLLM serves them: tests/test_llava.py, test_qwen_vl.py and test_gemma3_vision.py
compare the engine's greedy tokens on image prompts with peft's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# The language model's projections only: the towers' layers are named alike.
LM_TARGETS = r".*language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"


def write_vlm_adapter(model: Any, out: Path, targets: str = LM_TARGETS, seed: int = 5) -> Any:
    """A rank-8 peft adapter over transformers' ``model`` (wrapped in place) with random A
    and B (peft starts B at zero, an adapter that changes nothing), saved to ``out``;
    the PeftModel, in eval mode."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(target_modules=targets, r=8, lora_alpha=16,
                                                  lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    peft_model.save_pretrained(out)
    return peft_model.eval()
