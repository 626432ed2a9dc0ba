"""GLM-4 (``Glm4ForCausalLM``: GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1): the Llama layer with
q/k/v biases, norms on each block's output too, gate and up stored fused, and RoPE on
interleaved pairs of half of each head (q's and k's rows and biases laid out for the
rotate-half RoPE at build time). Built and written by transformers, biases drawn so a
misplaced one shows; greedy tokens and their logprobs against transformers' on the torch
reference, the C kernels and the Triton kernels, whole and in prompt chunks. Over two
tensor-parallel ranks: tests/test_tensor_parallel.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_written import assert_chunked_greedy_matches, assert_greedy_matches, write_hf_model
from transformers import Glm4Config, Glm4ForCausalLM

from engine.models.config import ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_GLM4 = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0,
                 eos_token_id=2)


def write_glm4(folder: Path, **extra) -> Glm4ForCausalLM:
    """A tiny GLM-4 written into ``folder``, its q/k/v biases drawn."""
    torch.manual_seed(0)
    hf = Glm4ForCausalLM(Glm4Config(**(TINY_GLM4 | extra)))
    return write_hf_model(hf, folder, norms=True, biases=0.5)


@pytest.mark.parametrize("ops", ["torch", "cpu"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_glm4_greedy_tokens_and_logprobs_match_transformers(tmp_path, ops: str, tied: bool) -> None:
    hf = write_glm4(tmp_path / "glm4", tie_word_embeddings=tied)
    loaded = assert_greedy_matches(hf, tmp_path / "glm4", ops, fused=False)
    assert loaded.config.architecture == "glm4" and loaded.config.tie_word_embeddings == tied


@pytest.mark.parametrize("ops", ["cpu", pytest.param("triton", marks=pytest.mark.kernels)])
def test_glm4_in_prompt_chunks_matches_transformers(tmp_path, ops: str) -> None:
    hf = write_glm4(tmp_path / "glm4")
    assert_chunked_greedy_matches(hf, tmp_path / "glm4", ops)


def test_the_config_reads_half_of_each_head_rotated() -> None:
    raw = {"architectures": ["Glm4ForCausalLM"], **TINY_GLM4, "attention_bias": True}
    config = ModelConfig.from_hf(raw)
    assert (config.architecture, config.rotary_dim, config.attention_bias) == ("glm4", TINY_GLM4["head_dim"] // 2, True)
    full = ModelConfig.from_hf(raw | {"partial_rotary_factor": 1.0})
    assert full.rotary_dim == 0  # all of each head
