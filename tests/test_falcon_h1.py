"""TII's Falcon-H1 (``FalconH1ForCausalLM``): attention and a Mamba-2 mixer side by side in
every layer, under muP multipliers. Built and written by transformers (every multiplier
away from 1, a head width other than hidden / heads, every Mamba parameter drawn, B and C
in two groups); greedy tokens and logprobs against transformers' on both op sets, whole
and in chunks whose scans span several blocks, with and without the mixer's gated norm;
through the whole engine, batched, chunked, preempted and from the prefix cache; its
config as released, and what it refuses."""

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
from engine.models.layers.shard import pipeline_parallel_problem, tensor_parallel_problem

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(vocab_size=384, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
            intermediate_size=96, num_hidden_layers=3, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16,
            mamba_n_groups=2, mamba_d_state=16, max_position_embeddings=256, tie_word_embeddings=False,
            # Each multiplier away from 1 and from the others, so one applied in the wrong
            # place (or not at all) moves the tokens.
            embedding_multiplier=1.7, lm_head_multiplier=0.45, key_multiplier=0.6, attention_in_multiplier=1.3,
            attention_out_multiplier=0.8, ssm_in_multiplier=1.25, ssm_out_multiplier=0.35,
            ssm_multipliers=[0.5, 1.4, 0.7, 1.6, 0.9], mlp_multipliers=[1.2, 0.6])


def write_falcon_h1(folder: Path, **extra: Any) -> Any:
    from transformers import FalconH1Config, FalconH1ForCausalLM

    torch.manual_seed(0)
    return write_hf_model(draw_mamba_parameters(FalconH1ForCausalLM(FalconH1Config(**(TINY | extra)))), folder,
                          norms=True)


@pytest.fixture(scope="module")
def falcon(tmp_path_factory) -> tuple[Any, Path]:
    folder = tmp_path_factory.mktemp("falcon_h1") / "m"
    return write_falcon_h1(folder), folder


@pytest.mark.parametrize("ops", ["torch", "cpu"])
def test_greedy_tokens_and_logprobs_match_transformers(falcon, ops: str) -> None:
    hf, folder = falcon
    loaded = assert_greedy_matches(hf, folder, ops, fused=False)
    m, multipliers = loaded.config.mamba, loaded.config.falcon_h1
    assert m is not None and multipliers is not None
    n = hf.config.num_hidden_layers  # each layer two cache layers: its mixer's states at 2 i + 1
    assert (m.layers, loaded.config.num_hidden_layers, m.gated_norm) == (
        tuple(range(1, 2 * n, 2)), 2 * n, hf.config.mamba_rms_norm)
    assert (multipliers.key, loaded.config.embedding_multiplier, m.in_multipliers) == (
        hf.config.key_multiplier, hf.config.embedding_multiplier, tuple(hf.config.ssm_multipliers))


@pytest.mark.parametrize("ops", ["torch", "cpu", pytest.param("triton", marks=pytest.mark.kernels)])
def test_in_prompt_chunks_and_scan_blocks_matches_transformers(falcon, ops: str, monkeypatch) -> None:
    monkeypatch.setattr(mamba, "SCAN_BLOCK", 3)
    hf, folder = falcon
    assert_chunked_greedy_matches(hf, folder, ops, prompts=5, chunk_size=5)


@pytest.mark.parametrize("before", [True, False])
def test_the_mixers_gated_norm_before_and_after_the_gate(tmp_path, before: bool) -> None:
    hf = write_falcon_h1(tmp_path / "m", mamba_rms_norm=True, mamba_norm_before_gate=before, num_hidden_layers=2)
    with torch.no_grad():  # drawn around 1, so a norm skipped or misplaced shows
        for layer in hf.model.layers:
            layer.mamba.norm.weight.normal_(1.0, 0.3)
    hf.save_pretrained(tmp_path / "m")
    loaded = assert_greedy_matches(hf, tmp_path / "m", "cpu", fused=False)
    assert loaded.config.mamba is not None and loaded.config.mamba.norm_before_gate is before


async def test_batched_chunked_and_preempted_requests_match_transformers(falcon) -> None:
    hf, folder = falcon
    stats = await assert_engine_matches(hf, folder, prompts_of((17, 21, 12, 19, 22, 14), 384, seed=9), rounds=2)
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0  # the second round's from checkpoints


