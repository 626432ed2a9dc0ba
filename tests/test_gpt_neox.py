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
from greedy_driver import run_greedy
from hf_written import assert_greedy_matches, write_hf_model
from test_parity import LOGPROB_ATOL, NEW_TOKENS, _hf_greedy, _prompts, _runner
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from engine.models.config import ModelConfig
from engine.models.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_NEOX = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def write_neox(folder: Path, **extra) -> GPTNeoXForCausalLM:
    torch.manual_seed(0)
    hf = write_hf_model(GPTNeoXForCausalLM(GPTNeoXConfig(**(TINY_NEOX | extra))), folder, norms=True)
    g = torch.Generator().manual_seed(1)  # biases whose greedy tokens vary, either residual layout
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    hf.save_pretrained(folder)
    return hf


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
    loaded = load_model(tmp_path / "neox", dtype="float32")
    prompts = _prompts(loaded.config.vocab_size)[:2]
    new = NEW_TOKENS if ops == "cpu" else 3  # the Triton interpreter is slow
    runs = run_greedy(_runner(loaded, 4, ops), prompts, new, chunk_size=5, block_size=4)
    for run, prompt in zip(runs, prompts, strict=True):
        want_tokens, want_logprobs = _hf_greedy(hf, prompt, new)
        assert [s.token_id for s in run] == want_tokens
        got = torch.tensor([s.logprob for s in run], dtype=torch.float64)
        torch.testing.assert_close(got, torch.tensor(want_logprobs, dtype=torch.float64), atol=LOGPROB_ATOL, rtol=0)


def test_the_hubs_older_config_keys_are_read() -> None:
    """Pythia's config.json names the rotated share rotary_pct and the base rotary_emb_base."""
    raw = {"architectures": ["GPTNeoXForCausalLM"], **TINY_NEOX, "rotary_pct": 0.5, "rotary_emb_base": 5000}
    config = ModelConfig.from_hf(raw)
    assert (config.rotary_dim, config.rope_theta, config.attention_bias) == (8, 5000.0, True)
