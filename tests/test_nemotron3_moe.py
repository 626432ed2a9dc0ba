"""Nemotron 3 (``NemotronHForCausalLM`` with "E" blocks: NVIDIA-Nemotron-3-Nano-30B-A3B and
up): Nemotron-H's stack with mixture-of-experts blocks. Built and written by transformers
(its ``backbone.*`` names, each expert's ``up_proj``/``down_proj`` apart), the routers and
their selection biases drawn (transformers starts both at zero, where every expert ties).

* One block against transformers' ``NemotronHMoE`` on the same weights: the torch path, and
  on the C kernels up to ``MOE_MAX_TOKENS`` tokens quant.c's ungated ``eng_moe_small``.
* Greedy tokens and logprobs against transformers' on both op sets, with grouped routing,
  and with the latent projections of the larger models.
* Through the whole engine, batched, chunked and preempted; over two tensor-parallel ranks,
  with experts cut inside and dealt out whole.
* The released config's keys, and what is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_written import assert_chunked_greedy_matches, assert_greedy_matches, write_hf_model
from hybrid_helpers import assert_engine_matches, draw_mamba_parameters, prompts_of
from test_nemotron_h import TINY, _released

from engine.errors import CorruptModelError, UnsupportedModelError
from engine.models.config import ModelConfig
from engine.models.layers.linear import Linear
from engine.models.layers.moe import SparseMoeBlock
from engine.models.layers.shard import ShardedWeights
from engine.ops import get_ops
from engine.ops.cpu import MOE_MAX_TOKENS
from engine.ops.reference import TorchOps

pytestmark = pytest.mark.usefixtures("one_thread")

MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1, routed_scaling_factor=2.5)


def _draw_routers(hf: Any) -> Any:
    """The routers' weights and selection biases drawn (both start at zero), and the
    experts' weights widened so that the blocks move the logits."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mixer.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif ".mixer.experts." in name or ".shared_experts." in name or "_latent_proj" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return hf


def write_nemotron3(folder: Path, pattern: str = "ME*E-", **extra: Any) -> Any:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(0)
    config = NemotronHConfig(**(TINY | MOE | extra), num_hidden_layers=len(pattern), hybrid_override_pattern=pattern)
    return write_hf_model(_draw_routers(draw_mamba_parameters(NemotronHForCausalLM(config))), folder, norms=True)


@pytest.fixture(scope="module")
def nemotron3(tmp_path_factory) -> tuple[Any, Path]:
    folder = tmp_path_factory.mktemp("nemotron3") / "m"
    return write_nemotron3(folder), folder


