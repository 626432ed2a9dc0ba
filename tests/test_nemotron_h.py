"""NVIDIA's Nemotron-H (``NemotronHForCausalLM``): single-mixer blocks of Mamba-2,
positionless attention and squared-ReLU MLPs. Built and written by transformers (its
``backbone.*`` names; every Mamba parameter drawn, B and C in two groups); greedy tokens
and logprobs against transformers' on both op sets, whole and in chunks whose scans span
several blocks; through the whole engine, batched, chunked and preempted, on one rank
and over two pipeline stages; its config as released (``hybrid_override_pattern``) and
what it refuses."""

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

pytestmark = pytest.mark.usefixtures("one_thread")

# time_step_min near 0 (0 itself breaks its weight init): transformers' port clamps its
# prompt path's dt at it (its decode path and the released checkpoints' own code clamp at
# time_step_limit, (0, inf)), which would leave the oracle disagreeing with itself between
# a prompt and its decode steps.
TINY = dict(vocab_size=384, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=96, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
            max_position_embeddings=256, tie_word_embeddings=False, time_step_min=1e-30)


def write_nemotron_h(folder: Path, pattern: str = "M-*M-", **extra: Any) -> Any:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(0)
    config = NemotronHConfig(**(TINY | extra), num_hidden_layers=len(pattern), hybrid_override_pattern=pattern)
    return write_hf_model(draw_mamba_parameters(NemotronHForCausalLM(config)), folder, norms=True)


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory) -> tuple[Any, Path]:
    folder = tmp_path_factory.mktemp("nemotron_h") / "m"
    return write_nemotron_h(folder), folder


@pytest.mark.parametrize("ops", ["torch", "cpu"])
def test_greedy_tokens_and_logprobs_match_transformers(nemotron, ops: str) -> None:
    hf, folder = nemotron
    loaded = assert_greedy_matches(hf, folder, ops, fused=False)
    m = loaded.config.mamba
    assert m is not None and (m.layers, m.mlp_layers) == ((0, 3), (1, 4))
    assert loaded.config.nope_layers == tuple(range(5))


@pytest.mark.parametrize("ops", ["torch", "cpu", pytest.param("triton", marks=pytest.mark.kernels)])
def test_in_prompt_chunks_and_scan_blocks_matches_transformers(nemotron, ops: str, monkeypatch) -> None:
    monkeypatch.setattr(mamba, "SCAN_BLOCK", 3)
    hf, folder = nemotron
    assert_chunked_greedy_matches(hf, folder, ops, prompts=5, chunk_size=5)


def test_attention_first_one_group_and_the_stored_head_whatever_the_tie_flag(tmp_path) -> None:
    # transformers' NemotronH ties nothing: with the flag set, its head is still lm_head.
    hf = write_nemotron_h(tmp_path / "m", pattern="*M-M", tie_word_embeddings=True, n_groups=1)
    assert not torch.equal(hf.lm_head.weight, hf.model.embeddings.weight)
    assert_greedy_matches(hf, tmp_path / "m", "cpu", fused=False)


async def test_batched_chunked_and_preempted_requests_match_transformers(nemotron) -> None:
    hf, folder = nemotron
    stats = await assert_engine_matches(hf, folder, prompts_of((17, 21, 12, 19, 22, 14), 384, seed=9), rounds=2)
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0  # the second round's from checkpoints


async def test_two_pipeline_stages_match_transformers(tmp_path) -> None:
    """Stage 0 holds a Mamba and an MLP block, stage 1 attention and a Mamba block."""
    hf = write_nemotron_h(tmp_path / "m", pattern="M-*M")
    stats = await assert_engine_matches(hf, tmp_path / "m", prompts_of((17, 21, 12, 19), 384, seed=10),
                                        pipeline_parallel_size=2)
    assert stats.preemptions > 0


def _released(**extra: Any) -> dict[str, Any]:
    """A config.json as NVIDIA-Nemotron-Nano-9B-v2's is written (its keys, a shorter pattern)."""
    return {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": 4480,
            "hybrid_override_pattern": "M-M*-M", "num_hidden_layers": 6, "num_attention_heads": 40,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 15680, "mamba_num_heads": 128,
            "mamba_head_dim": 80, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4, "use_conv_bias": True,
            "mamba_hidden_act": "silu", "mlp_hidden_act": "relu2", "layer_norm_epsilon": 1e-5,
            "time_step_limit": [0.0, float("inf")], "time_step_min": 0.001, "vocab_size": 131072,
            "max_position_embeddings": 131072, "attention_bias": False, "mlp_bias": False, "use_bias": False,
            "tie_word_embeddings": False, **extra}


def test_the_released_config_reads_its_pattern() -> None:
    config = ModelConfig.from_hf(_released())
    m = config.mamba
    assert m is not None
    assert (m.layers, m.mlp_layers, m.n_heads, m.head_dim, m.n_groups, m.d_state) == ((0, 2, 5), (1, 4), 128, 80, 8, 128)
    assert (config.rms_norm_eps, config.head_dim, config.num_key_value_heads) == (1e-5, 128, 8)
    assert (m.dt_min, m.dt_max) == (0.0, float("inf"))


@pytest.mark.parametrize(("extra", "match"), [
    ({"hybrid_override_pattern": "M-X*-M"}, "'X'"),
    ({"mlp_hidden_act": "gelu"}, "mlp_hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mamba_hidden_act": "relu"}, "mamba_hidden_act"),
])
def test_what_it_refuses_is_named(extra: dict, match: str) -> None:
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_hf(_released(**extra))