async def test_two_tensor_parallel_ranks_match_transformers(falcon) -> None:
    """Each rank keeps its attention heads, its Mamba heads (B and C in two groups, one
    a rank) with their rows of the multiplied in_proj, and its share of the MLP."""
    hf, folder = falcon
    stats = await assert_engine_matches(hf, folder, prompts_of((17, 21, 12, 19), 384, seed=10), tensor_parallel_size=2)
    assert stats.preemptions > 0


def _released(**extra: Any) -> dict[str, Any]:
    """A config.json as Falcon-H1-0.5B-Instruct's is written (its keys, fewer layers)."""
    return {"architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1", "attention_bias": False,
            "attention_in_multiplier": 1.0, "attention_out_multiplier": 0.9375, "embedding_multiplier": 5.656854249492381,
            "head_dim": 64, "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 2048,
            "key_multiplier": 0.39062499999999994, "lm_head_multiplier": 0.0390625, "mamba_chunk_size": 128,
            "mamba_conv_bias": True, "mamba_d_conv": 4, "mamba_d_head": 64, "mamba_d_ssm": 1536, "mamba_d_state": 128,
            "mamba_expand": 2, "mamba_n_groups": 1, "mamba_n_heads": 24, "mamba_norm_before_gate": False,
            "mamba_proj_bias": False, "mamba_rms_norm": False, "mamba_use_mlp": True, "max_position_embeddings": 16384,
            "mlp_bias": False, "mlp_multipliers": [0.8838834764831844, 0.5859375], "num_attention_heads": 8,
            "num_hidden_layers": 4, "num_key_value_heads": 2, "projectors_bias": False, "rms_norm_eps": 1e-05,
            "rope_theta": 100000000000.0, "ssm_in_multiplier": 1.25,
            "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
            "ssm_out_multiplier": 0.23570226039551587, "tie_word_embeddings": False, "vocab_size": 32784, **extra}


def test_the_released_config_reads_every_multiplier() -> None:
    from transformers import FalconH1Config

    raw = _released()
    hf = FalconH1Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    config = ModelConfig.from_hf(raw)
    m, mult = config.mamba, config.falcon_h1
    assert m is not None and mult is not None
    assert (m.layers, m.n_heads, m.head_dim, m.n_groups, m.d_state, m.d_inner) == (
        (1, 3, 5, 7), hf.mamba_n_heads, hf.mamba_d_head, hf.mamba_n_groups, hf.mamba_d_state, hf.mamba_d_ssm)
    assert (m.gated_norm, m.in_multipliers) == (hf.mamba_rms_norm, tuple(hf.ssm_multipliers))
    assert (mult.key, mult.lm_head, mult.attention_out, mult.ssm_in, mult.ssm_out) == (
        hf.key_multiplier, hf.lm_head_multiplier, hf.attention_out_multiplier, hf.ssm_in_multiplier,
        hf.ssm_out_multiplier)
    assert (mult.mlp_gate, mult.mlp_down) == tuple(hf.mlp_multipliers)
    assert (config.embedding_multiplier, config.head_dim, config.rope_theta) == (hf.embedding_multiplier, 64, 1e11)
    assert tensor_parallel_problem(config, 2) is None
    # Stages hold whole layers: its 4 layers (8 cache layers) in at most 4 stages.
    assert pipeline_parallel_problem(config, 4) is None
    assert "4 layers" in (pipeline_parallel_problem(config, 5) or "")


@pytest.mark.parametrize("partition", [None, "1,2"], ids=["even", "1-2"])
async def test_two_pipeline_stages_match_transformers(falcon, partition: str | None) -> None:
    """Each stage holds whole layers, attention and mixer together (an even split of the
    three, two then one, or the partition asked for in layers), and the first stage's
    hidden states reach the second."""
    hf, folder = falcon
    stats = await assert_engine_matches(hf, folder, prompts_of((17, 21, 12, 19), 384, seed=10),
                                        pipeline_parallel_size=2, pipeline_layer_partition=partition)
    assert stats.preemptions > 0


@pytest.mark.parametrize(("extra", "match"), [
    ({"attention_bias": True}, "attention_bias"),
    ({"projectors_bias": True}, "projectors_bias"),
    ({"mamba_proj_bias": True}, "mamba_proj_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_what_it_refuses_is_named(extra: dict, match: str) -> None:
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_hf(_released(**extra))
