"""Quantized GGUFs of every family served with their blocks kept (``quantization="auto"``),
against the same file dequantized (``quantization="none"``), in the model and end to end.

Both sides hold the same weight values (the loader's tests check that kept blocks
dequantize to exactly the converter's weights), so:

* over the torch reference matmul (each quantized weight dequantized per call, fp32
  activations) the kept model is the dequantized one up to fp32 summation order: logits
  within ``test_parity.LOGIT_ATOL_FP32`` (1e-4) and identical greedy tokens. This is the
  check of the model's wiring: fused q/k/v and gate/up over quantized parts (of one or of
  two formats), the embedding read row by row, the (tied) head through the quantized matmul.
* over the C kernels (what the engine runs on CPU) activations are rounded to int8 per
  32-column block, as llama.cpp does: each row of logits within ``KERNEL_LOGIT_SPAN``
  of its range (so where the top token differs, the dense model had a near tie: its two
  candidates at most twice that apart).

The tiny models' random weights make near ties common (the top two logits of a row were
measured as close as 0.002 apart), so greedy tokens over the kernels may part ways after a
few tokens; the end-to-end tests therefore score the quantized engine's greedy tokens with
the dequantized engine (``prompt_logprobs``) instead of asking both for the same tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest
import torch
import trio
from engine_helpers import collect, greedy, text, token_ids
from greedy_driver import run_greedy
from http_server import ServerThread
from safetensors.torch import load_file
from test_loader import Q4_K, Q8_0, quantize_array, write_gguf
from test_moe import write_moe_gguf
from test_parity import LOGIT_ATOL_FP32, _chunk_lengths, _prefill_logits, _prompts, _runner

import engine
from engine.models.layers.linear import QuantLinear, weight_bytes
from engine.models.llama import LlamaModel
from engine.models.loader import load_model
from engine.models.testing import TINY_MOE_ARCHITECTURES, write_tiny_model
from engine.models.testing_quant import quantize_iq4, quantize_q2_k, quantize_q3_k, quantize_q4_k
from engine.ops.cpu import qmatmul as cq
from engine.ops.quant import QuantizedExperts, QuantizedWeight

# int8 activations per 32 columns err by up to amax / 254 each (0.4% of the block's largest
# entry); after two layers and the head the logits moved by at most 1.5% of their row's
# range (max - min) in these cases (the tied Q4_K Gemma 3, whose range is only ~2.5; 0.65-
# 0.95% for the others). 3% is twice that; a fault (a missed norm weight, a q/k permutation
# left in, a wrong scale) moves them by tens of %.
KERNEL_LOGIT_SPAN = 0.03
NEW_TOKENS = 16
# Q4_K needs K a multiple of 256: these Gemmas are 256 wide (head_dim 64 x 4 heads); their
# 128-wide down_proj rows fall back to Q8_0 as llama.cpp's quantizer does, and attn_v is
# written in Q8_0 as Q4_K_M files keep it in another format (Q6_K) than attn_q/attn_k.
WIDE = {"hidden_size": 256, "head_dim": 64}

CASES = [
    ("gemma2", "Q8_0", None),
    ("gemma3", "Q8_0", None),
    ("gemma2", "Q4_K", WIDE),
    # Tied, as real Gemmas are: the head multiplies by the embedding's own Q4_K blocks.
    ("gemma3", "Q4_K", WIDE | {"tie_word_embeddings": True}),
    ("phi3", "Q8_0", None),
    ("mixtral", "Q8_0", None),
    ("qwen2_moe", "Q8_0", None),
    # The formats kept in blocks since session 35 (Q4_K_M files of narrow models hold
    # Q5_0; Q3_K_M, Q3_K_S and Q2_K files hold Q3_K and Q2_K).
    # (the tiny Llama ties its head: the head multiplies by the embedding's own blocks)
    ("llama", "Q5_0", {"tie_word_embeddings": True}),
    ("llama", "Q5_1", {"tie_word_embeddings": True}),
    ("llama", "Q3_K", WIDE | {"tie_word_embeddings": True}),
    ("llama", "Q2_K", WIDE | {"tie_word_embeddings": True}),
    ("llama", "IQ4_NL", {"tie_word_embeddings": True}),
    ("llama", "IQ4_XS", WIDE | {"tie_word_embeddings": True}),
]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None) -> None:
    # Conversions go into this test's own cache, never the user's; torch on one thread
    # (tiny shapes, see tests/conftest.py).
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))


def write_quantized(tmp_path: Path, arch: str, quant: str, overrides: dict | None = None) -> Path:
    """A tiny ``arch`` model written as a GGUF with its matrices in ``quant``."""
    folder = write_tiny_model(tmp_path / f"{arch}-hf", arch, overrides=overrides)
    qtype = getattr(gguf.GGMLQuantizationType, quant)
    out = tmp_path / f"{arch}-{quant}.gguf"
    if arch in TINY_MOE_ARCHITECTURES:
        return write_moe_gguf(folder, out, quant=qtype)
    replace = {}
    if qtype == Q4_K:
        stored = load_file(str(folder / "model.safetensors"))
        for i in range(json.loads((folder / "config.json").read_text())["num_hidden_layers"]):
            v = stored[f"model.layers.{i}.self_attn.v_proj.weight"].numpy()
            replace[f"blk.{i}.attn_v.weight"] = (quantize_array(v, Q8_0), Q8_0)
    return write_gguf(folder, out, quant=qtype, replace=replace)


def _projections(model: LlamaModel) -> list:
    out = [model.lm_head]
    for layer in model.layers:
        out += [layer.qkv, layer.o_proj]
        if layer.moe is None:
            out += [layer.gate_up, layer.down]
    return out


@pytest.mark.skipif(not cq.available(), reason="C kernels not built")
@pytest.mark.parametrize(("arch", "quant", "overrides"), CASES, ids=[f"{a}-{q}" for a, q, _ in CASES])
def test_a_quantized_gguf_keeps_its_blocks_and_matches_the_dequantized_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, quant: str, overrides: dict | None
) -> None:
    """Regression: a Q8_0 Gemma GGUF crashed under the default quantization (the Gemma
    decoder fed QuantizedWeight to torch.cat / F.embedding)."""
    path = write_quantized(tmp_path, arch, quant, overrides)
    kept = load_model(path, dtype="float32")
    dense = load_model(path, dtype="float32", quantization="none")
    assert kept.quantization == "gguf"
    assert kept.config.tie_word_embeddings == bool((overrides or {}).get("tie_word_embeddings"))
    runner = _runner(kept, 4, "cpu")
    model = runner.model
    assert isinstance(model.embed, QuantizedWeight)
    assert all(isinstance(p, QuantLinear) for p in _projections(model))
    formats = {p.fmt.name for proj in _projections(model) for p in proj.parts}
    # A k-quant's rows narrower than 256 fall back to Q8_0 (and Q4_K's attn_v is Q8_0).
    assert formats == ({quant, "Q8_0"} if quant == "Q4_K" else {quant}) or (
        quant.endswith(("_K", "_XS")) and formats == {quant, "Q8_0"})
    if kept.config.moe is not None:  # the experts' stacks stay in their blocks too
        blocks = [layer.moe for layer in model.layers if layer.moe is not None]
        assert blocks and all(isinstance(b.w13, QuantizedExperts) and isinstance(b.w2, QuantizedExperts)
                              for b in blocks)
        assert {p.fmt.name for b in blocks for w in (b.w13, b.w2) for p in w.parts} == {quant}
    assert weight_bytes(model) <= 1.2 * kept.file_tensor_bytes

    prompts = _prompts(kept.config.vocab_size)
    want = _prefill_logits(_runner(dense, 4, "cpu"), prompts, 5)
    want_tokens = [[s.token_id for s in run] for run in run_greedy(
        _runner(dense, 4, "cpu"), prompts, NEW_TOKENS, chunk_size=5, block_size=4)]
    # The C kernels: int8-rounded activations.
    got = _prefill_logits(runner, prompts, 5)
    for g, w in zip(got, want, strict=True):
        span = (w.amax(-1) - w.amin(-1)).unsqueeze(-1)
        assert float(((g - w).abs() / span).max()) <= KERNEL_LOGIT_SPAN
    # The torch reference matmul: the same model to fp32 summation order.
    monkeypatch.setattr(cq, "available", lambda: False)
    got = _prefill_logits(_runner(kept, 4, "cpu"), prompts, 5)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=LOGIT_ATOL_FP32, rtol=0)
    runs = run_greedy(_runner(kept, 4, "cpu"), prompts, NEW_TOKENS, chunk_size=5, block_size=4)
    assert [[s.token_id for s in run] for run in runs] == want_tokens


def test_the_q4_k_writer_makes_blocks_gguf_reads_back_within_a_step() -> None:
    """The test helpers' Q4_K encoder, checked with gguf's own dequantizer: each value within
    half a stored step (d * sc) plus the rounding of the 6-bit scale (up to 15 codes times
    d / 2) and of the 6-bit min (dmin / 2)."""
    g = np.random.default_rng(3)
    w = (g.standard_normal((6, 512)) * 0.08).astype(np.float32)
    w[1] += 0.3  # a row with no negative entries: every min is 0
    w[2, :32] = 0.0  # a zero sub-block: scale 0
    blocks = quantize_q4_k(w)
    back = gguf.quants.dequantize(blocks, Q4_K).reshape(w.shape)
    sub = w.reshape(6, 2, 8, 32)
    scale = (sub.max(-1) - np.minimum(sub.min(-1), 0)) / 15
    d = scale.max(-1, keepdims=True) / 63
    dmin = (-np.minimum(sub.min(-1), 0)).max(-1, keepdims=True) / 63
    bound = 0.5 * scale + 15 * 0.5 * d + 0.5 * dmin + 1e-3 * d  # + fp16 rounding of d
    err = np.abs(back - w).reshape(sub.shape).max(-1)
    assert (err <= bound).all()
    assert np.abs(back - w).max() > 0 and np.abs(back[2, :32]).max() == 0


@pytest.mark.parametrize("quant", ["Q3_K", "Q2_K"])
def test_the_q3_k_and_q2_k_writers_make_blocks_gguf_reads_back_within_a_step(quant: str) -> None:
    """The helpers' Q3_K and Q2_K encoders, checked with gguf's own dequantizer. Q3_K: each
    value within one stored step |d sc| (the sub-block's peak of the other sign may clip
    to the top code) plus the rounding of the 6-bit scale (up to 4 codes times d / 2).
    Q2_K: within half a step plus the 4-bit scale's rounding (3 codes times d / 2) and the
    4-bit min's (dmin / 2)."""
    g = np.random.default_rng(4)
    w = (g.standard_normal((6, 512)) * 0.08).astype(np.float32)
    w[1] += 0.3  # no negative entries
    w[2, :16] = 0.0  # a zero sub-block
    qtype = getattr(gguf.GGMLQuantizationType, quant)
    blocks = (quantize_q3_k if quant == "Q3_K" else quantize_q2_k)(w)
    assert blocks.shape == (6, 2 * (110 if quant == "Q3_K" else 84))
    back = gguf.quants.dequantize(blocks, qtype).reshape(w.shape)
    sub = w.reshape(6, 2, 16, 16)
    if quant == "Q3_K":
        step = np.abs(sub).max(-1) / 4
        d = step.max(-1, keepdims=True) / 31
        bound = step + 4 * 0.5 * d + 1e-3 * d
    else:
        step = (sub.max(-1) - np.minimum(sub.min(-1), 0)) / 3
        d = step.max(-1, keepdims=True) / 15
        dmin = (-np.minimum(sub.min(-1), 0)).max(-1, keepdims=True) / 15
        bound = 0.5 * step + 3 * 0.5 * d + 0.5 * dmin + 1e-3 * d
    err = np.abs(back - w).reshape(sub.shape).max(-1)
    assert (err <= bound).all()
    assert np.abs(back - w).max() > 0 and np.abs(back[2, :16]).max() == 0


