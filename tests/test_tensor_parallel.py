"""Tensor parallelism's model math (issue 21): every family split over two ranks gives the
one-rank model's logits and greedy tokens.

The ranks are two spawned processes joined by gloo (``tp_ranks.run_ranks``), spawned once
for the module; each builds every tiny model's :class:`ModelRunner` for its rank (its slice
of each layer, its KV heads) and greedy-decodes the same prompts: chunked prefill, then
32 decode steps. The oracle is the same runner on one rank, in this process. In fp32 the
split changes only the order of sums (o, down and the experts' down summed over ranks by
the all-reduce), so the logits agree within 1e-5 and the tokens are the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tp_ranks import BLOCK_SIZE, greedy_with_logits, run_ranks

from engine.errors import UnsupportedModelError
from engine.models.config import ModelConfig
from engine.models.testing import TINY_ARCHITECTURES, TINY_MOE_ARCHITECTURES, write_tiny_model
from engine.parallel import SINGLE, TensorParallel
from engine.parallel.shard import kv_head_range, tensor_parallel_problem

LOGIT_ATOL = 1e-5
FAMILIES = TINY_ARCHITECTURES + TINY_MOE_ARCHITECTURES


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, str, str]]:
    root = tmp_path_factory.mktemp("tp-models")
    return [(arch, str(write_tiny_model(root / arch, arch)), "auto") for arch in FAMILIES]


@pytest.fixture(scope="module")
def two_ranks(models: list[tuple[str, str, str]]) -> list[dict]:
    return run_ranks(greedy_with_logits, 2, models)


@pytest.fixture(scope="module")
def one_rank(models: list[tuple[str, str, str]], one_thread: None) -> dict:
    return greedy_with_logits(SINGLE, models)


@pytest.mark.parametrize("arch", FAMILIES)
def test_two_ranks_give_the_one_rank_logits_and_tokens(arch: str, two_ranks: list[dict], one_rank: dict) -> None:
    want_tokens, want_logits = one_rank[arch]
    for rank, result in enumerate(two_ranks):
        tokens, logits = result[arch]
        assert len(logits) == len(want_logits)
        for step, (got, want) in enumerate(zip(logits, want_logits, strict=True)):
            assert got.shape == want.shape  # the full vocabulary, gathered
            torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=0, msg=lambda m, s=step, r=rank: f"rank {r} step {s}: {m}")
        assert tokens == want_tokens
    # Every rank samples the same tokens from the same gathered logits.
    assert all(torch.equal(a, b) for a, b in zip(two_ranks[0][arch][1], two_ranks[1][arch][1], strict=True))


def _config(**overrides) -> ModelConfig:
    raw = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3,
    }
    return ModelConfig.from_hf(raw | overrides)


def test_a_model_whose_heads_do_not_divide_is_refused_naming_the_counts() -> None:
    smollm2 = _config()  # SmolLM2-135M's shape: 9 query and 3 KV heads
    problem = tensor_parallel_problem(smollm2, 2)
    assert problem is not None
    assert "num_attention_heads (9)" in problem and "num_key_value_heads (3)" in problem
    assert tensor_parallel_problem(smollm2, 3) is None
    assert tensor_parallel_problem(smollm2, 1) is None
    # Fewer KV heads than ranks: each KV head is copied, so the ranks must be a multiple.
    assert tensor_parallel_problem(_config(num_attention_heads=12, num_key_value_heads=2), 4) is None
    assert "num_key_value_heads (2)" in tensor_parallel_problem(_config(num_attention_heads=12, num_key_value_heads=2), 3)
    assert "intermediate_size (1537)" in tensor_parallel_problem(_config(num_attention_heads=8, num_key_value_heads=2, intermediate_size=1537), 2)
    assert "vocab_size (49153)" in tensor_parallel_problem(_config(num_attention_heads=8, num_key_value_heads=2, vocab_size=49153), 2)
    from engine.models.llama import build_model
    from engine.ops import get_ops

    with pytest.raises(UnsupportedModelError, match=r"num_attention_heads \(9\)"):
        build_model(smollm2, {}, get_ops("torch"), dtype=torch.float32, tp=TensorParallel(0, 2))


def test_kv_heads_are_split_or_copied_to_the_ranks_whose_queries_read_them() -> None:
    cfg = _config(num_attention_heads=8, num_key_value_heads=2)
    # 4 ranks, 2 KV heads: ranks 0-1 hold query heads 0-3 (KV head 0), ranks 2-3 heads 4-7.
    assert [kv_head_range(cfg, TensorParallel(r, 4)) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_range(cfg, TensorParallel(r, 2)) for r in range(2)] == [(0, 1), (1, 2)]
    from engine.runner.kv_cache import allocate_kv_caches, bytes_per_block

    caches = allocate_kv_caches(cfg, 2, BLOCK_SIZE, torch.float32, "cpu", tp=TensorParallel(1, 4))
    assert caches[0][0].shape == (2, BLOCK_SIZE, 1, cfg.head_dim)
    whole = bytes_per_block(cfg, torch.float32, BLOCK_SIZE)
    assert bytes_per_block(cfg, torch.float32, BLOCK_SIZE, tp=TensorParallel(0, 2)) * 2 == whole


def test_the_model_path_is_unchanged_on_one_rank(tmp_path: Path) -> None:
    """``SINGLE`` cuts nothing: the weights are the checkpoint's own tensors."""
    from engine.models.llama import build_model
    from engine.models.loader import load_model
    from engine.ops import get_ops

    loaded = load_model(write_tiny_model(tmp_path / "m", "qwen2"), dtype="float32")
    model = build_model(loaded.config, loaded.weights, get_ops("torch"), dtype=torch.float32)
    assert model.embed.data_ptr() == loaded.weights["model.embed_tokens.weight"].data_ptr()
    assert model.num_heads == loaded.config.num_attention_heads
