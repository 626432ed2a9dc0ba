"""DeepSeek-V3 (``DeepseekV3ForCausalLM``: V3, R1, Kimi K2) and DeepSeek-V2
(``DeepseekV2ForCausalLM``: V2-Lite, Coder-V2): multi-head latent attention and their
routed and shared experts. Built and written by transformers (the
selection biases drawn so they move the routing); greedy tokens and their logprobs
against transformers' on both op sets, whole and in chunks, with and without the q
bottleneck, values narrower and wider than the keys, and YaRN with DeepSeek's
``mscale_all_dim`` (which scales the attention's softmax). Over tensor-parallel ranks and
pipeline stages: tests/test_tensor_parallel.py, tests/test_pipeline_parallel.py."""

from __future__ import annotations

import pytest
import torch
from greedy_driver import run_greedy
from hf_written import TINY_DEEPSEEK, write_deepseek_v3
from test_parity import LOGPROB_ATOL, NEW_TOKENS, _hf_greedy, _prompts, _runner
from transformers import AutoModelForCausalLM

from engine.errors import CorruptModelError, UnsupportedModelError
from engine.models.config import ModelConfig
from engine.models.layers.shard import tensor_parallel_problem
from engine.models.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
VARIANTS = {
    # q through a bottleneck, values narrower than the keys (V3's 192 / 128)
    "q-lora": dict(q_lora_rank=24, v_head_dim=12),
    # one q_proj, values wider than the keys (the keys padded in the cache)
    "q-proj": dict(q_lora_rank=None, v_head_dim=20),
    "yarn": dict(q_lora_rank=24, v_head_dim=12, rope_parameters=YARN),
    # DeepSeek-V2 (V2-Lite's one q_proj): softmax scores, top-k over all experts...
    "v2-greedy": dict(version=2, q_lora_rank=None, topk_method="greedy"),
    # ... or among the best groups (ranked by their best score)
    "v2-groups": dict(version=2, q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def written(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek") / request.param
    write_deepseek_v3(folder, **VARIANTS[request.param])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    prompts = _prompts(TINY_DEEPSEEK["vocab_size"])[:3]
    expected = [_hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert all(len(set(tokens)) > 1 for tokens, _ in expected)
    return folder, prompts, expected


@pytest.mark.parametrize("ops", ["torch", "cpu"])
@pytest.mark.parametrize("chunk_size", [None, 5], ids=["whole", "chunk5"])
def test_deepseek_v3_greedy_tokens_and_logprobs_match_transformers(written, ops: str, chunk_size) -> None:
    folder, prompts, expected = written
    loaded = load_model(folder, dtype="float32")
    runs = run_greedy(_runner(loaded, 4, ops), prompts, NEW_TOKENS, chunk_size=chunk_size, block_size=4)
    for run, (want_tokens, want_logprobs) in zip(runs, expected, strict=True):
        assert [s.token_id for s in run] == want_tokens
        got = torch.tensor([s.logprob for s in run], dtype=torch.float64)
        torch.testing.assert_close(got, torch.tensor(want_logprobs, dtype=torch.float64), atol=LOGPROB_ATOL, rtol=0)


def test_the_config_reads_the_latent_attention_and_refuses_what_it_does_not_run() -> None:
    raw = {"architectures": ["DeepseekV3ForCausalLM"], **TINY_DEEPSEEK}
    config = ModelConfig.from_hf(raw)
    assert (config.head_dim, config.num_key_value_heads, config.rotary_dim) == (16, 4, 8)
    assert config.moe.sparse_layers == (1, 2) and config.moe.scoring == "sigmoid"
    assert tensor_parallel_problem(config, 2) is None  # 4 heads: two a rank
    for extra in ({"rope_interleave": False}, {"attention_bias": True}):
        with pytest.raises(UnsupportedModelError):
            ModelConfig.from_hf(raw | extra)
    v2 = ModelConfig.from_hf(raw | {"architectures": ["DeepseekV2ForCausalLM"], "topk_method": "greedy"}).moe
    assert (v2.scoring, v2.n_group, v2.norm_topk_prob) == ("softmax_groups", 1, False)
    with pytest.raises(CorruptModelError, match="topk_method"):
        ModelConfig.from_hf(raw | {"architectures": ["DeepseekV2ForCausalLM"], "topk_method": "noaux_tc"})