@pytest.mark.parametrize("kind", ["IQ4_NL", "IQ4_XS"])
def test_the_iq4_writer_makes_blocks_gguf_reads_back_within_a_step(kind: str) -> None:
    """The helpers' IQ4 encoder, checked with gguf's own dequantizer: each value within 14
    of its block's steps (half the table's widest gap is 12; a value past its top entry,
    113, lies up to 127) plus, for IQ4_XS, the 6-bit scale's rounding (d / 2, times the
    table's 127 at most)."""
    g = np.random.default_rng(5)
    w = (g.standard_normal((6, 512)) * 0.08).astype(np.float32)
    w[2, :32] = 0.0  # a zero block
    blocks = quantize_iq4(w, kind)
    back = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, kind)).reshape(w.shape)
    sub = np.abs(w.reshape(6, -1, 32)).max(-1, keepdims=True) / 127  # each block's step
    bound = 14 * sub * 1.01
    if kind == "IQ4_XS":
        d = np.abs(w.reshape(6, 2, 256)).max(-1, keepdims=True).repeat(8, 1) / 127 / 31
        bound = bound + 127 * 0.5 * d + 1e-3 * sub
    err = np.abs(back - w).reshape(6, -1, 32)
    assert (err <= bound).all()
    assert np.abs(back - w).max() > 0 and np.abs(back[2, :32]).max() == 0


