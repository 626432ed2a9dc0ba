"""OLMoE (``OlmoeForCausalLM``: OLMoE-1B-7B): the Llama layer with q and k normed across all
their heads, and routed experts on every layer (a softmax over all, the top k, not
renormalised unless asked). Built and written by transformers; greedy tokens and their
logprobs against transformers' on the torch reference, the C kernels and the Triton
kernels, whole and in prompt chunks. Over two tensor-parallel ranks (each norming its
heads by every rank's sum of squares): tests/test_tensor_parallel.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_written import assert_chunked_greedy_matches, assert_greedy_matches, write_hf_model
from transformers import OlmoeConfig, OlmoeForCausalLM

from engine.errors import UnsupportedModelError
from engine.models.config import ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_OLMOE = dict(vocab_size=384, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=8, num_experts_per_tok=3, max_position_embeddings=256,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def write_olmoe(folder: Path, **extra) -> OlmoeForCausalLM:
    torch.manual_seed(0)
    return write_hf_model(OlmoeForCausalLM(OlmoeConfig(**(TINY_OLMOE | extra))), folder, norms=True)


@pytest.mark.parametrize("ops", ["torch", "cpu"])
@pytest.mark.parametrize("renormalize", [False, True], ids=["plain", "norm_topk_prob"])
def test_olmoe_greedy_tokens_and_logprobs_match_transformers(tmp_path, ops: str, renormalize: bool) -> None:
    hf = write_olmoe(tmp_path / "olmoe", norm_topk_prob=renormalize)
    loaded = assert_greedy_matches(hf, tmp_path / "olmoe", ops, fused=False)
    moe = loaded.config.moe
    assert (moe.num_experts, moe.top_k, moe.norm_topk_prob) == (8, 3, renormalize)
    assert moe.sparse_layers == tuple(range(TINY_OLMOE["num_hidden_layers"]))


@pytest.mark.parametrize("ops", ["cpu", pytest.param("triton", marks=pytest.mark.kernels)])
def test_olmoe_in_prompt_chunks_matches_transformers(tmp_path, ops: str) -> None:
    hf = write_olmoe(tmp_path / "olmoe")
    assert_chunked_greedy_matches(hf, tmp_path / "olmoe", ops)


def test_clip_qkv_is_refused_by_name() -> None:
    raw = {"architectures": ["OlmoeForCausalLM"], **TINY_OLMOE}
    assert ModelConfig.from_hf(raw).qk_norm
    with pytest.raises(UnsupportedModelError, match="clip_qkv"):
        ModelConfig.from_hf(raw | {"clip_qkv": 8.0})
