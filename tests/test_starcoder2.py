"""StarCoder2 (``Starcoder2ForCausalLM``): the Llama layer's attention in GPT-2's layer
(LayerNorm with biases, biases on every projection, a plain GELU MLP) with a sliding
window on every layer. Built and written by transformers, biases drawn so a misplaced
one shows; greedy tokens and their logprobs against transformers' on the torch reference,
the C kernels and the Triton kernels, whole and in prompt chunks past the window. Over
two tensor-parallel ranks (o's and c_proj's biases added once): tests/test_tensor_parallel.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_written import assert_chunked_greedy_matches, assert_greedy_matches, write_hf_model
from transformers import Starcoder2Config, Starcoder2ForCausalLM

from engine.errors import UnsupportedModelError
from engine.models.config import ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_STARCODER2 = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, sliding_window=8,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0)


def write_starcoder2(folder: Path, **extra) -> Starcoder2ForCausalLM:
    torch.manual_seed(0)
    return write_hf_model(Starcoder2ForCausalLM(Starcoder2Config(**(TINY_STARCODER2 | extra))), folder, norms=True, biases=0.3)


@pytest.mark.parametrize("ops", ["torch", "cpu"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_starcoder2_greedy_tokens_and_logprobs_match_transformers(tmp_path, ops: str, tied: bool) -> None:
    hf = write_starcoder2(tmp_path / "starcoder2", tie_word_embeddings=tied)
    loaded = assert_greedy_matches(hf, tmp_path / "starcoder2", ops, fused=False)
    assert loaded.config.layer_windows == (8, 8) and loaded.config.tie_word_embeddings == tied


@pytest.mark.parametrize("ops", ["cpu", pytest.param("triton", marks=pytest.mark.kernels)])
def test_starcoder2_in_prompt_chunks_past_the_window_matches_transformers(tmp_path, ops: str) -> None:
    hf = write_starcoder2(tmp_path / "starcoder2")
    assert_chunked_greedy_matches(hf, tmp_path / "starcoder2", ops)


def test_checkpoints_without_biases_are_refused_by_name() -> None:
    raw = {"architectures": ["Starcoder2ForCausalLM"], **TINY_STARCODER2}
    assert ModelConfig.from_hf(raw).rms_norm_eps == 1e-5  # norm_epsilon's default
    with pytest.raises(UnsupportedModelError, match="use_bias"):
        ModelConfig.from_hf(raw | {"use_bias": False})