# --------------------------------------------------------------------------------------
# End to end: the engine on a quantized file, through engine.api and through HTTP.

ENGINE_OPTIONS = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, block_size=16,
                      kv_cache_memory=4 * 1024 * 1024)
E2E_PROMPTS = [[5, 17, 99, 230, 41], [300, 12, 7, 7, 140, 66, 8, 201, 19, 88, 3, 250], [77]]
# Scored by the dequantized engine, each greedy token of the quantized one is its top token
# or within REGRET nats of it (a near tie); its logprob is within LOGPROB_GAP of what the
# quantized engine reported. Measured on this model: regret at most 1e-4 (one near tie
# where the two engines' greedy paths part), logprob gaps at most 0.008. 0.1 nats is the
# regret test_quant_fidelity allows on SmolLM2; a fault costs whole nats.
REGRET = 0.1
LOGPROB_GAP = 0.1


@pytest.fixture
def quantized_gemma(tmp_path: Path) -> Path:
    return write_quantized(tmp_path, "gemma2", "Q4_K", WIDE)


def _file_tensor_bytes(path: Path) -> int:
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


async def _greedy(eng, prompt: list[int]) -> tuple[list[int], list[float], str]:
    outputs = await collect(eng, prompt, greedy(NEW_TOKENS, logprobs=0))
    logprobs = [lp.logprob for out in outputs for lp in out.logprobs]
    return token_ids(outputs), logprobs, text(outputs)


