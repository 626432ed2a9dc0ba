"""Qwen3.5 (``Qwen3_5ForCausalLM``, and the text model of ``Qwen3_5ForConditionalGeneration``):
Gated DeltaNet layers between gated attention layers. Built and written by transformers
(the DeltaNet's A_log and dt_bias drawn, two value heads a key head); greedy tokens and
logprobs against transformers' on both op sets, whole and in chunks whose delta-rule
blocks are cut small; through the whole engine, batched, chunked and preempted, on one
rank and over two pipeline stages; the vision-language checkpoint served as text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_written import assert_chunked_greedy_matches, assert_greedy_matches, write_hf_model
from hybrid_helpers import assert_engine_matches, draw_mamba_parameters, prompts_of

from engine.errors import UnsupportedModelError
from engine.models.config import ModelConfig
from engine.models.layers import deltanet
from engine.models.layers.shard import tensor_parallel_problem
from engine.models.lora import check_lora_model

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=256,
            tie_word_embeddings=False, layer_types=LAYERS)


def write_qwen3_5(folder: Path, **extra: Any) -> Any:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(**(TINY | extra))
    return write_hf_model(draw_mamba_parameters(Qwen3_5ForCausalLM(config)), folder, norms=True)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> tuple[Any, Path]:
    folder = tmp_path_factory.mktemp("qwen3_5") / "m"
    return write_qwen3_5(folder), folder


@pytest.mark.parametrize("ops", ["torch", "cpu"])
def test_greedy_tokens_and_logprobs_match_transformers(qwen, ops: str) -> None:
    hf, folder = qwen
    loaded = assert_greedy_matches(hf, folder, ops, fused=False)
    net = loaded.config.deltanet
    assert net is not None and net.layers == (0, 2, 3)
    assert loaded.config.rotary_dim == 8  # a quarter of each 32-wide head


@pytest.mark.parametrize("ops", ["torch", "cpu", pytest.param("triton", marks=pytest.mark.kernels)])
def test_in_prompt_chunks_and_delta_rule_blocks_matches_transformers(qwen, ops: str, monkeypatch) -> None:
    # Chunks of 5 tokens, each in blocks of 3: the state crosses blocks within a chunk and
    # chunks within a prompt.
    monkeypatch.setattr(deltanet, "CHUNK", 3)
    hf, folder = qwen
    assert_chunked_greedy_matches(hf, folder, ops, prompts=5, chunk_size=5)


def test_tied_head_one_value_head_a_key_head_and_the_default_layout(tmp_path) -> None:
    # No layer_types: every fourth layer attends (full_attention_interval).
    extra = dict(TINY, tie_word_embeddings=True, linear_num_value_heads=2, layer_types=None, num_hidden_layers=4)
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    hf = write_hf_model(draw_mamba_parameters(Qwen3_5ForCausalLM(Qwen3_5TextConfig(**extra))), tmp_path / "m",
                        norms=True)
    loaded = assert_greedy_matches(hf, tmp_path / "m", "cpu", fused=False)
    assert loaded.config.deltanet.layers == (0, 1, 2)


async def test_batched_chunked_and_preempted_requests_match_transformers(qwen) -> None:
    hf, folder = qwen
    stats = await assert_engine_matches(hf, folder, prompts_of((17, 21, 12, 19, 22, 14), 384, seed=11), rounds=2)
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0  # the second round's from checkpoints


async def test_two_pipeline_stages_match_transformers(qwen) -> None:
    hf, folder = qwen
    stats = await assert_engine_matches(hf, folder, prompts_of((17, 21, 12, 19), 384, seed=12),
                                        pipeline_parallel_size=2)
    assert stats.preemptions > 0


def test_the_vision_language_checkpoint_serves_its_text_model(tmp_path) -> None:
    """Qwen3.5 as released (``Qwen3_5ForConditionalGeneration``): its language model's
    weights read out of it, greedy text against the same checkpoint in transformers."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen3_5Config(text_config=TINY, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64,
                                                                 num_heads=2, out_hidden_size=64),
                           image_token_id=380, video_token_id=381, vision_start_token_id=382,
                           vision_end_token_id=383)
    hf = write_hf_model(draw_mamba_parameters(Qwen3_5ForConditionalGeneration(config)), tmp_path / "m", norms=True)
    loaded = assert_greedy_matches(hf, tmp_path / "m", "cpu", fused=False, prompts=2)
    assert loaded.config.text_of == "Qwen3_5ForConditionalGeneration"


