"""EXAONE 4 (``Exaone4ForCausalLM``): OLMo's norms-after-the-blocks layout with Llama's norm
rounding, per-head q/k norms, and in its hybrid models global layers without RoPE between
sliding-window ones. Built and written by transformers; greedy tokens and their logprobs
against transformers' on both op sets (the unfused layers: the fused step does not run
this layer), and the layer kinds read as transformers reads them."""

from __future__ import annotations

import shutil

import pytest
import torch
from greedy_driver import run_greedy
from test_parity import LOGPROB_ATOL, NEW_TOKENS, _hf_greedy, _prompts, _runner

from engine.models.loader import load_model
from engine.models.testing import write_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _exaone(tmp_path, **extra):
    from transformers import Exaone4Config, Exaone4ForCausalLM

    tokenizer_folder = write_tiny_model(tmp_path / "tok", "llama")
    config = Exaone4Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           max_position_embeddings=256, tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    hf = Exaone4ForCausalLM(config).eval()
    with torch.no_grad():  # wider than transformers' 0.02, so the greedy tokens vary
        for name, p in hf.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
            elif "norm" in name:
                p.normal_(1.0, 0.1)  # not all ones: a skipped norm weight shows
    folder = tmp_path / "exaone"
    hf.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / name, folder / name)
    return hf, folder


@pytest.mark.parametrize("ops", ["torch", "cpu"])
@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "global"])
def test_exaone4_greedy_tokens_and_logprobs_match_transformers(tmp_path, ops: str, hybrid: bool) -> None:
    # The hybrid layout: layers 0 and 2 slide over 8 tokens with RoPE, 1 and 3 see
    # everything without it (EXAONE 4.0 32B's 3:1 at a smaller period); the 1.2B has no
    # window and RoPE everywhere.
    extra = ({"sliding_window": 8, "sliding_window_pattern": 2} if hybrid
             else {"sliding_window": None, "layer_types": ["full_attention"] * 4})
    hf, folder = _exaone(tmp_path, **extra)
    loaded = load_model(folder, dtype="float32")
    layer_types = hf.config.layer_types
    want_windows = tuple(8 if hybrid and t == "sliding_attention" else 0 for t in layer_types)
    assert loaded.config.layer_windows == want_windows
    assert loaded.config.nope_layers == (tuple(i for i, w in enumerate(want_windows) if not w) if hybrid else ())
    prompts = _prompts(loaded.config.vocab_size)[:3]
    expected = [_hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert all(len(set(tokens)) > 1 for tokens, _ in expected)
    runner = _runner(loaded, 4, ops)
    runs = run_greedy(runner, prompts, NEW_TOKENS, block_size=4)
    assert runner.model.fused_step is None
    for run, (want_tokens, want_logprobs) in zip(runs, expected, strict=True):
        assert [s.token_id for s in run] == want_tokens
        got = torch.tensor([s.logprob for s in run], dtype=torch.float64)
        torch.testing.assert_close(got, torch.tensor(want_logprobs, dtype=torch.float64), atol=LOGPROB_ATOL, rtol=0)