async def _score_with_the_dequantized_model(path: Path, runs: list[tuple[list[int], list[int], list[float]]]) -> None:
    async with engine.open_engine(str(path), quantization="none", **ENGINE_OPTIONS) as dense:
        assert not any(isinstance(p, QuantLinear) for p in _projections(dense._parts.runner.model))
        for prompt, tokens, logprobs in runs:
            outputs = await collect(dense, prompt + tokens, greedy(1, prompt_logprobs=1))
            scored = outputs[0].prompt_logprobs[len(prompt):]
            for entry, token, logprob in zip(scored, tokens, logprobs, strict=True):
                assert entry.token_id == token
                best = max(v for _, v in entry.top)
                assert best - entry.logprob <= REGRET, (prompt, tokens)
                assert abs(entry.logprob - logprob) <= LOGPROB_GAP, (prompt, tokens)


def _assert_kept(eng, path: Path) -> None:
    model = eng._parts.runner.model
    assert isinstance(model.embed, QuantizedWeight)
    assert all(isinstance(p, QuantLinear) for p in _projections(model))
    assert weight_bytes(model) <= 1.2 * _file_tensor_bytes(path)


@pytest.mark.skipif(not cq.available(), reason="C kernels not built")
async def test_the_engine_serves_a_quantized_gguf_with_its_blocks_kept(quantized_gemma: Path) -> None:
    """Default quantization through engine.open_engine: the model holds the file's blocks
    (resident weight bytes within 1.2x the file's tensor data) and its greedy tokens are
    the dequantized model's choices (see REGRET)."""
    async with engine.open_engine(str(quantized_gemma), **ENGINE_OPTIONS) as eng:
        assert eng.config.quantization == "auto"
        _assert_kept(eng, quantized_gemma)
        runs = []
        for prompt in E2E_PROMPTS:
            tokens, logprobs, _ = await _greedy(eng, prompt)
            assert len(tokens) == NEW_TOKENS and len(set(tokens)) > 1
            runs.append((prompt, tokens, logprobs))
    await _score_with_the_dequantized_model(quantized_gemma, runs)