@pytest.mark.parametrize("ops", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 40])
@pytest.mark.parametrize("latent", [0, 24])
def test_the_block_matches_transformers_moe(monkeypatch, ops: str, dtype: torch.dtype, tokens: int,
                                            latent: int) -> None:
    """One block's router, experts, shared expert (and latent projections) against
    transformers' ``NemotronHMoE``. On the C kernels up to MOE_MAX_TOKENS tokens take
    quant.c's eng_moe_small (the torch reference is not called), more the reference."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    extra = {"moe_latent_size": latent} if latent else {}
    hf_config = NemotronHConfig(**(TINY | MOE | extra), num_hidden_layers=2, hybrid_override_pattern="ME")
    torch.manual_seed(tokens)
    block = NemotronHMoE(hf_config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
        block.gate.e_score_correction_bias.normal_(0.0, 0.1)
    block = block.to(dtype)
    x = torch.randn(tokens, TINY["hidden_size"]).to(dtype)
    with torch.inference_mode():
        want = block(x[None])[0].float()
    state = {f"model.layers.1.mixer.{k}": v for k, v in block.state_dict().items()}
    for e in range(MOE["n_routed_experts"]):  # the checkpoint's names: each expert apart
        for proj in ("up_proj", "down_proj"):
            state[f"model.layers.1.mixer.experts.{e}.{proj}.weight"] = state[f"model.layers.1.mixer.experts.{proj}"][e]
    config = ModelConfig.from_hf({**hf_config.to_dict(), "architectures": ["NemotronHForCausalLM"]})
    assert config.moe is not None and config.moe.latent_size == latent
    ours = SparseMoeBlock(config, 1, ShardedWeights(state, dtype, "cpu"), Linear)
    calls = []
    reference = TorchOps.fused_moe
    monkeypatch.setattr(TorchOps, "fused_moe", lambda self, *a: calls.append(1) or reference(self, *a))
    with torch.inference_mode():
        got = ours(x, get_ops(ops)).float()
    assert len(calls) == int(ops == "torch" or tokens > MOE_MAX_TOKENS)
    # fp32: the order of sums. bf16: each side rounds its intermediates to bf16 in its own
    # order (transformers sums the experts per expert in fp32, the engine per token).
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("ops", ["torch", "cpu"])
def test_greedy_tokens_and_logprobs_match_transformers(nemotron3, ops: str) -> None:
    hf, folder = nemotron3
    loaded = assert_greedy_matches(hf, folder, ops, fused=False)
    moe, m = loaded.config.moe, loaded.config.mamba
    assert moe is not None and m is not None
    assert (moe.sparse_layers, m.layers, m.mlp_layers) == ((1, 3), (0,), (1, 3, 4))
    assert (moe.n_group, moe.topk_group, moe.routed_scaling_factor, moe.scoring) == (2, 1, 2.5, "sigmoid")


@pytest.mark.parametrize("ops", ["cpu", pytest.param("triton", marks=pytest.mark.kernels)])
def test_in_prompt_chunks_matches_transformers(nemotron3, ops: str) -> None:
    hf, folder = nemotron3
    assert_chunked_greedy_matches(hf, folder, ops, prompts=2, chunk_size=5)


@pytest.mark.parametrize("ops", ["torch", "cpu"])
def test_the_latent_experts_match_transformers(tmp_path, ops: str) -> None:
    hf = write_nemotron3(tmp_path / "m", pattern="E*ME", moe_latent_size=24, n_group=1, topk_group=1,
                         norm_topk_prob=False)
    loaded = assert_greedy_matches(hf, tmp_path / "m", ops, fused=False)
    assert loaded.config.moe.latent_size == 24 and not loaded.config.moe.norm_topk_prob


async def test_batched_chunked_and_preempted_requests_match_transformers(nemotron3) -> None:
    hf, folder = nemotron3
    stats = await assert_engine_matches(hf, folder, prompts_of((17, 21, 12, 19, 22, 14), 384, seed=9), rounds=2)
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["experts-cut", "experts-whole"])
async def test_two_tensor_parallel_ranks_match_transformers(tmp_path, expert_parallel: bool) -> None:
    hf = write_nemotron3(tmp_path / "m", pattern="ME*E", moe_latent_size=24)
    stats = await assert_engine_matches(hf, tmp_path / "m", prompts_of((17, 21, 12, 19), 384, seed=10),
                                        tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    assert stats.preemptions > 0


def _nano(**extra: Any) -> dict[str, Any]:
    """A config.json with NVIDIA-Nemotron-3-Nano-30B-A3B's MoE keys (a shorter pattern)."""
    nano = dict(hybrid_override_pattern="MEM*EM", hidden_size=2688, num_attention_heads=32, num_key_value_heads=2,
                head_dim=128, mamba_num_heads=64, mamba_head_dim=64, n_routed_experts=128, num_experts_per_tok=6,
                moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712, n_group=1, topk_group=1,
                routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1)
    return _released(**(nano | extra))


def test_the_released_config_reads_its_experts() -> None:
    config = ModelConfig.from_hf(_nano())
    moe, m = config.moe, config.mamba
    assert moe is not None and m is not None
    assert (m.layers, m.mlp_layers, moe.sparse_layers) == ((0, 2, 5), (1, 4), (1, 4))
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_expert_intermediate_size) == (128, 6, 1856, 3712)
    assert (moe.naming, moe.scoring, moe.routed_scaling_factor, moe.latent_size, moe.gated) == (
        "nemotron_h", "sigmoid", 2.5, 0, False)


@pytest.mark.parametrize(("extra", "error", "match"), [
    ({"n_group": 3}, CorruptModelError, "n_group 3"),
    ({"layers_block_type": ["mamba", "moe", "conv"], "hybrid_override_pattern": None}, UnsupportedModelError, "conv"),
    ({"mlp_bias": True}, UnsupportedModelError, "mlp_bias"),
])
def test_what_it_refuses_is_named(extra: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ModelConfig.from_hf(_nano(**extra))