def test_unknown_layer_types_are_refused_by_name() -> None:
    raw = {"architectures": ["Qwen3_5ForCausalLM"], **TINY, "layer_types": ["linear_attention", "sliding_attention",
                                                                          "full_attention", "linear_attention"]}
    with pytest.raises(UnsupportedModelError, match="sliding_attention"):
        ModelConfig.from_hf(raw)


def test_its_deltanet_layers_are_the_recurrent_ones_the_engine_rules_read(qwen) -> None:
    _, folder = qwen
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    assert config.recurrent is config.deltanet and config.mamba is None
    assert tensor_parallel_problem(config, 2) is None
    assert "Gated DeltaNet layers' 2 key and 4 value heads do not divide by 4" in tensor_parallel_problem(config, 4)
    with pytest.raises(UnsupportedModelError, match="Gated DeltaNet"):
        check_lora_model(config)


@pytest.mark.parametrize("ops", ["torch", "cpu"])
def test_the_moe_models_match_transformers(tmp_path, ops: str) -> None:
    """Qwen3.5-MoE's layout: 8 routed experts (2 a token) and a gated shared expert in
    every layer, DeltaNet and attention alike."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    fields = {k: v for k, v in TINY.items() if k != "intermediate_size"}
    config = Qwen3_5MoeTextConfig(**fields, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=48)
    hf = write_hf_model(draw_mamba_parameters(Qwen3_5MoeForCausalLM(config)), tmp_path / "m", norms=True)
    loaded = assert_greedy_matches(hf, tmp_path / "m", ops, fused=False)
    moe = loaded.config.moe
    assert moe is not None and moe.sparse_layers == (0, 1, 2, 3) and moe.shared_expert_intermediate_size == 48
    assert_chunked_greedy_matches(hf, tmp_path / "m", ops, prompts=3, chunk_size=5)


async def test_two_tensor_parallel_worker_ranks_match_transformers(qwen) -> None:
    """Each rank its heads of every layer and of the DeltaNet states; the preemptions reach
    the worker's slots through the plans it is sent, and the second round resumes from the
    first's state checkpoints, each rank copying its own heads'."""
    hf, folder = qwen
    stats = await assert_engine_matches(hf, folder, prompts_of((17, 21, 12, 19), 384, seed=13),
                                        rounds=2, tensor_parallel_size=2)
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0  # each rank its heads' checkpoints


def write_qwen3_next(folder: Path, **extra: Any) -> Any:
    """Qwen3-Next: Qwen3.5-MoE's layers with its DeltaNet projections stored grouped by key
    head; a dense MLP on the layers mlp_only_layers names (here the second)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    fields = {k: v for k, v in TINY.items() if k != "intermediate_size"}
    config = Qwen3NextConfig(**(fields | dict(intermediate_size=80, num_experts=8, num_experts_per_tok=2,
                                              moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                              mlp_only_layers=[1]) | extra))
    return write_hf_model(draw_mamba_parameters(Qwen3NextForCausalLM(config)), folder, norms=True)


@pytest.mark.parametrize("ops", ["torch", "cpu"])
def test_qwen3_next_matches_transformers(tmp_path, ops: str) -> None:
    hf = write_qwen3_next(tmp_path / "m")
    loaded = assert_greedy_matches(hf, tmp_path / "m", ops, fused=False)
    assert loaded.config.deltanet.grouped and loaded.config.moe.sparse_layers == (0, 2, 3)
    assert_chunked_greedy_matches(hf, tmp_path / "m", ops, prompts=3, chunk_size=5)
