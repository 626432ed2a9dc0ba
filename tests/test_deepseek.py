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
from engine.models import deepseek
from engine.models.config import ModelConfig
from engine.models.layers.shard import tensor_parallel_problem
from engine.models.loader import load_model
from engine.ops import get_ops
from engine.runner.kv_cache import allocate_kv_caches, bytes_per_block, copy_blocks
from engine.runner.model_runner import ModelRunner

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


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_prompt_chunks_expanded_from_the_latent_match_the_absorbed_form(written, kv_cache_dtype, monkeypatch) -> None:
    """vLLM's MLA prefill: a step's prompt chunks attend as multi-head attention over their
    context's blocks expanded from the latent, its one-token requests over the latent with
    absorbed queries. The oracle is every row in the absorbed form (the decode path, itself
    against transformers above), over the same cache: plain, int8 or fp8 codes."""
    folder, prompts, _ = written
    loaded = load_model(folder, dtype="float32")
    splits = []
    make = deepseek._split_step
    monkeypatch.setattr(deepseek, "_split_step", lambda meta, bs: splits.append(make(meta, bs)) or splits[-1])
    runs = []
    for expanded in (True, False):
        runner = ModelRunner(loaded, device="cpu", ops=get_ops("cpu"), num_blocks=128, block_size=4,
                             max_num_batched_tokens=512, max_num_seqs=8, kv_cache_dtype=kv_cache_dtype)
        runner.model.prefill_expanded = expanded
        runs.append(run_greedy(runner, prompts, NEW_TOKENS, chunk_size=5, block_size=4))
    # Steps with prompt chunks were split, one-token requests beside the chunks.
    assert splits and any(s.decode_rows is not None for s in splits)
    for got, want in zip(*runs, strict=True):
        assert [s.token_id for s in got] == [s.token_id for s in want]
        torch.testing.assert_close(torch.tensor([s.logprob for s in got]), torch.tensor([s.logprob for s in want]),
                                   atol=1e-4, rtol=0)


@pytest.mark.kernels
def test_deepseek_on_the_triton_kernels_matches_transformers(written) -> None:
    """The latent cache through the Triton kernels (interpreted on CPU): one KV head read as
    both K and V, a head width past whole vectors (24)."""
    folder, prompts, expected = written
    loaded = load_model(folder, dtype="float32")
    runs = run_greedy(_runner(loaded, 4, "triton"), prompts[:2], 3, chunk_size=5, block_size=4)
    for run, (want_tokens, want_logprobs) in zip(runs, expected[:2], strict=True):
        assert [s.token_id for s in run] == want_tokens[:3]
        got = torch.tensor([s.logprob for s in run], dtype=torch.float64)
        torch.testing.assert_close(got, torch.tensor(want_logprobs[:3], dtype=torch.float64), atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_cache_keeps_one_latent_tensor_a_layer(kv_cache_dtype: str) -> None:
    """One tensor a layer serves as K and V, so a block costs each layer ``block_size x
    (kv_lora_rank + qk_rope_head_dim)`` values where transformers' cache holds every head's
    key and value; beam search's block copies go through it once."""
    config = ModelConfig.from_hf({"architectures": ["DeepseekV3ForCausalLM"], **TINY_DEEPSEEK})
    caches = allocate_kv_caches(config, 6, 4, torch.float32, "cpu", kv_cache_dtype=kv_cache_dtype)
    assert len(caches) == TINY_DEEPSEEK["num_hidden_layers"] and all(k is v for k, v in caches)
    width = TINY_DEEPSEEK["kv_lora_rank"] + TINY_DEEPSEEK["qk_rope_head_dim"]
    assert tuple(caches[0][0].shape) == (6, 4, 1, width)
    per_value = 4 if kv_cache_dtype == "auto" else 1 + 4 / width  # int8 codes and a scale a token
    assert bytes_per_block(config, torch.float32, 4, kv_cache_dtype=kv_cache_dtype) == round(
        TINY_DEEPSEEK["num_hidden_layers"] * 4 * width * per_value)
    expanded = TINY_DEEPSEEK["num_attention_heads"] * (
        TINY_DEEPSEEK["qk_nope_head_dim"] + TINY_DEEPSEEK["qk_rope_head_dim"] + TINY_DEEPSEEK["v_head_dim"])
    assert expanded > 2 * width  # what the latent saves even at this tiny shape
    k = caches[1][0]
    data = k.data if kv_cache_dtype == "int8" else k
    data[2].fill_(1)
    copy_blocks(caches, ((2, 5),), torch.device("cpu"))
    assert bool((data[5] == 1).all()) and bool((data[4] == 0).all())


def test_the_config_reads_the_latent_attention_and_refuses_what_it_does_not_run() -> None:
    raw = {"architectures": ["DeepseekV3ForCausalLM"], **TINY_DEEPSEEK}
    config = ModelConfig.from_hf(raw)
    # The cache's one KV head: the latent and the shared rotated key part (vLLM's MLA cache)
    latent, rotated = raw["kv_lora_rank"], raw["qk_rope_head_dim"]
    assert (config.head_dim, config.num_key_value_heads, config.rotary_dim) == (rotated + latent, 1, rotated)
    assert config.moe.sparse_layers == (1, 2) and config.moe.scoring == "sigmoid"
    assert tensor_parallel_problem(config, 2) is None  # 4 heads: two a rank
    for extra in ({"rope_interleave": False}, {"attention_bias": True}):
        with pytest.raises(UnsupportedModelError):
            ModelConfig.from_hf(raw | extra)
    v2 = ModelConfig.from_hf(raw | {"architectures": ["DeepseekV2ForCausalLM"], "topk_method": "greedy"}).moe
    assert (v2.scoring, v2.n_group, v2.norm_topk_prob) == ("softmax_groups", 1, False)
    with pytest.raises(CorruptModelError, match="topk_method"):
        ModelConfig.from_hf(raw | {"architectures": ["DeepseekV2ForCausalLM"], "topk_method": "noaux_tc"})
