"""Expert parallelism (vLLM's ``--enable-expert-parallel``): a mixture-of-experts layer's
routed experts dealt out whole over the tensor-parallel ranks, E / N to a rank.

The oracle is the same model on one rank (itself checked against transformers in each
family's tests): two spawned gloo ranks (``tp_ranks.run_ranks``) greedy-decode through
their :class:`ModelRunner` and must give the one-rank logits and tokens, within the bound
tensor parallelism's MoE models are held to (the experts' outputs are summed over the
ranks by the all-reduce, in another order). Each rank's experts are the checkpoint's
own, whole, and the pairs a rank runs add up, over the ranks, to the reference fused MoE
of all the experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio
from engine_helpers import collect, greedy, token_ids
from hf_written import write_deepseek_v3, write_glm
from safetensors.torch import load_file
from test_tensor_parallel import _check, _moe, _write_granite_moe
from tp_ranks import expert_parallel_greedy_with_logits, greedy_with_logits, run_ranks

import engine
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.models.config import ModelConfig
from engine.models.layers.moe import expert_share, local_experts
from engine.models.layers.shard import tensor_parallel_problem
from engine.models.loader import load_model
from engine.models.registry import build_model
from engine.models.testing import TINY_MOE_ARCHITECTURES, write_tiny_model
from engine.models.testing_gpt_oss import write_gpt_oss
from engine.ops import get_ops
from engine.ops.moe import fused_moe_reference
from engine.parallel import SINGLE, TensorParallel
from engine.process.worker_rank import rank_place

KEYS = [*TINY_MOE_ARCHITECTURES, "granite_moe", "gpt_oss", "glm4_moe", "deepseek_v3"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, str, bool]]:
    root = tmp_path_factory.mktemp("ep-models")
    out = [(arch, str(write_tiny_model(root / arch, arch)), True) for arch in TINY_MOE_ARCHITECTURES]
    out.append(("granite_moe", str(_write_granite_moe(root / "granite_moe")), True))
    write_gpt_oss(root / "gpt_oss", spread=0.2)
    out.append(("gpt_oss", str(root / "gpt_oss"), True))
    write_glm(root / "glm4_moe")
    out.append(("glm4_moe", str(root / "glm4_moe"), True))
    write_deepseek_v3(root / "deepseek_v3")
    out.append(("deepseek_v3", str(root / "deepseek_v3"), True))
    return out


@pytest.fixture(scope="module")
def two_ranks(models: list[tuple[str, str, bool]]) -> list[dict]:
    return run_ranks(expert_parallel_greedy_with_logits, 2, models)


@pytest.fixture(scope="module")
def one_rank(models: list[tuple[str, str, bool]], one_thread: None) -> dict:
    return greedy_with_logits(SINGLE, models)


@pytest.mark.parametrize("key", KEYS)
def test_experts_dealt_out_over_two_ranks_give_the_one_rank_logits_and_tokens(
    key: str, two_ranks: list[dict], one_rank: dict,
) -> None:
    _check(key, two_ranks, one_rank, _moe)


def test_each_rank_holds_its_share_of_the_checkpoints_experts_whole(tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "mixtral", "mixtral")
    loaded = load_model(folder, dtype="float32")
    stored = load_file(str(folder / "model.safetensors"))
    moe = loaded.config.moe
    for rank in range(2):
        tp = TensorParallel(rank, 2, expert_parallel=True)
        model = build_model(loaded.config, loaded.weights, get_ops("torch"), dtype=torch.float32, tp=tp)
        first, stop = expert_share(moe.num_experts, tp)
        assert (first, stop) == (rank * moe.num_experts // 2, (rank + 1) * moe.num_experts // 2)
        block = model.layers[0].moe
        assert block.w13.shape[0] == block.w2.shape[0] == stop - first
        for i, e in enumerate(range(first, stop)):
            p = f"model.layers.0.block_sparse_moe.experts.{e}."
            assert torch.equal(block.w13[i], torch.cat([stored[p + "w1.weight"], stored[p + "w3.weight"]]))
            assert torch.equal(block.w2[i], stored[p + "w2.weight"])


@pytest.mark.parametrize("ops", ["torch", "cpu"])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_the_ranks_pairs_add_up_to_the_fused_moe_of_every_expert(ops: str, tokens: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, k, world = 8, 32, 16, 2, 4
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / 4
    w2 = torch.randn(experts, hidden, inter, generator=g) / 4
    # Routed to the first rank's experts only when there is one token: the others get none.
    ids = torch.stack([torch.randperm(2 if tokens == 1 else experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    want = fused_moe_reference(x, w13, w2, weights, ids)
    got = torch.zeros_like(want)
    for rank in range(world):
        a, b = expert_share(experts, TensorParallel(rank, world, expert_parallel=True))
        part = local_experts(get_ops(ops), x, w13[a:b].contiguous(), w2[a:b].contiguous(), weights, ids, a)
        if tokens == 1 and rank:
            assert not part.any()
        got += part
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_experts_that_do_not_divide_are_refused_naming_the_count() -> None:
    raw = {"architectures": ["MixtralForCausalLM"], "vocab_size": 384, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 6,
           "num_experts_per_tok": 2}
    config = ModelConfig.from_hf(raw)
    assert tensor_parallel_problem(config, 2, expert_parallel=True) is None
    assert "6 routed experts do not divide by 4" in tensor_parallel_problem(config, 4, expert_parallel=True)
    # tensor parallelism alone cuts each expert's 96 rows, which 4 divides
    assert tensor_parallel_problem(config, 4) is None


def test_the_flag_reaches_every_rank_and_refuses_lora_beside_it() -> None:
    config = EngineConfig(tensor_parallel_size=2, enable_expert_parallel=True)
    assert all(rank_place(config, r, 4).expert_parallel for r in range(2))
    assert not rank_place(EngineConfig(tensor_parallel_size=2), 1, 4).expert_parallel
    with pytest.raises(ConfigError) as err:
        EngineConfig(tensor_parallel_size=2, enable_expert_parallel=True, enable_lora=True)
    assert err.value.field == "enable_expert_parallel"


async def test_an_engine_over_two_worker_ranks_with_expert_parallelism_gives_the_one_rank_tokens(
    tmp_path: Path,
) -> None:
    folder = write_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe")
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12] * 3, [40, 41, 42]]
    results = []
    for extra in ({}, {"tensor_parallel_size": 2, "enable_expert_parallel": True}):
        async with engine.open_engine(model=str(folder), dtype="float32", kv_cache_memory=2**22,
                                      max_num_seqs=4, **extra) as eng:
            outs = {}

            async def one(i: int, eng=eng, outs=outs) -> None:
                outs[i] = token_ids(await collect(eng, prompts[i], greedy(16)))

            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, i)
            results.append(outs)
    assert results[0] == results[1]
