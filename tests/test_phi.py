"""Phi-1, 1.5 and 2 (``PhiForCausalLM``): attention and a plain MLP side by side on one
LayerNorm, part of each head rotated (Phi-2's 0.4), biases on every projection and on the
LM head. Built and written by transformers, biases drawn so a misplaced one shows; greedy
tokens and their logprobs against transformers' on the torch reference, the C kernels and
the Triton kernels, whole and in prompt chunks. Over two tensor-parallel ranks (the head's
bias cut with its vocabulary rows): tests/test_tensor_parallel.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_written import assert_chunked_greedy_matches, assert_greedy_matches, write_hf_model
from transformers import PhiConfig, PhiForCausalLM

from engine.errors import UnsupportedModelError
from engine.models.config import ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")

# Phi-2's rotated share (0.4) of a 20-wide head: 8 values
TINY_PHI = dict(vocab_size=384, hidden_size=80, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=256, partial_rotary_factor=0.4, bos_token_id=1, eos_token_id=2,
                pad_token_id=0)


def write_phi(folder: Path, **extra) -> PhiForCausalLM:
    torch.manual_seed(0)
    return write_hf_model(PhiForCausalLM(PhiConfig(**(TINY_PHI | extra))), folder, norms=True, biases=0.3)


@pytest.mark.parametrize("ops", ["torch", "cpu"])
def test_phi_greedy_tokens_and_logprobs_match_transformers(tmp_path, ops: str) -> None:
    hf = write_phi(tmp_path / "phi")
    loaded = assert_greedy_matches(hf, tmp_path / "phi", ops, fused=False)
    assert (loaded.config.architecture, loaded.config.rotary_dim) == ("phi", 8)


@pytest.mark.parametrize("ops", ["cpu", pytest.param("triton", marks=pytest.mark.kernels)])
def test_phi_in_prompt_chunks_matches_transformers(tmp_path, ops: str) -> None:
    hf = write_phi(tmp_path / "phi")
    assert_chunked_greedy_matches(hf, tmp_path / "phi", ops)


def test_qk_layernorm_is_refused_by_name() -> None:
    raw = {"architectures": ["PhiForCausalLM"], **TINY_PHI}
    assert ModelConfig.from_hf(raw).attention_bias
    with pytest.raises(UnsupportedModelError, match="qk_layernorm"):
        ModelConfig.from_hf(raw | {"qk_layernorm": True})
