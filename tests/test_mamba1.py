"""Mamba-1's selective scan (``MambaForCausalLM``, ``FalconMambaForCausalLM``): a Mamba
block in every layer, each channel's state decaying at rates of its own. Built and written
by transformers (its dt bias, A_log, D and conv bias drawn); greedy tokens and logprobs
against transformers' on both op sets, whole and in chunks (scans cut across the
recurrence's token blocks), FalconMamba's normed dt, B and C, a tied head; through the
whole engine, batched, chunked, preempted and resumed from the prefix cache's state
checkpoints; a config.json that leaves keys out reads transformers' defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import greedy, token_ids
from hf_written import assert_chunked_greedy_matches, assert_greedy_matches, write_hf_model
from hybrid_helpers import assert_engine_matches, draw_mamba_parameters, prompts_of
from test_parity import _hf_greedy

import engine
from engine.errors import UnsupportedModelError
from engine.models.config import ModelConfig
from engine.models.layers import mamba1
from engine.models.layers.shard import tensor_parallel_problem
from engine.runner.kv_cache import attention_layers

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(vocab_size=384, hidden_size=64, state_size=8, num_hidden_layers=3, time_step_rank=6,
            tie_word_embeddings=False)


def write_mamba1(folder: Path, falcon: bool = False, **extra: Any) -> Any:
    import transformers

    name = "FalconMamba" if falcon else "Mamba"
    torch.manual_seed(0)
    hf = getattr(transformers, f"{name}ForCausalLM")(getattr(transformers, f"{name}Config")(**(TINY | extra)))
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():  # dt_proj's bias about its init's range, drawn so one misread shows
        for layer in hf.backbone.layers:
            layer.mixer.dt_proj.bias.copy_(torch.randn(layer.mixer.dt_proj.bias.shape, generator=g) - 2.0)
    return write_hf_model(draw_mamba_parameters(hf), folder, norms=True)


@pytest.fixture(scope="module")
def mamba(tmp_path_factory) -> tuple[Any, Path]:
    folder = tmp_path_factory.mktemp("mamba1") / "m"
    return write_mamba1(folder), folder


@pytest.mark.parametrize("ops", ["torch", "cpu"])
def test_greedy_tokens_and_logprobs_match_transformers(mamba, ops: str) -> None:
    hf, folder = mamba
    loaded = assert_greedy_matches(hf, folder, ops, fused=False)
    m = loaded.config.mamba1
    assert m is not None and (m.layers, m.d_inner, m.dt_rank, m.bcdt_norm_eps) == (
        tuple(range(hf.config.num_hidden_layers)), hf.config.intermediate_size, hf.config.time_step_rank, None)
    assert attention_layers(loaded.config) == []


@pytest.mark.parametrize("ops", ["torch", "cpu", pytest.param("triton", marks=pytest.mark.kernels)])
def test_in_prompt_chunks_matches_transformers(mamba, ops: str, monkeypatch) -> None:
    monkeypatch.setattr(mamba1, "SCAN_TOKENS", 3)
    hf, folder = mamba
    assert_chunked_greedy_matches(hf, folder, ops, prompts=5, chunk_size=5)


def test_falcon_mamba_norms_dt_b_and_c(tmp_path) -> None:
    hf = write_mamba1(tmp_path / "m", falcon=True, mixer_rms_eps=1e-3)
    loaded = assert_greedy_matches(hf, tmp_path / "m", "cpu", fused=False)
    assert loaded.config.mamba1 is not None and loaded.config.mamba1.bcdt_norm_eps == 1e-3


def test_a_tied_head(tmp_path) -> None:
    hf = write_mamba1(tmp_path / "m", tie_word_embeddings=True)
    assert hf.lm_head.weight.data_ptr() == hf.backbone.embeddings.weight.data_ptr()
    assert_greedy_matches(hf, tmp_path / "m", "torch", fused=False)


async def test_batched_chunked_and_preempted_requests_match_transformers(mamba) -> None:
    hf, folder = mamba
    stats = await assert_engine_matches(hf, folder, prompts_of((17, 21, 12, 19, 22, 14), 384, seed=9), rounds=2)
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0  # the second round's from checkpoints


@pytest.mark.parametrize("arch", ["MambaForCausalLM", "FalconMambaForCausalLM"])
def test_a_config_that_leaves_keys_out_reads_transformers_defaults(arch: str) -> None:
    import transformers

    want = getattr(transformers, arch.replace("ForCausalLM", "Config"))()
    config = ModelConfig.from_hf({"architectures": [arch]})
    m = config.mamba1
    assert m is not None
    assert (m.d_inner, m.d_state, m.d_conv, m.dt_rank, len(m.layers), m.conv_bias, m.proj_bias, m.residual_in_fp32) == (
        want.intermediate_size, want.state_size, want.conv_kernel, want.time_step_rank, want.num_hidden_layers,
        want.use_conv_bias, want.use_bias, want.residual_in_fp32)
    assert (config.vocab_size, config.hidden_size, config.rms_norm_eps, config.tie_word_embeddings) == (
        want.vocab_size, want.hidden_size, want.layer_norm_epsilon, want.tie_word_embeddings)
    assert m.bcdt_norm_eps == getattr(want, "mixer_rms_eps", None)
    assert tensor_parallel_problem(config, 2) is None  # no attention heads to divide


@pytest.mark.parametrize("falcon", [False, True], ids=["mamba", "falcon_mamba"])
async def test_two_tensor_parallel_ranks_match_transformers(tmp_path, falcon: bool) -> None:
    """Each rank keeps half the channels (their rows of in_proj, the convolution, dt_proj,
    A and D, and their states); x_proj's dt bottleneck, B and C are summed over the ranks
    before FalconMamba's norms read them."""
    hf = write_mamba1(tmp_path / "m", falcon=falcon)
    stats = await assert_engine_matches(hf, tmp_path / "m", prompts_of((17, 21, 12, 19), 384, seed=10),
                                        tensor_parallel_size=2)
    assert stats.preemptions > 0


