"""Tiny models built by transformers' own classes and written by its ``save_pretrained``
(the families the tiny-model helpers do not write), and the greedy check the tests run on
them against transformers."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from greedy_driver import run_greedy
from test_parity import LOGPROB_ATOL, NEW_TOKENS, _hf_greedy, _prompts, _runner

from engine.models.loader import load_model
from engine.models.testing import write_tiny_model
from engine.ops.cpu import qmatmul as cq


def write_hf_model(hf: Any, folder: Path, *, norms: bool = False, biases: float = 0.0) -> Any:
    """``hf`` with wider weights than transformers' 0.02 (so greedy tokens vary; with
    ``norms``, norm weights drawn around 1 so a skipped one shows; with ``biases``, every
    bias (the LayerNorms' too) drawn at that std from a generator of its own, so a
    misplaced one shows), saved into ``folder`` with the tiny models' tokenizer; returns the model, in
    eval mode and never stopping at an EOS (as the runner generates every token)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
            elif norms and "norm" in name:
                p.normal_(1.0, 0.1)
        for name, p in hf.named_parameters():
            if biases and name.endswith(".bias"):  # LayerNorms' too
                p.copy_(torch.randn(p.shape, generator=g) * biases)
    hf.save_pretrained(folder)
    tokenizer_folder = write_tiny_model(folder.parent / f"{folder.name}-tokenizer", "llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / name, folder / name)
    hf.generation_config.eos_token_id = None
    return hf.eval()


def assert_greedy_matches(hf: Any, folder: Path, ops: str, *, fused: bool, prompts: int = 3) -> Any:
    """The engine's runner on ``ops`` gives transformers' greedy tokens and their logprobs
    for the first ``prompts`` test prompts; on the C kernels the decode steps ran fused iff
    ``fused``. Returns the loaded model."""
    loaded = load_model(folder, dtype="float32")
    chosen = _prompts(loaded.config.vocab_size)[:prompts]
    expected = [_hf_greedy(hf, p, NEW_TOKENS) for p in chosen]
    assert all(len(set(tokens)) > 1 for tokens, _ in expected)
    runner = _runner(loaded, 4, ops)
    runs = run_greedy(runner, chosen, NEW_TOKENS, block_size=4)
    step = runner.model.fused_step
    assert (step is not None and step.steps > 0) == (fused and ops == "cpu")
    for run, (want_tokens, want_logprobs) in zip(runs, expected, strict=True):
        assert [s.token_id for s in run] == want_tokens
        got = torch.tensor([s.logprob for s in run], dtype=torch.float64)
        torch.testing.assert_close(got, torch.tensor(want_logprobs, dtype=torch.float64), atol=LOGPROB_ATOL, rtol=0)
    return loaded


def assert_chunked_greedy_matches(hf: Any, folder: Path, ops: str, *, prompts: int = 2, chunk_size: int = 5) -> None:
    """The first ``prompts`` test prompts prefilled in chunks of ``chunk_size`` through the
    engine's runner on ``ops`` give transformers' greedy tokens and their logprobs (3 tokens
    on the Triton interpreter, which is slow)."""
    loaded = load_model(folder, dtype="float32")
    chosen = _prompts(loaded.config.vocab_size)[:prompts]
    new = 3 if ops == "triton" else NEW_TOKENS
    runs = run_greedy(_runner(loaded, 4, ops), chosen, new, chunk_size=chunk_size, block_size=4)
    for run, prompt in zip(runs, chosen, strict=True):
        want_tokens, want_logprobs = _hf_greedy(hf, prompt, new)
        assert [s.token_id for s in run] == want_tokens
        got = torch.tensor([s.logprob for s in run], dtype=torch.float64)
        torch.testing.assert_close(got, torch.tensor(want_logprobs, dtype=torch.float64), atol=LOGPROB_ATOL, rtol=0)


def assert_kept_blocks_match_dequantized(path: Path, monkeypatch: Any, check_runner: Any) -> None:
    """GGUF ``path`` loaded with its blocks kept, over the torch reference matmul, gives the
    same greedy tokens and logprobs as the file dequantized, prefilled in chunks;
    ``check_runner`` is shown the kept model's runner first (to assert what kept its blocks)."""
    kept = load_model(path, dtype="float32")
    dequantized = load_model(path, dtype="float32", quantization="none")
    assert kept.quantization == "gguf"
    prompts = _prompts(kept.config.vocab_size)
    want = run_greedy(_runner(dequantized, 4, "torch"), prompts, NEW_TOKENS, chunk_size=5, block_size=4)
    monkeypatch.setattr(cq, "available", lambda: False)
    runner = _runner(kept, 4, "cpu")
    check_runner(runner)
    got = run_greedy(runner, prompts, NEW_TOKENS, chunk_size=5, block_size=4)
    for g, w in zip(got, want, strict=True):
        assert [s.token_id for s in g] == [s.token_id for s in w]
        torch.testing.assert_close(torch.tensor([s.logprob for s in g]), torch.tensor([s.logprob for s in w]),
                                   atol=LOGPROB_ATOL, rtol=0)


# 8 experts in 4 groups, 2 groups kept, 3 routed a token, scaled by 2.5; one dense layer first.
TINY_GLM = dict(vocab_size=384, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                routed_scaling_factor=2.5, first_k_dense_replace=1, attention_bias=True,
                max_position_embeddings=256, tie_word_embeddings=False)


def write_glm(folder: Path, **extra: Any) -> Any:
    """A tiny GLM-4.5 (:data:`TINY_GLM` with ``extra`` over it) written into ``folder``,
    its selection biases and biases drawn so each moves the routing and the answer."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(0)
    hf = Glm4MoeForCausalLM(Glm4MoeConfig(**(TINY_GLM | extra)))
    with torch.no_grad():
        for layer in hf.model.layers[TINY_GLM["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.5)  # a buffer: set by hand
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    return write_hf_model(hf, folder, norms=True)


# DeepSeek-V3's shape at test size: 8 experts in 2 groups, 1 kept, 2 routed a token, a
# dense first layer; latent 16, keys 8 + 8 rotated, values 12 (q through a rank-24 bottleneck).
TINY_DEEPSEEK = dict(vocab_size=384, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                     num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
                     qk_nope_head_dim=8, qk_rope_head_dim=8, q_lora_rank=24, v_head_dim=12,
                     routed_scaling_factor=2.5, max_position_embeddings=256, tie_word_embeddings=False)


def write_deepseek_v3(folder: Path, *, version: int = 3, **extra: Any) -> Any:
    """A tiny DeepSeek-V3 (or, with ``version`` 2, DeepSeek-V2: softmax routing, no selection
    bias) of :data:`TINY_DEEPSEEK` with ``extra`` over it, written into ``folder``; V3's
    experts' selection biases drawn so they move the routing."""
    import transformers

    torch.manual_seed(0)
    config = TINY_DEEPSEEK | extra
    name = f"DeepseekV{version}"
    hf = getattr(transformers, f"{name}ForCausalLM")(getattr(transformers, f"{name}Config")(**config))
    if version == 3:
        with torch.no_grad():
            for layer in hf.model.layers[config["first_k_dense_replace"]:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.5)  # a buffer: set by hand
    return write_hf_model(hf, folder, norms=True)
