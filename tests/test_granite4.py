"""Granite 4's dense attention models (``GraniteMoeHybridForCausalLM`` with attention layers
only and no experts: granite-4.0-micro): Granite's layer with its MLP stored as
``shared_mlp``, with RoPE or without (``position_embedding_type``). Built and written by
transformers; greedy tokens and logprobs against transformers' on both op sets (the Mamba
layers and the experts: test_granite4_mamba.py)."""

from __future__ import annotations

import pytest
import torch
from hf_written import assert_greedy_matches, write_hf_model

from engine.models.config import ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(**extra):
    from transformers import GraniteMoeHybridConfig

    return GraniteMoeHybridConfig(
        vocab_size=384, hidden_size=64, intermediate_size=32, shared_intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, num_local_experts=0,
        layer_types=["attention", "attention"], embedding_multiplier=12.0, residual_multiplier=0.22,
        attention_multiplier=0.2, logits_scaling=4.0, tie_word_embeddings=False, **extra)


@pytest.mark.parametrize("ops", ["torch", "cpu"])
@pytest.mark.parametrize("rope", ["rope", None], ids=["rope", "nope"])
def test_granite4_dense_greedy_tokens_and_logprobs_match_transformers(tmp_path, ops: str, rope) -> None:
    from transformers import GraniteMoeHybridForCausalLM

    torch.manual_seed(0)
    hf = write_hf_model(GraniteMoeHybridForCausalLM(_config(position_embedding_type=rope)), tmp_path / "granite4",
                        norms=True)
    loaded = assert_greedy_matches(hf, tmp_path / "granite4", ops, fused=True)
    assert loaded.config.intermediate_size == 96
    assert loaded.config.nope_layers == (() if rope == "rope" else (0, 1))


def test_granite4_moe_reads_the_experts_width_beside_the_shared_mlp() -> None:
    raw = _config(position_embedding_type="rope").to_dict() | {"num_local_experts": 4, "num_experts_per_tok": 2}
    raw["architectures"] = ["GraniteMoeHybridForCausalLM"]
    config = ModelConfig.from_hf(raw)
    assert config.moe is not None and config.moe.naming == "granite"
    assert (config.moe.intermediate_size, config.intermediate_size) == (32, 96)
