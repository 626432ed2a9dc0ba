"""GLM-4.5 (``Glm4MoeForCausalLM``): the Llama layer with half of each head rotated, q/k/v
biases, optional per-head q/k norms, and DeepSeek-V3's routing (sigmoid scores chosen
with a selection bias among the best expert groups, scaled) with an ungated shared
expert, after a dense first layer. Built and written by transformers with the selection
bias, groups and scale set so each changes the routing; greedy tokens and their logprobs
against transformers' on both op sets (the C kernels' decode steps fused), whole and in
chunks, and the routing against transformers' router on the same logits."""

from __future__ import annotations

import pytest
import torch
from greedy_driver import run_greedy
from hf_written import TINY_GLM, write_glm
from test_parity import LOGPROB_ATOL, NEW_TOKENS, _hf_greedy, _prompts, _runner
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

from engine.models.config import ModelConfig
from engine.models.layers.moe import select_experts_grouped
from engine.models.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "qk-norm"])
def written(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("glm") / "m"
    write_glm(folder, use_qk_norm=request.param)
    hf = Glm4MoeForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    prompts = _prompts(TINY_GLM["vocab_size"])[:3]
    expected = [_hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert all(len(set(tokens)) > 1 for tokens, _ in expected)
    return folder, prompts, expected, request.param


@pytest.mark.parametrize("ops", ["torch", "cpu"])
@pytest.mark.parametrize("chunk_size", [None, 5], ids=["whole", "chunk5"])
def test_glm4_moe_greedy_tokens_and_logprobs_match_transformers(written, ops: str, chunk_size) -> None:
    folder, prompts, expected, qk_norm = written
    loaded = load_model(folder, dtype="float32")
    assert loaded.config.qk_norm == qk_norm and loaded.config.rope_dim == 8  # half of 16
    assert loaded.config.moe.sparse_layers == (1, 2)
    runner = _runner(loaded, 4, ops)
    runs = run_greedy(runner, prompts, NEW_TOKENS, chunk_size=chunk_size, block_size=4)
    for run, (want_tokens, want_logprobs) in zip(runs, expected, strict=True):
        assert [s.token_id for s in run] == want_tokens
        got = torch.tensor([s.logprob for s in run], dtype=torch.float64)
        torch.testing.assert_close(got, torch.tensor(want_logprobs, dtype=torch.float64), atol=LOGPROB_ATOL, rtol=0)
    step = runner.model.fused_step
    assert (step is not None and step.steps > 0) == (ops == "cpu")


@pytest.mark.parametrize(("groups", "kept"), [(1, 1), (4, 2), (4, 1)])
def test_the_routing_is_transformers_router(groups: int, kept: int) -> None:
    raw = TINY_GLM | {"n_group": groups, "topk_group": kept}
    config = Glm4MoeConfig(**raw)
    router = Glm4MoeTopkRouter(config)
    torch.manual_seed(groups * 10 + kept)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.5)
        router.e_score_correction_bias.normal_(0.0, 0.5)
    x = torch.randn(40, raw["hidden_size"])
    _, want_weights, want_ids = router(x)
    moe = ModelConfig.from_hf({"architectures": ["Glm4MoeForCausalLM"], **raw}).moe
    logits = torch.nn.functional.linear(x, router.weight)
    weights, ids = select_experts_grouped(logits, router.e_score_correction_bias, moe)
    order, want_order = ids.sort(-1), want_ids.sort(-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), want_weights.gather(1, want_order.indices))
