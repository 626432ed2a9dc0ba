"""RoPE tables against transformers' own RoPE initialisers (ROPE_INIT_FUNCTIONS).

The model-level parity tests cover the regimes a greedy request walks through (Phi-3's
long factors past the original length in ``test_parity.test_phi3_longrope_past_the_
original_length_matches_transformers``); here every row of the tables is checked directly
against transformers' frequencies and attention factor.
"""

from __future__ import annotations

import json

import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.models.config import ModelConfig
from engine.models.layers.rope import rope_cos_sin_cache
from engine.models.testing import PHI3_ORIGINAL_POSITIONS, write_tiny_model


def _hf_table(inv_freq: torch.Tensor, factor: float, positions: torch.Tensor) -> torch.Tensor:
    freqs = torch.outer(positions.float(), inv_freq)
    return torch.cat((freqs.cos() * factor, freqs.sin() * factor), dim=-1)


def test_longrope_uses_short_factors_below_the_original_length_and_long_ones_past_it(tmp_path) -> None:
    folder = write_tiny_model(tmp_path, "phi3")
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    table = rope_cos_sin_cache(config, torch.float32, torch.device("cpu"))
    hf_config = AutoConfig.from_pretrained(folder)
    init = ROPE_INIT_FUNCTIONS["longrope"]
    short, factor = init(hf_config, None)
    long, long_factor = init(hf_config, None, seq_len=PHI3_ORIGINAL_POSITIONS + 1)
    assert factor == long_factor > 1  # sqrt(1 + ln 8 / ln 64)
    assert not torch.equal(short, long)
    below = torch.arange(PHI3_ORIGINAL_POSITIONS)
    past = torch.arange(PHI3_ORIGINAL_POSITIONS, config.max_position_embeddings)
    torch.testing.assert_close(table[below], _hf_table(short, factor, below), atol=1e-6, rtol=0)
    torch.testing.assert_close(table[past], _hf_table(long, factor, past), atol=1e-6, rtol=0)


def test_yarn_and_gemma3_local_tables_match_transformers(tmp_path) -> None:
    folder = write_tiny_model(tmp_path / "q", "qwen2")
    raw = json.loads((folder / "config.json").read_text())
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16}
    (folder / "config.json").write_text(json.dumps(raw | {"rope_scaling": yarn}))
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](AutoConfig.from_pretrained(folder), None)
    positions = torch.arange(config.max_position_embeddings)
    torch.testing.assert_close(
        rope_cos_sin_cache(config, torch.float32, torch.device("cpu")), _hf_table(inv, factor, positions),
        atol=1e-6, rtol=0,
    )
    # Gemma 3: the global layers' base and linear scaling; the local ones' own base.
    folder = write_tiny_model(tmp_path / "g", "gemma3")
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    hf_config = AutoConfig.from_pretrained(folder)
    positions = torch.arange(config.max_position_embeddings)
    for local, layer_type in ((False, "full_attention"), (True, "sliding_attention")):
        params = hf_config.rope_parameters[layer_type]
        if params["rope_type"] == "default":  # transformers has no initialiser entry for it
            inv, factor = 1.0 / params["rope_theta"] ** (torch.arange(0, 16, 2).float() / 16), 1.0
        else:
            inv, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config, None, layer_type=layer_type)
        got = rope_cos_sin_cache(config, torch.float32, torch.device("cpu"), local=local)
        torch.testing.assert_close(got, _hf_table(inv, factor, positions), atol=1e-6, rtol=0)
