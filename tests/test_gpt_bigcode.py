"""GPTBigCode (``GPTBigCodeForCausalLM``: StarCoder, SantaCoder, WizardCoder): GPT-2's
learned-position LayerNorm decoder with one KV head (``multi_query``) and ``nn.Linear``
weights; without ``multi_query`` each head's q/k/v rows are regrouped at load. Built and
written by transformers; greedy tokens and their logprobs against transformers' on the
torch reference and the C kernels, whole and in prompt chunks. Over two tensor-parallel
ranks (the one KV head copied to both): tests/test_tensor_parallel.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_written import assert_chunked_greedy_matches, assert_greedy_matches, write_hf_model
from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_BIGCODE = dict(vocab_size=384, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=1,
                    eos_token_id=2, pad_token_id=0)


def write_bigcode(folder: Path, **extra) -> GPTBigCodeForCausalLM:
    """A tiny GPTBigCode written into ``folder``, its biases drawn so a misplaced one shows."""
    torch.manual_seed(0)
    return write_hf_model(GPTBigCodeForCausalLM(GPTBigCodeConfig(**(TINY_BIGCODE | extra))), folder, norms=True, biases=0.3)


@pytest.mark.parametrize("ops", ["torch", "cpu"])
@pytest.mark.parametrize("multi_query", [True, False], ids=["mqa", "mha"])
def test_gpt_bigcode_greedy_tokens_and_logprobs_match_transformers(tmp_path, ops: str, multi_query: bool) -> None:
    hf = write_bigcode(tmp_path / "bigcode", multi_query=multi_query)
    loaded = assert_greedy_matches(hf, tmp_path / "bigcode", ops, fused=False)
    config = loaded.config
    assert config.num_key_value_heads == (1 if multi_query else TINY_BIGCODE["n_head"])
    assert config.architecture == "gpt_bigcode" and config.tie_word_embeddings


def test_gpt_bigcode_in_prompt_chunks_matches_transformers(tmp_path) -> None:
    hf = write_bigcode(tmp_path / "bigcode")
    assert_chunked_greedy_matches(hf, tmp_path / "bigcode", "cpu")
