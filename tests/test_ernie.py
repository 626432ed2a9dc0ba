"""ERNIE 4.5's dense models (``Ernie4_5ForCausalLM``: ERNIE-4.5-0.3B): the Llama layer with
RoPE on interleaved pairs, q and k reordered at build time so the rotate-half RoPE turns
the same pairs. Built and written by transformers; greedy tokens and their logprobs
against transformers' on both op sets (the C kernels' decode steps fused), with a tied and
an untied head; biases on the projections refused by name."""

from __future__ import annotations

import pytest
import torch
from hf_written import assert_greedy_matches, write_hf_model
from transformers import (
    Ernie4_5_MoeConfig,
    Ernie4_5_MoeForCausalLM,
    Ernie4_5Config,
    Ernie4_5ForCausalLM,
)

from engine.errors import UnsupportedModelError
from engine.models.config import ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


@pytest.mark.parametrize("ops", ["torch", "cpu"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_ernie4_5_greedy_tokens_and_logprobs_match_transformers(tmp_path, ops: str, tied: bool) -> None:
    torch.manual_seed(0)
    hf = write_hf_model(Ernie4_5ForCausalLM(Ernie4_5Config(**TINY, tie_word_embeddings=tied)), tmp_path / "ernie",
                        norms=True)
    loaded = assert_greedy_matches(hf, tmp_path / "ernie", ops, fused=True)
    assert loaded.config.architecture == "ernie4_5" and loaded.config.tie_word_embeddings == tied


@pytest.mark.parametrize("ops", ["torch", "cpu"])
def test_ernie4_5_moe_greedy_tokens_and_logprobs_match_transformers(tmp_path, ops: str) -> None:
    """The MoE models: softmax scores chosen with a selection bias (moe_statics), an
    ungated shared expert, sparse layers from moe_layer_start_index to the end index."""
    torch.manual_seed(0)
    hf = Ernie4_5_MoeForCausalLM(Ernie4_5_MoeConfig(
        **TINY, moe_intermediate_size=32, moe_num_experts=8, moe_k=2, moe_num_shared_experts=1,
        moe_layer_start_index=1, moe_layer_end_index=1, tie_word_embeddings=False))
    with torch.no_grad():  # a selection bias large enough to move the choice
        hf.model.layers[1].mlp.gate.moe_statics.e_score_correction_bias.normal_(0.0, 0.5)
    hf = write_hf_model(hf, tmp_path / "ernie-moe", norms=True)
    loaded = assert_greedy_matches(hf, tmp_path / "ernie-moe", ops, fused=True)
    assert loaded.config.moe.sparse_layers == (1,) and loaded.config.moe.scoring == "softmax_bias"


def test_biases_on_the_projections_are_refused_by_name() -> None:
    raw = {"architectures": ["Ernie4_5ForCausalLM"], **TINY, "use_bias": True}
    with pytest.raises(UnsupportedModelError, match="use_bias"):
        ModelConfig.from_hf(raw)
