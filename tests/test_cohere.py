"""Cohere's Command R (``CohereForCausalLM``) and Command R7B / A (``Cohere2ForCausalLM``):
attention and the MLP side by side on one bias-free LayerNorm, RoPE on interleaved pairs,
logits times ``logit_scale``; Cohere2's sliding layers with RoPE and global layers without.
Built and written by transformers; greedy tokens and their logprobs against transformers'
on the torch reference, the C kernels and the Triton kernels, whole and in prompt chunks,
past the sliding window. Over two tensor-parallel ranks: tests/test_tensor_parallel.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_written import assert_chunked_greedy_matches, assert_greedy_matches, write_hf_model
from transformers import Cohere2Config, Cohere2ForCausalLM, CohereConfig, CohereForCausalLM

from engine.errors import UnsupportedModelError
from engine.models.config import ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_COHERE = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                   eos_token_id=2, logit_scale=0.25)


def write_cohere(folder: Path, version: int = 2, **extra) -> object:
    """A tiny Command R (``version`` 1) or Cohere2 (a window of 8 on three layers in four)
    written into ``folder``."""
    torch.manual_seed(0)
    if version == 1:
        hf = CohereForCausalLM(CohereConfig(**(TINY_COHERE | extra)))
    else:
        hf = Cohere2ForCausalLM(Cohere2Config(**(TINY_COHERE | {"sliding_window": 8} | extra)))
    return write_hf_model(hf, folder, norms=True)


@pytest.mark.parametrize("ops", ["torch", "cpu"])
@pytest.mark.parametrize("version", [1, 2], ids=["command-r", "cohere2"])
def test_cohere_greedy_tokens_and_logprobs_match_transformers(tmp_path, ops: str, version: int) -> None:
    hf = write_cohere(tmp_path / "cohere", version)
    loaded = assert_greedy_matches(hf, tmp_path / "cohere", ops, fused=False)
    config = loaded.config
    assert config.logit_scale == TINY_COHERE["logit_scale"] and config.tie_word_embeddings
    if version == 2:  # the fourth layer global and without RoPE, the others sliding
        assert config.layer_windows == (8, 8, 8, 0) and config.nope_layers == (3,)


@pytest.mark.parametrize("ops", ["cpu", pytest.param("triton", marks=pytest.mark.kernels)])
def test_cohere2_in_prompt_chunks_past_the_window_matches_transformers(tmp_path, ops: str) -> None:
    hf = write_cohere(tmp_path / "cohere2")
    assert_chunked_greedy_matches(hf, tmp_path / "cohere2", ops)


def test_what_the_layer_leaves_out_is_refused_by_name() -> None:
    raw = {"architectures": ["CohereForCausalLM"], **TINY_COHERE}
    assert ModelConfig.from_hf(raw).rms_norm_eps == 1e-5  # layer_norm_eps's default
    for extra, name in (({"use_qk_norm": True}, "use_qk_norm"), ({"attention_bias": True}, "attention_bias")):
        with pytest.raises(UnsupportedModelError, match=name):
            ModelConfig.from_hf(raw | extra)
