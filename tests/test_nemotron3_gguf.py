"""Nemotron 3's GGUF files (llama.cpp's ``nemotron_h_moe``) against transformers: written
here as llama.cpp's converter writes them (tests/test_recurrent_gguf.py's writer: the
experts stacked as Mixtral's, up and down alone; the router's selection bias as
``exp_probs_b.bias``; the shared expert's ``*_shexp``; the latent projections
``ffn_latent_down`` / ``ffn_latent_up``; the expert blocks known by their
``feed_forward_length``), from the tiny models tests/test_nemotron3_moe.py builds.
(``bench/recurrent_gguf.py`` runs llama.cpp's own converter on the same family.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hf_written import assert_greedy_matches, assert_kept_blocks_match_dequantized
from hybrid_helpers import assert_engine_matches, prompts_of
from test_nemotron3_moe import write_nemotron3
from test_recurrent_gguf import Q8_0, as_stored, write_gguf

from engine.errors import CorruptModelError, UnsupportedModelError
from engine.models.layers.linear import QuantLinear
from engine.models.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

# The released models route among all experts (n_group 1): the converter writes no count of
# groups used, and llama.cpp refuses a file of several groups without one.
ONE_GROUP = dict(n_group=1, topk_group=1)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("ops", ["torch", "cpu"])
@pytest.mark.parametrize("latent", [None, 24])
def test_an_f32_file_matches_transformers(tmp_path: Path, ops: str, latent: int | None) -> None:
    hf = as_stored(write_nemotron3(tmp_path / "hf", pattern="ME*E-", moe_latent_size=latent, **ONE_GROUP))
    loaded = assert_greedy_matches(hf, write_gguf(tmp_path / "hf", tmp_path / "m.gguf"), ops, fused=False)
    c, got = hf.config, loaded.config
    moe, m = got.moe, got.mamba
    assert moe is not None and m is not None
    assert (moe.sparse_layers, m.layers, m.mlp_layers) == ((1, 3), (0,), (1, 3, 4))
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_expert_intermediate_size) == (
        c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.moe_shared_expert_intermediate_size)
    assert (moe.n_group, moe.topk_group, moe.latent_size, got.intermediate_size) == (
        c.n_group, c.topk_group, latent or 0, c.intermediate_size)
    assert moe.routed_scaling_factor == pytest.approx(c.routed_scaling_factor)


def test_a_q8_0_file_keeps_its_blocks_and_matches_the_dequantized_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mixers, attention, the MLP and the shared experts keep their Q8_0 blocks (the
    expert stacks are read one expert at a time, dequantized)."""
    write_nemotron3(tmp_path / "hf", pattern="ME*E-", **ONE_GROUP)

    def check(runner: Any) -> None:
        shared = [layer.moe.shared_gate_up for layer in runner.model.layers if layer.moe is not None]
        assert len(shared) == 2 and all(isinstance(s, QuantLinear) for s in shared)

    assert_kept_blocks_match_dequantized(write_gguf(tmp_path / "hf", tmp_path / "q8.gguf", quant=Q8_0), monkeypatch,
                                         check)


async def test_the_engine_serves_it_batched_chunked_and_preempted(tmp_path: Path) -> None:
    hf = as_stored(write_nemotron3(tmp_path / "hf", pattern="ME*E", **ONE_GROUP))
    path = write_gguf(tmp_path / "hf", tmp_path / "m.gguf")
    stats = await assert_engine_matches(hf, path, prompts_of((17, 21, 12, 19), 384, seed=21), rounds=2)
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0


def test_experts_of_several_widths_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NVIDIA's Puzzle models give each expert block a width of its own (the converter
    writes them as a list): one MoE config cannot state that, so the file is refused."""
    import gguf

    write_nemotron3(tmp_path / "hf", pattern="ME*E", **ONE_GROUP)
    monkeypatch.setattr(gguf.GGUFWriter, "add_expert_feed_forward_length", lambda self, n: self.add_array(
        gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH.format(arch=self.arch), [0, n, 0, n // 2]))
    path = write_gguf(tmp_path / "hf", tmp_path / "m.gguf")
    with pytest.raises(UnsupportedModelError, match="several widths"):
        load_model(path, dtype="float32")


def test_groups_without_a_count_used_are_refused(tmp_path: Path) -> None:
    """Two expert groups (the converter writes n_group) and no expert_group_used_count (it
    writes none): which groups a token may use is not in the file."""
    write_nemotron3(tmp_path / "hf", pattern="ME*E")
    with pytest.raises(CorruptModelError, match="expert_group_used_count missing"):
        load_model(write_gguf(tmp_path / "hf", tmp_path / "m.gguf"), dtype="float32")


def test_a_multi_token_prediction_block_is_left_unread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nemotron 3 Super's files: the converter appends its MTP block (attention and
    experts, and nextn's own tensors) as one more block, counted in ``block_count`` and
    in the per-block lists, with ``nextn_predict_layers`` 1. The decoder is read without it
    and gives transformers' tokens."""
    import gguf
    import numpy as np

    hf = as_stored(write_nemotron3(tmp_path / "hf", pattern="ME*E", **ONE_GROUP))
    layers, hidden = hf.config.num_hidden_layers, hf.config.hidden_size
    real = {name: getattr(gguf.GGUFWriter, name) for name in (
        "add_block_count", "add_head_count_kv", "add_feed_forward_length", "write_header_to_file")}
    monkeypatch.setattr(gguf.GGUFWriter, "add_block_count", lambda self, n: real["add_block_count"](self, n + 1))
    monkeypatch.setattr(gguf.GGUFWriter, "add_head_count_kv",
                        lambda self, kv: real["add_head_count_kv"](self, [*kv, max(kv)]))
    monkeypatch.setattr(gguf.GGUFWriter, "add_feed_forward_length",
                        lambda self, ff: real["add_feed_forward_length"](self, [*ff, max(ff)]))

    def header(self: Any, *a: Any, **k: Any) -> None:
        self.add_nextn_predict_layers(1)
        rng = np.random.default_rng(3)
        for name, shape in (("attn_norm", (hidden,)), ("nextn.eh_proj", (hidden, 2 * hidden)),
                            ("nextn.enorm", (hidden,))):
            self.add_tensor(f"blk.{layers}.{name}.weight", rng.standard_normal(shape).astype(np.float32))
        real["write_header_to_file"](self, *a, **k)

    monkeypatch.setattr(gguf.GGUFWriter, "write_header_to_file", header)
    path = write_gguf(tmp_path / "hf", tmp_path / "m.gguf")
    loaded = assert_greedy_matches(hf, path, "cpu", fused=False)
    assert loaded.config.num_hidden_layers == layers and loaded.config.moe.sparse_layers == (1, 3)
