"""EXAONE 4 (``Exaone4ForCausalLM``): OLMo's norms-after-the-blocks layout with Llama's norm
rounding, per-head q/k norms, and in its hybrid models global layers without RoPE between
sliding-window ones. Built and written by transformers; greedy tokens and their logprobs
against transformers' on both op sets (the unfused layers: the fused step does not run
this layer), and the layer kinds read as transformers reads them."""

from __future__ import annotations

import pytest
import torch
from hf_written import assert_greedy_matches, write_hf_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("ops", ["torch", "cpu"])
@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "global"])
def test_exaone4_greedy_tokens_and_logprobs_match_transformers(tmp_path, ops: str, hybrid: bool) -> None:
    from transformers import Exaone4Config, Exaone4ForCausalLM

    # The hybrid layout: layers 0 and 2 slide over 8 tokens with RoPE, 1 and 3 see
    # everything without it (EXAONE 4.0 32B's 3:1 at a smaller period); the 1.2B has no
    # window and RoPE everywhere.
    extra = ({"sliding_window": 8, "sliding_window_pattern": 2} if hybrid
             else {"sliding_window": None, "layer_types": ["full_attention"] * 4})
    config = Exaone4Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           max_position_embeddings=256, tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    hf = write_hf_model(Exaone4ForCausalLM(config), tmp_path / "exaone", norms=True)
    loaded = assert_greedy_matches(hf, tmp_path / "exaone", ops, fused=False)
    want_windows = tuple(8 if hybrid and t == "sliding_attention" else 0 for t in hf.config.layer_types)
    assert loaded.config.layer_windows == want_windows
    assert loaded.config.nope_layers == (tuple(i for i, w in enumerate(want_windows) if not w) if hybrid else ())
