"""AI21's Jamba (``JambaForCausalLM``): Mamba-1 layers (dt, B and C normed with weights)
and attention layers without positions, experts every other layer (the top-k weights not
renormalised) and SwiGLU MLPs between. Built and written by transformers (its hub names:
one tensor an expert); greedy tokens and logprobs against transformers' on both op sets,
whole and in chunks; through the whole engine, batched, chunked, preempted and from the
prefix cache; over two pipeline stages; its config as released."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_written import assert_chunked_greedy_matches, assert_greedy_matches, write_hf_model
from hybrid_helpers import assert_engine_matches, draw_mamba_parameters, prompts_of

from engine.errors import UnsupportedModelError
from engine.models.config import ModelConfig
from engine.models.layers import mamba1
from engine.runner.kv_cache import attention_layers

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
            attn_layer_period=3, attn_layer_offset=1, mamba_d_state=8, mamba_dt_rank=6, tie_word_embeddings=False,
            max_position_embeddings=256)


def write_jamba(folder: Path, **extra: Any) -> Any:
    from transformers import JambaConfig, JambaForCausalLM

    torch.manual_seed(0)
    hf = JambaForCausalLM(JambaConfig(**(TINY | extra)))
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("dt_proj.bias"):  # about its init's range, drawn so one misread shows
                p.copy_(torch.randn(p.shape, generator=g) - 2.0)
    return write_hf_model(draw_mamba_parameters(hf), folder, norms=True)


@pytest.fixture(scope="module")
def jamba(tmp_path_factory) -> tuple[Any, Path]:
    folder = tmp_path_factory.mktemp("jamba") / "m"
    return write_jamba(folder), folder


@pytest.mark.parametrize("ops", ["torch", "cpu"])
def test_greedy_tokens_and_logprobs_match_transformers(jamba, ops: str) -> None:
    hf, folder = jamba
    loaded = assert_greedy_matches(hf, folder, ops, fused=False)
    c = loaded.config
    assert c.mamba1 is not None and c.moe is not None
    assert (c.mamba1.layers, attention_layers(c), c.moe.sparse_layers) == (
        tuple(i for i, t in enumerate(hf.config.layers_block_type) if t == "mamba"),
        [i for i, t in enumerate(hf.config.layers_block_type) if t == "attention"],
        tuple(i for i, n in enumerate(hf.config.layers_num_experts) if n > 1))


@pytest.mark.parametrize("ops", ["torch", "cpu"])
def test_in_prompt_chunks_matches_transformers(jamba, ops: str, monkeypatch) -> None:
    monkeypatch.setattr(mamba1, "SCAN_TOKENS", 3)
    hf, folder = jamba
    assert_chunked_greedy_matches(hf, folder, ops, prompts=5, chunk_size=5)


async def test_batched_chunked_and_preempted_requests_match_transformers(jamba) -> None:
    hf, folder = jamba
    stats = await assert_engine_matches(hf, folder, prompts_of((17, 21, 12, 19, 22, 14), 384, seed=9), rounds=2)
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0  # the second round's from checkpoints


async def test_two_pipeline_stages_match_transformers(jamba) -> None:
    hf, folder = jamba
    stats = await assert_engine_matches(hf, folder, prompts_of((17, 21, 12, 19), 384, seed=10),
                                        pipeline_parallel_size=2)
    assert stats.preemptions > 0


async def test_two_tensor_parallel_ranks_match_transformers(jamba) -> None:
    """Each rank its Mamba channels, its attention heads and its share of every expert and
    of the dense MLP."""
    hf, folder = jamba
    stats = await assert_engine_matches(hf, folder, prompts_of((17, 21, 12, 19), 384, seed=10),
                                        tensor_parallel_size=2)
    assert stats.preemptions > 0


def test_the_released_config_reads_its_layers() -> None:
    """Jamba-Mini-1.7's config.json (its keys; the defaults of the layer periods)."""
    from transformers import JambaConfig

    raw = {"architectures": ["JambaForCausalLM"], "model_type": "jamba", "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "num_experts": 16, "num_experts_per_tok": 2, "expert_layer_period": 2, "expert_layer_offset": 1,
           "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_d_state": 16, "mamba_d_conv": 4,
           "mamba_expand": 2, "mamba_dt_rank": 256, "mamba_conv_bias": True, "mamba_proj_bias": False,
           "rms_norm_eps": 1e-6, "vocab_size": 65536, "max_position_embeddings": 262144, "tie_word_embeddings": False}
    want = JambaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    config = ModelConfig.from_hf(raw)
    assert config.mamba1 is not None and config.moe is not None
    assert config.mamba1.layers == tuple(i for i, t in enumerate(want.layers_block_type) if t == "mamba")
    assert config.moe.sparse_layers == tuple(i for i, n in enumerate(want.layers_num_experts) if n > 1)
    assert (config.mamba1.d_inner, config.mamba1.dt_rank) == (want.mamba_expand * want.hidden_size, want.mamba_dt_rank)
    assert not config.moe.norm_topk_prob  # JambaTopKRouter keeps the softmax's top-k as they are
    assert config.nope_layers == tuple(range(32))


def test_what_it_refuses_is_named() -> None:
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        ModelConfig.from_hf({"architectures": ["JambaForCausalLM"], "hidden_act": "gelu", "hidden_size": 64,
                             "num_hidden_layers": 2})