def test_channels_that_do_not_divide_are_refused(tmp_path) -> None:
    config = ModelConfig.from_hf({"architectures": ["MambaForCausalLM"], "hidden_size": 64, "intermediate_size": 130,
                                  "vocab_size": 384})
    assert "130 channels" in (tensor_parallel_problem(config, 4) or "")
    biased = ModelConfig.from_hf({"architectures": ["MambaForCausalLM"], "use_bias": True})
    assert "use_bias" in (tensor_parallel_problem(biased, 2) or "")


def test_what_it_refuses_is_named() -> None:
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        ModelConfig.from_hf({"architectures": ["MambaForCausalLM"], "hidden_act": "gelu"})


async def test_two_pipeline_stages_match_transformers(tmp_path) -> None:
    """Stage 0 holds two blocks, stage 1 the other two and the head."""
    hf = write_mamba1(tmp_path / "m", num_hidden_layers=4)
    stats = await assert_engine_matches(hf, tmp_path / "m", prompts_of((17, 21, 12, 19), 384, seed=10),
                                        pipeline_parallel_size=2)
    assert stats.preemptions > 0


async def test_served_with_the_default_pool(mamba) -> None:
    """No layer keeps K/V, so the pool's blocks cost nothing: the engine opens on its
    default budget (no block count given) and serves transformers' greedy tokens."""

    hf, folder = mamba
    prompt = prompts_of((15,), 384, seed=3)[0]
    async with engine.open_engine(str(folder), dtype="float32", max_num_seqs=3, max_model_len=64) as eng:
        async with await eng.submit(prompt, greedy(6)) as stream:
            assert token_ids([out async for out in stream]) == _hf_greedy(hf, prompt, 6)[0]
        assert eng.statistics().kv_blocks_total == 3 * 64 // eng.config.block_size