@pytest.mark.skipif(not cq.available(), reason="C kernels not built")
def test_the_http_server_serves_a_quantized_gguf_with_its_blocks_kept(quantized_gemma: Path) -> None:
    """/v1/completions on the quantized file gives the text of the engine's own greedy run
    on it (the same kernels, one request at a time) and the server's model keeps blocks."""
    async def alone() -> list[str]:
        async with engine.open_engine(str(quantized_gemma), **ENGINE_OPTIONS) as eng:
            return [(await _greedy(eng, p))[2] for p in E2E_PROMPTS]

    want = trio.run(alone)
    with ServerThread(lambda: engine.open_engine(str(quantized_gemma), **ENGINE_OPTIONS)) as server:
        _assert_kept(server.engine, quantized_gemma)
        for prompt, text in zip(E2E_PROMPTS, want, strict=True):
            body = {"model": server.engine.model_name, "prompt": prompt, "max_tokens": NEW_TOKENS,
                    "temperature": 0, "ignore_eos": True}
            reply = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == text



# --------------------------------------------------------------------------------------
# The Triton ops backend: blocks kept in GGUF's own layout, read by the Triton kernel
# (interpreted on CPU here; conftest sets TRITON_INTERPRET without a GPU).

# Q4_K with attn_v in Q8_0 (two formats in one fused q/k/v: the kernel writes column
# slices of one output) and down_proj's 128-wide rows in Q8_0, as write_quantized does.
TRITON_CASES = [("Q4_0", None), ("Q8_0", None), ("Q4_K", WIDE)]
TRITON_NEW_TOKENS = 4  # a few decode steps: the interpreter runs every kernel in numpy


@pytest.mark.parametrize(("quant", "overrides"), TRITON_CASES, ids=[q for q, _ in TRITON_CASES])
def test_the_triton_backend_keeps_gguf_blocks_and_matches_the_dequantized_model(
    tmp_path: Path, quant: str, overrides: dict | None
) -> None:
    """quantization="auto" with ops_backend="triton": every matrix of a tiny Llama GGUF
    (tied, so the head multiplies by the embedding's own blocks) stays in GGUF's blocks on
    the model's device and goes through the Triton quantized matmul.

    Against the same file dequantized, both on the Triton ops, over each prompt's chunked
    prefill and then one token a step (the dense model's greedy tokens, fed back): both
    sides hold the same weight values in fp32 and the kernel's fp32 dots are exact (no
    TF32), so only summation order differs: logits within ``LOGIT_ATOL_FP32`` (1e-4;
    measured at most 1.7e-6 on logits up to 1.2, whose closest top two are 2e-4 apart)
    and, at every step, the top token is the dense model's greedy token: the kept model
    decodes the same greedy tokens."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # as _runner picks
    path = write_quantized(tmp_path, "llama", quant, overrides)
    kept = load_model(path, dtype="float32", device=device, ops_backend="triton")
    dense = load_model(path, dtype="float32", device=device, quantization="none", ops_backend="triton")
    assert kept.quantization == "gguf" and dense.quantization == "none"
    runner = _runner(kept, 4, "triton")
    model = runner.model
    parts = [p for proj in _projections(model) for p in proj.parts]
    assert isinstance(model.embed, QuantizedWeight) and model.lm_head.parts == [model.embed]
    assert all(p.layout == "blocks" and p.device == device for p in [model.embed, *parts])
    assert {p.fmt.name for p in parts} == ({quant, "Q8_0"} if quant == "Q4_K" else {quant})
    assert weight_bytes(model) <= 1.2 * kept.file_tensor_bytes

    # Lengths 1, 8 and 9 (one token, two blocks of 4, one past them; 5-token chunks that
    # straddle blocks): 5 steps of at most 16 tokens (one row tile of the kernel), as the
    # interpreter's time goes with kernel launches. The greedy tokens come from the dense
    # model on the torch ops (no interpreter).
    prompts = [p for p in _prompts(kept.config.vocab_size) if len(p) in (1, 8, 9)]
    tokens = [[s.token_id for s in run] for run in run_greedy(
        _runner(dense, 4, "torch"), prompts, TRITON_NEW_TOKENS, chunk_size=5, block_size=4)]
    seqs = [p + t[:-1] for p, t in zip(prompts, tokens, strict=True)]
    plans = [_chunk_lengths(len(p), 5) + [1] * (TRITON_NEW_TOKENS - 1) for p in prompts]
    with torch.inference_mode():
        want = _prefill_logits(_runner(dense, 4, "triton"), seqs, None, plans=plans)
        got = _prefill_logits(runner, seqs, None, plans=[list(plan) for plan in plans])
    for g, w, p, t in zip(got, want, prompts, tokens, strict=True):
        torch.testing.assert_close(g, w, atol=LOGIT_ATOL_FP32, rtol=0)
        assert g[len(p) - 1 :].argmax(-1).tolist() == t
