"""Mamba-2 alone (``Mamba2ForCausalLM``): a Mamba block in every layer, no attention at all.
Built and written by transformers (every Mamba parameter drawn, B and C in two groups);
greedy tokens and logprobs against transformers' on both op sets, whole and in chunks whose
scans span several blocks, with a tied head; through the whole engine (a model with no
KV-cached layer), batched, chunked, preempted and resumed from the prefix cache's state
checkpoints; a config.json that leaves keys out reads transformers' defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_written import assert_chunked_greedy_matches, assert_greedy_matches, write_hf_model
from hybrid_helpers import assert_engine_matches, draw_mamba_parameters, prompts_of

from engine.errors import UnsupportedModelError
from engine.models.config import ModelConfig
from engine.models.layers import mamba
from engine.runner.kv_cache import attention_layers

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(vocab_size=384, hidden_size=64, num_heads=8, head_dim=16, n_groups=2, state_size=16, num_hidden_layers=3,
            tie_word_embeddings=False)


def write_mamba2(folder: Path, **extra: Any) -> Any:
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)
    return write_hf_model(draw_mamba_parameters(Mamba2ForCausalLM(Mamba2Config(**(TINY | extra)))), folder, norms=True)


@pytest.fixture(scope="module")
def mamba2(tmp_path_factory) -> tuple[Any, Path]:
    folder = tmp_path_factory.mktemp("mamba2") / "m"
    return write_mamba2(folder), folder


@pytest.mark.parametrize("ops", ["torch", "cpu"])
def test_greedy_tokens_and_logprobs_match_transformers(mamba2, ops: str) -> None:
    hf, folder = mamba2
    loaded = assert_greedy_matches(hf, folder, ops, fused=False)
    assert loaded.config.mamba is not None and loaded.config.mamba.layers == (0, 1, 2)
    assert attention_layers(loaded.config) == []


@pytest.mark.parametrize("ops", ["torch", "cpu", pytest.param("triton", marks=pytest.mark.kernels)])
def test_in_prompt_chunks_and_scan_blocks_matches_transformers(mamba2, ops: str, monkeypatch) -> None:
    monkeypatch.setattr(mamba, "SCAN_BLOCK", 3)
    hf, folder = mamba2
    assert_chunked_greedy_matches(hf, folder, ops, prompts=5, chunk_size=5)


def test_a_tied_head(tmp_path) -> None:
    hf = write_mamba2(tmp_path / "m", tie_word_embeddings=True, n_groups=1)
    assert hf.lm_head.weight.data_ptr() == hf.backbone.embeddings.weight.data_ptr()
    assert_greedy_matches(hf, tmp_path / "m", "cpu", fused=False)


async def test_batched_chunked_and_preempted_requests_match_transformers(mamba2) -> None:
    hf, folder = mamba2
    stats = await assert_engine_matches(hf, folder, prompts_of((17, 21, 12, 19, 22, 14), 384, seed=9), rounds=2)
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0  # the second round's from checkpoints


def test_a_config_that_leaves_keys_out_reads_transformers_defaults() -> None:
    from transformers import Mamba2Config

    want = Mamba2Config()
    config = ModelConfig.from_hf({"architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2"})
    m = config.mamba
    assert m is not None
    assert (m.n_heads, m.head_dim, m.d_state, m.n_groups, m.d_conv, len(m.layers)) == (
        want.num_heads, want.head_dim, want.state_size, want.n_groups, want.conv_kernel, want.num_hidden_layers)
    assert (m.conv_bias, m.proj_bias, m.residual_in_fp32, (m.dt_min, m.dt_max)) == (
        want.use_conv_bias, want.use_bias, want.residual_in_fp32, tuple(want.time_step_limit))
    assert (config.vocab_size, config.hidden_size, config.rms_norm_eps, config.tie_word_embeddings) == (
        want.vocab_size, want.hidden_size, want.layer_norm_epsilon, want.tie_word_embeddings)
    assert config.eos_token_ids == (want.eos_token_id,)


def test_what_it_refuses_is_named() -> None:
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        ModelConfig.from_hf({"architectures": ["Mamba2ForCausalLM"], "hidden_act": "gelu"})


async def test_two_tensor_parallel_ranks_match_transformers(mamba2) -> None:
    """Each rank its heads and one of the two groups of B and C (Nemotron-H's split, with
    no attention layer beside it)."""
    hf, folder = mamba2
    stats = await assert_engine_matches(hf, folder, prompts_of((17, 21, 12, 19), 384, seed=10), tensor_parallel_size=2)
    assert stats.preemptions > 0
