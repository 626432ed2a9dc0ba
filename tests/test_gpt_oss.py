"""gpt-oss (``GptOssForCausalLM``): biased attention with sinks, sliding and full layers
alternating, YaRN without truncation, and a biased mixture of experts with a clamped
SwiGLU on every layer; its experts dense or in MXFP4 blocks (the released checkpoints).

Written by transformers (engine.models.testing_gpt_oss) with biases and sinks drawn wide
enough that each moves the answer; the oracle is transformers' model loaded back from the
same folder (its own MXFP4 dequantization for the blocks). Greedy tokens and their
logprobs on both op sets (the C kernels' decode steps fused), whole prompts and 5-token
chunks after a cached past, and the Triton kernels in the interpreter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from greedy_driver import run_greedy
from safetensors.torch import load_file, save_file
from test_parity import LOGPROB_ATOL, NEW_TOKENS, _hf_greedy, _prompts, _runner
from transformers import GptOssConfig, GptOssForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

from engine.errors import CorruptModelError, UnsupportedModelError
from engine.models.config import ModelConfig
from engine.models.gpt_oss import GptOssExperts
from engine.models.hf_quant import Mxfp4Tensor
from engine.models.loader import load_model
from engine.models.lora import check_lora_model
from engine.models.testing_gpt_oss import TINY_GPT_OSS, write_gpt_oss
from engine.ops import get_ops
from engine.ops.cpu import MOE_MAX_TOKENS
from engine.ops.reference import TorchOps

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_ROPE = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
             "original_max_position_embeddings": 64, "rope_theta": 150000.0}


@pytest.fixture(scope="module", params=["dense", "mxfp4"])
def written(request, tmp_path_factory) -> tuple[Path, list, list]:
    """(folder, prompts, transformers' greedy tokens and logprobs for them)."""
    folder = tmp_path_factory.mktemp("gpt-oss") / request.param
    write_gpt_oss(folder, config={"rope_parameters": TINY_ROPE}, mxfp4=request.param == "mxfp4")
    hf = GptOssForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    prompts = _prompts(TINY_GPT_OSS["vocab_size"])[:3]
    expected = [_hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert all(len(set(tokens)) > 1 for tokens, _ in expected)
    return folder, prompts, expected


def _check(runs: list, expected: list, n: int = NEW_TOKENS) -> None:
    for run, (want_tokens, want_logprobs) in zip(runs, expected, strict=True):
        assert [s.token_id for s in run] == want_tokens[:n]
        got = torch.tensor([s.logprob for s in run], dtype=torch.float64)
        torch.testing.assert_close(got, torch.tensor(want_logprobs[:n], dtype=torch.float64), atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("ops", ["torch", "cpu"])
@pytest.mark.parametrize("chunk_size", [None, 5], ids=["whole", "chunk5"])
def test_gpt_oss_greedy_tokens_and_logprobs_match_transformers(written, ops: str, chunk_size) -> None:
    folder, prompts, expected = written
    loaded = load_model(folder, dtype="float32")
    runner = _runner(loaded, 4, ops)
    runs = run_greedy(runner, prompts, NEW_TOKENS, chunk_size=chunk_size, block_size=4)
    _check(runs, expected)
    # On the C kernels the decode steps ran fused (its Gemma mode, the experts between calls).
    step = runner.model.fused_step
    assert (step is not None and step.steps > 0) == (ops == "cpu")


@pytest.mark.kernels
def test_gpt_oss_on_the_triton_kernels_matches_transformers(written) -> None:
    folder, prompts, expected = written
    loaded = load_model(folder, dtype="float32")
    runs = run_greedy(_runner(loaded, 4, "triton"), prompts[:2], 3, chunk_size=5, block_size=4)
    _check(runs, expected[:2], 3)


def test_the_config_reads_layer_kinds_sinks_and_the_experts(written) -> None:
    folder, _, _ = written
    config = load_model(folder, dtype="float32").config
    assert config.layer_windows == (4, 0)  # sliding, then full
    assert config.attention_bias
    assert config.rope_scaling["rope_type"] == "yarn" and config.rope_scaling["truncate"] is False
    moe = config.moe
    assert (moe.naming, moe.num_experts, moe.top_k, moe.swiglu_limit, moe.swiglu_alpha) == ("gpt_oss", 4, 2, 7.0, 1.702)


def test_a_config_without_layer_types_or_rope_takes_transformers_defaults() -> None:

    raw = {"architectures": ["GptOssForCausalLM"], "vocab_size": 384, "hidden_size": 64, "intermediate_size": 64,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8}
    config = ModelConfig.from_hf(raw)
    hf = GptOssConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    assert config.layer_windows == tuple(8 if t == "sliding_attention" else 0 for t in hf.layer_types)
    assert config.rope_theta == hf.rope_parameters["rope_theta"]
    assert {k: config.rope_scaling[k] for k in ("factor", "beta_fast", "beta_slow", "truncate")} == {
        k: hf.rope_parameters[k] for k in ("factor", "beta_fast", "beta_slow", "truncate")}
    assert config.moe.swiglu_limit == hf.swiglu_limit and config.moe.swiglu_alpha == hf.swiglu_alpha


def test_mxfp4_blocks_dequantize_as_transformers_does() -> None:
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 140, (3, 8, 2), generator=g, dtype=torch.uint8)
    got = Mxfp4Tensor(blocks, scales, "test").read()
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert got.shape == want.shape == (3, 64, 8)
    assert torch.equal(got, want)


def test_an_mxfp4_folder_whose_scales_are_missing_is_refused_by_name(tmp_path) -> None:

    folder = tmp_path / "m"
    write_gpt_oss(folder, mxfp4=True)
    file = next(folder.glob("*.safetensors"))
    tensors = load_file(str(file))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(file))
    with pytest.raises(CorruptModelError, match="down_proj_blocks"):
        load_model(folder, dtype="float32")


def test_lora_on_gpt_oss_is_refused_by_name(written) -> None:
    folder, _, _ = written

    with pytest.raises(UnsupportedModelError, match="gpt_oss"):
        check_lora_model(load_model(folder, dtype="float32").config)


@pytest.mark.parametrize("ops", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_the_experts_match_transformers_gpt_oss_mlp(monkeypatch, ops: str, dtype: torch.dtype, tokens: int) -> None:
    """One layer's router and experts (stacked, interleaved, biased, clamped) against
    transformers' ``GptOssMLP`` on the same weights. On the C kernels up to MOE_MAX_TOKENS
    tokens take quant.c's eng_moe_small (the torch reference is not called), more the
    reference."""

    raw = TINY_GPT_OSS | {"num_local_experts": 8, "num_experts_per_tok": 4}
    torch.manual_seed(tokens)
    mlp = GptOssMLP(GptOssConfig(**raw))
    with torch.no_grad():
        for name, p in mlp.named_parameters():
            p.normal_(0.0, 1.0 if name.endswith("bias") else 0.3)
    mlp = mlp.to(dtype)
    x = torch.randn(tokens, raw["hidden_size"]).to(dtype)
    with torch.inference_mode():
        want = mlp(x[None])[0][0].float()
    state = {f"model.layers.0.mlp.{k}": v for k, v in mlp.state_dict().items()}
    config = ModelConfig.from_hf({"architectures": ["GptOssForCausalLM"], **raw})
    experts = GptOssExperts(config, 0, state.__getitem__)
    calls = []
    reference = TorchOps.fused_moe
    monkeypatch.setattr(TorchOps, "fused_moe", lambda self, *a: calls.append(1) or reference(self, *a))
    weights, ids = experts.route(x)
    got = experts(x, weights, ids, get_ops(ops)).float() + experts.down_bias(weights, ids)
    assert len(calls) == int(ops == "torch" or tokens > MOE_MAX_TOKENS)
    # fp32: the order of sums. bf16: transformers rounds its routing weights and each
    # expert's weighted output to bf16 and sums in bf16; the engine sums in fp32.
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.25, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)
