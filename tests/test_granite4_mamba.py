"""Granite 4's hybrid ("h") models: ``GraniteMoeHybridForCausalLM`` with Mamba-2 layers
between its attention layers. Built and written by transformers (every Mamba parameter
drawn, B and C in two groups); greedy tokens and logprobs against transformers' on both op
sets, whole prompts and prompts in chunks (the scan's blocks cut small, so a chunk spans
several), with and without routed experts beside the shared MLP (the MoE models); then
through the whole engine, requests batched, prefilled in chunks and preempted, on one rank
and over two pipeline stages, against transformers' greedy decoding. The runner's state
slots, and what the engine refuses for such a model (speculation, beam search, LoRA;
tensor parallelism where the heads or groups do not divide; tests/test_tensor_parallel.py
splits it over two ranks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import collect, greedy, token_ids
from hf_written import assert_chunked_greedy_matches, assert_greedy_matches, write_hf_model
from hybrid_helpers import assert_engine_matches, draw_mamba_parameters, prompts_of

import engine
from engine.errors import UnsupportedModelError
from engine.messages import NewRequest, ScheduledChunk, StepPlan
from engine.models.config import ModelConfig
from engine.models.layers import mamba
from engine.models.layers.shard import tensor_parallel_problem
from engine.models.loader import load_model
from engine.models.lora import check_lora_model
from engine.ops import get_ops
from engine.params import SamplingParams
from engine.runner.model_runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = ["mamba", "attention", "mamba"]


def _config(**extra: Any) -> Any:
    from transformers import GraniteMoeHybridConfig

    fields = dict(
        vocab_size=384, hidden_size=64, shared_intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, num_local_experts=0,
        layer_types=LAYERS, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.2,
        logits_scaling=4.0, tie_word_embeddings=False, position_embedding_type="rope",
        mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=8)
    return GraniteMoeHybridConfig(**(fields | extra))


def write_hybrid(folder: Path, **extra: Any) -> Any:
    """A tiny hybrid model, its per-head Mamba parameters (A_log, D, dt_bias) and conv
    biases drawn too, so one read wrong shows."""
    from transformers import GraniteMoeHybridForCausalLM

    torch.manual_seed(0)
    return write_hf_model(draw_mamba_parameters(GraniteMoeHybridForCausalLM(_config(**extra))), folder, norms=True)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> tuple[Any, Path]:
    folder = tmp_path_factory.mktemp("granite4h") / "m"
    return write_hybrid(folder), folder


def test_the_config_reads_the_mamba_layers(hybrid) -> None:
    _, folder = hybrid
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    m = config.mamba
    assert m is not None and m.layers == (0, 2)
    assert (m.n_heads, m.head_dim, m.d_state, m.n_groups, m.d_conv) == (8, 16, 16, 2, 4)
    assert m.conv_dim == 8 * 16 + 2 * 2 * 16 and m.dt_max == float("inf")


@pytest.mark.parametrize("ops", ["torch", "cpu"])
def test_greedy_tokens_and_logprobs_match_transformers(hybrid, ops: str) -> None:
    hf, folder = hybrid
    loaded = assert_greedy_matches(hf, folder, ops, fused=False)
    assert loaded.config.mamba is not None


@pytest.mark.parametrize("ops", ["torch", "cpu", pytest.param("triton", marks=pytest.mark.kernels)])
def test_in_prompt_chunks_and_scan_blocks_matches_transformers(hybrid, ops: str, monkeypatch) -> None:
    # Chunks of 5 tokens, each scanned in blocks of 3: the state crosses blocks within a
    # chunk and chunks within a prompt.
    monkeypatch.setattr(mamba, "SCAN_BLOCK", 3)
    hf, folder = hybrid
    assert_chunked_greedy_matches(hf, folder, ops, prompts=5, chunk_size=5)


@pytest.mark.parametrize("ops", ["torch", "cpu"])
def test_the_moe_models_experts_beside_the_shared_mlp_match_transformers(tmp_path, ops: str) -> None:
    """granite-4.0-h-tiny's layout: 8 routed experts (2 a token) added to the shared MLP
    in every layer, Mamba and attention alike."""
    hf = write_hybrid(tmp_path / "m", num_local_experts=8, num_experts_per_tok=2, intermediate_size=32)
    loaded = assert_greedy_matches(hf, tmp_path / "m", ops, fused=False)
    assert loaded.config.moe is not None and loaded.config.moe.sparse_layers == (0, 1, 2)
    assert_chunked_greedy_matches(hf, tmp_path / "m", ops, prompts=3, chunk_size=5)


def test_without_rope_and_with_projection_biases(tmp_path) -> None:
    hf = write_hybrid(tmp_path / "m", position_embedding_type=None, mamba_proj_bias=True, mamba_n_groups=1,
                      layer_types=["attention", "mamba", "mamba"])
    assert_greedy_matches(hf, tmp_path / "m", "cpu", fused=False)


async def test_batched_chunked_and_preempted_requests_match_transformers(hybrid) -> None:
    hf, folder = hybrid
    prompts = prompts_of((17, 21, 12, 19, 22, 14), 384, seed=7)
    prompts += [prompts[0][:12] + p[:6] for p in prompts[1:3]]  # a common 12-token prefix
    # Two rounds: every slot came back after the first (more requests than max_num_seqs),
    # and the second resumes prompts from the states the first kept at block boundaries.
    stats = await assert_engine_matches(hf, folder, prompts, rounds=2)
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0


async def test_two_pipeline_stages_match_transformers(tmp_path) -> None:
    """Each stage keeps its layers' states and slots; the preemptions reach both, and the
    second round resumes from checkpoints each stage copied for its own layers."""
    hf = write_hybrid(tmp_path / "m", num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "attention"])
    stats = await assert_engine_matches(hf, tmp_path / "m", prompts_of((17, 21, 12, 19), 384, seed=8),
                                        rounds=2, pipeline_parallel_size=2)
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0  # each stage its layers' checkpoints


def _runner(folder: Path, max_num_seqs: int) -> Any:
    return ModelRunner(load_model(folder, dtype="float32"), device="cpu", ops=get_ops("torch"), num_blocks=16,
                       block_size=4, max_num_batched_tokens=64, max_num_seqs=max_num_seqs)


def test_a_preempted_request_gives_its_state_slot_back(hybrid) -> None:
    _, folder = hybrid
    runner = _runner(folder, max_num_seqs=2)
    params = SamplingParams(temperature=0.0, max_tokens=4)

    def new(rid: str) -> NewRequest:
        return NewRequest(rid, (5, 6, 7, 8), params, ())

    first = runner.execute(StepPlan(0, (new("a"), new("b")), (
        ScheduledChunk("a", 0, 4, (0,), True), ScheduledChunk("b", 0, 4, (1,), True)), ()))
    assert not first.failed and runner.state_slots.in_use == 2
    # "c" needs a slot: only b's preemption frees one.
    full = runner.execute(StepPlan(1, (new("c"),), (ScheduledChunk("c", 0, 4, (2,), True),), ()))
    assert [f.sample_id for f in full.failed] == ["c"]
    freed = runner.execute(StepPlan(2, (new("d"),), (ScheduledChunk("d", 0, 4, (2,), True),), (),
                                    preempted_ids=("b",)))
    assert not freed.failed and runner.state_slots.in_use == 2
    # b resumes at position 4 without a state to continue from: its step fails.
    late = runner.execute(StepPlan(3, (), (ScheduledChunk("b", 4, 1, (1, 3), True),), ()))
    assert [f.sample_id for f in late.failed] == ["b"]
    runner.execute(StepPlan(4, (), (), ("a", "d")))
    assert runner.state_slots.in_use == 0


async def test_what_a_model_with_mamba_layers_refuses(hybrid) -> None:
    _, folder = hybrid
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    assert tensor_parallel_problem(config, 2) is None  # a head and a group of B and C a rank
    assert "Mamba layers' 8 heads do not divide by 3" in tensor_parallel_problem(config, 3)
    with pytest.raises(UnsupportedModelError, match="Mamba"):
        check_lora_model(config)
    with pytest.raises(engine.ConfigError) as info:
        async with engine.open_engine(str(folder), dtype="float32", speculative_config={
                "method": "ngram", "num_speculative_tokens": 2}):
            pass
    assert info.value.field == "speculative_config"
    async with engine.open_engine(str(folder), dtype="float32") as eng:
        with pytest.raises(engine.InvalidParamError) as bad:
            await eng.submit([5, 6, 7], SamplingParams(beam_width=2, n=2, max_tokens=4))
        assert bad.value.param == "use_beam_search"
        assert token_ids(await collect(eng, [5, 6, 7], greedy(4)))  # still serving


def test_the_attention_only_model_keeps_the_fused_step(tmp_path) -> None:
    """granite-4.0-micro (no Mamba layer) still runs the fused CPU decode step."""
    hf = write_hybrid(tmp_path / "m", layer_types=["attention"] * 3)
    loaded = assert_greedy_matches(hf, tmp_path / "m", "cpu", fused=True)
    assert loaded.config.mamba is None


def test_unknown_layer_types_are_refused_by_name() -> None:
    raw = _config().to_dict() | {"architectures": ["GraniteMoeHybridForCausalLM"],
                                 "layer_types": ["mamba", "retention", "attention"]}
    with pytest.raises(UnsupportedModelError, match="retention"):
        ModelConfig.from_hf(raw)
