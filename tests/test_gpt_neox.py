"""GPT-NeoX (``GPTNeoXForCausalLM``: Pythia, Dolly, RedPajama-INCITE): attention and a
plain MLP side by side on two LayerNorms (or one after the other), q/k/v stored head by
head, a quarter of each head rotated, biases throughout. Built and written by
transformers, biases drawn so a misplaced one shows; greedy tokens and their logprobs
against transformers' on the torch reference, the C kernels and the Triton kernels,
whole and in prompt chunks; the Hub's older config keys (``rotary_pct``,
``rotary_emb_base``) read. Over two tensor-parallel ranks: tests/test_tensor_parallel.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_written import assert_chunked_greedy_matches, assert_greedy_matches, write_hf_model
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from engine.models.config import ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_NEOX = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def write_neox(folder: Path, **extra) -> GPTNeoXForCausalLM:
    torch.manual_seed(0)
    return write_hf_model(GPTNeoXForCausalLM(GPTNeoXConfig(**(TINY_NEOX | extra))), folder, norms=True, biases=0.3)


@pytest.mark.parametrize("ops", ["torch", "cpu"])
@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "sequential"])
def test_gpt_neox_greedy_tokens_and_logprobs_match_transformers(tmp_path, ops: str, parallel: bool) -> None:
    hf = write_neox(tmp_path / "neox", use_parallel_residual=parallel)
    loaded = assert_greedy_matches(hf, tmp_path / "neox", ops, fused=False)
    config = loaded.config
    assert config.parallel_residual == parallel and config.rotary_dim == 4  # a quarter of 16


@pytest.mark.parametrize("ops", ["cpu", pytest.param("triton", marks=pytest.mark.kernels)])
def test_gpt_neox_in_prompt_chunks_with_the_tanh_gelu_matches_transformers(tmp_path, ops: str) -> None:
    hf = write_neox(tmp_path / "neox", hidden_act="gelu_new")
    assert_chunked_greedy_matches(hf, tmp_path / "neox", ops)


def test_the_hubs_older_config_keys_are_read() -> None:
    """Pythia's config.json names the rotated share rotary_pct and the base rotary_emb_base."""
    raw = {"architectures": ["GPTNeoXForCausalLM"], **TINY_NEOX, "rotary_pct": 0.5, "rotary_emb_base": 5000}
    config = ModelConfig.from_hf(raw)
    assert (config.rotary_dim, config.rope_theta, config.attention_bias) == (8, 5000.0, True)
