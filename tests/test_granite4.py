"""Granite 4's dense attention models (``GraniteMoeHybridForCausalLM`` with attention layers
only and no experts: granite-4.0-micro): Granite's layer with its MLP stored as
``shared_mlp``, with RoPE or without (``position_embedding_type``). Built and written by
transformers; greedy tokens and logprobs against transformers' on both op sets; the Mamba
layers and experts of the hybrid models refused by name."""

from __future__ import annotations

import shutil

import pytest
import torch
from greedy_driver import run_greedy
from test_parity import LOGPROB_ATOL, NEW_TOKENS, _hf_greedy, _prompts, _runner

from engine.errors import UnsupportedModelError
from engine.models.config import ModelConfig
from engine.models.loader import load_model
from engine.models.testing import write_tiny_model

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

    tokenizer_folder = write_tiny_model(tmp_path / "tok", "llama")
    torch.manual_seed(0)
    hf = GraniteMoeHybridForCausalLM(_config(position_embedding_type=rope)).eval()
    with torch.no_grad():  # wider than transformers' 0.02, so the greedy tokens vary
        for name, p in hf.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
            elif "norm" in name:
                p.normal_(1.0, 0.1)
    folder = tmp_path / "granite4"
    hf.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / name, folder / name)
    loaded = load_model(folder, dtype="float32")
    assert loaded.config.intermediate_size == 96
    assert loaded.config.nope_layers == (() if rope == "rope" else (0, 1))
    prompts = _prompts(loaded.config.vocab_size)[:3]
    hf.generation_config.eos_token_id = None  # every token generated, as the runner does
    expected = [_hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert all(len(set(tokens)) > 1 for tokens, _ in expected)
    runner = _runner(loaded, 4, ops)
    runs = run_greedy(runner, prompts, NEW_TOKENS, block_size=4)
    fused = runner.model.fused_step
    assert (fused is not None and fused.steps > 0) == (ops == "cpu")
    for run, (want_tokens, want_logprobs) in zip(runs, expected, strict=True):
        assert [s.token_id for s in run] == want_tokens
        got = torch.tensor([s.logprob for s in run], dtype=torch.float64)
        torch.testing.assert_close(got, torch.tensor(want_logprobs, dtype=torch.float64), atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize(("extra", "match"), [
    ({"layer_types": ["mamba", "attention"]}, "Mamba layers"),
    ({"num_local_experts": 4}, "experts"),
])
def test_granite4_hybrid_and_moe_models_are_refused_by_name(extra: dict, match: str) -> None:
    raw = _config(position_embedding_type="rope").to_dict() | extra
    raw["architectures"] = ["GraniteMoeHybridForCausalLM"]
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_hf(raw)
