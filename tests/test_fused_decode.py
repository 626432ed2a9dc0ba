"""The fused CPU decode step (engine/ops/cpu/fused.c) against the unfused path it replaces.

The oracle is the engine's own unfused forward over the same weights (``LlamaModel``'s
layers over ``CpuOps`` and the quantized matmul), itself checked against transformers and
the dequantized model by ``test_parity`` / ``test_quant_models``. The fused step calls the
same kernels in the same order with the same roundings, so in the logits are equal, bit for
bit, in fp32 and bf16, with a plain or an int8 KV cache. (Bit equality is stricter than the
quantized tests' ``KERNEL_LOGIT_SPAN``; a 5% error in the attention scale fails it.)

Each case prefills five prompts (whole or in chunks of 3), then decodes four tokens for all
of them together, so decode steps have five rows and attention reads several KV blocks.
The verification cases feed a request 1 + k tokens a step (speculative decoding's
verification chunk) beside other requests' decode rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_parity import _chunk_lengths, _prefill_logits, _prompts
from test_quant_models import WIDE, write_quantized

from engine.models.loader import load_model
from engine.models.testing import (
    TINY_QWEN_VL,
    write_tiny_llava,
    write_tiny_model,
    write_tiny_qwen_vl,
)
from engine.ops import AttentionMetadata, get_ops
from engine.ops.cpu import CpuKernelError, fused
from engine.ops.cpu import qmatmul as cq
from engine.runner.model_runner import ModelRunner

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not (fused.available() and cq.available()), reason="C kernels not built"),
]

DECODE_STEPS = 4
BLOCK_SIZE = 4


def _runner(loaded, kv: str) -> ModelRunner:
    return ModelRunner(
        loaded, device="cpu", ops=get_ops("cpu"), num_blocks=64, block_size=BLOCK_SIZE,
        max_num_batched_tokens=512, max_num_seqs=8, kv_cache_dtype=kv,
    )


def _logits(loaded, kv: str, chunk: int | None, prompts, *, fuse: bool, monkeypatch) -> tuple[list, object]:
    monkeypatch.setenv("ENGINE_FUSED_DECODE", "1" if fuse else "0")
    runner = _runner(loaded, kv)
    # Prefill (whole or chunked), then DECODE_STEPS single-token steps: the prompts' last
    # tokens are fed back one at a time, so every decode step has a row per prompt.
    plans = [_chunk_lengths(len(p) - DECODE_STEPS, chunk) + [1] * DECODE_STEPS for p in prompts]
    out = _prefill_logits(runner, prompts, None, plans=plans)
    return out, runner.model.fused_step


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache: dict = {}

    def get(arch: str, quant: str, dtype: str):
        key = (arch, quant)
        if quant == "dense" and key not in cache:  # the Hugging Face folder: dense weights
            folder = tmp_path_factory.mktemp(arch)
            if arch == "llava":
                cache[key] = write_tiny_llava(folder)
            elif arch in TINY_QWEN_VL:
                cache[key] = write_tiny_qwen_vl(folder, arch)
            else:
                cache[key] = write_tiny_model(folder, arch)
        if key not in cache:
            # Q4_K needs rows of 256: the wide tiny model, its v_proj in Q8_0 (q/k/v is then
            # two parts of two formats) and its 128-wide down_proj in Q8_0, as write_quantized
            # makes them.
            cache[key] = write_quantized(tmp_path_factory.mktemp(arch), arch, quant, WIDE if quant == "Q4_K" else None)
        return load_model(cache[key], dtype=dtype)

    return get


def _compare(got, want) -> None:
    for g, w in zip(got, want, strict=True):  # the same kernels in the same order: the same bits
        assert torch.equal(g, w), float((g - w).abs().max())


CASES = [
    # (arch, quant, dtype, kv cache, prefill chunk)
    ("llama", "Q4_1", "float32", "auto", None),
    ("llama", "Q4_1", "bfloat16", "int8", 3),
    ("llama3", "Q4_0", "bfloat16", "auto", None),
    ("llama", "Q4_K", "bfloat16", "int8", 3),  # q/k/v of two formats (Q4_K q/k, Q8_0 v)
    ("mistral", "Q8_0", "float32", "int8", 3),  # sliding window
    ("qwen2", "Q4_1", "bfloat16", "auto", 3),   # q/k/v biases
    ("qwen2", "Q8_0", "float32", "int8", None),
    ("qwen3", "Q4_1", "float32", "auto", 3),    # per-head q/k norm
    ("qwen3", "Q8_0", "bfloat16", "int8", None),
    ("phi3", "Q4_1", "bfloat16", "auto", None),  # fused q/k/v and gate/up weights
    ("phi4", "Q8_0", "float32", "int8", 3),    # RoPE on 3/4 of each head (Phi-4-mini's)
    ("granite", "Q8_0", "bfloat16", "auto", 3),  # block outputs x residual_multiplier
    ("granite", "dense", "float32", "int8", None),
    ("olmo2", "dense", "bfloat16", "auto", 3),  # norms after the blocks only, q/k normed across heads
    ("olmo3", "dense", "float32", "int8", None),  # and sliding layers with their own RoPE table
    ("olmo2", "Q4_1", "float32", "auto", 3),  # from llama.cpp's olmo2 GGUF
    # Gemma's sandwich norms (1 + w in fp32), GeGLU, alternating sliding-window layers
    ("gemma2", "Q8_0", "float32", "auto", 3),    # attention soft-cap
    ("gemma2", "Q4_1", "bfloat16", "int8", None),
    ("gemma3", "Q8_0", "bfloat16", "auto", 3),   # q/k norms, local RoPE base
    ("gemma3", "Q4_1", "float32", "int8", None),
    ("gemma", "Q8_0", "bfloat16", "auto", 3),    # Gemma 1: no norm after attention or the MLP
    ("smollm3", "dense", "bfloat16", "int8", 3),  # a layer without RoPE
    ("smollm3", "dense", "float32", "auto", None),
    ("gemma", "Q4_1", "float32", "int8", None),
    # Mixture of experts: the C step stops before each sparse MLP (run in torch) and goes on
    ("mixtral", "Q8_0", "float32", "auto", 3),
    ("qwen3_moe", "Q4_1", "bfloat16", "int8", None),  # a dense layer between sparse ones; the last sparse
    ("qwen2_moe", "Q8_0", "bfloat16", "auto", 3),  # a gated shared expert
    # Dense weights (Linear's small-batch kernel in both paths), and the VLMs' decoders
    ("llama", "dense", "bfloat16", "int8", 3),
    ("qwen2", "dense", "float32", "auto", None),    # biases added in the dense matmul
    ("gemma2", "dense", "bfloat16", "auto", 3),
    ("qwen2_moe", "dense", "float32", "int8", None),
    ("llava", "dense", "float32", "auto", 3),
    ("qwen2_vl", "dense", "bfloat16", "auto", None),  # M-RoPE: each step's own table
    ("qwen2_5_vl", "dense", "float32", "int8", 3),
]


@pytest.mark.parametrize(("arch", "quant", "dtype", "kv", "chunk"), CASES,
                         ids=[f"{a}-{q}-{d[:4]}-kv{k}-c{c}" for a, q, d, k, c in CASES])
def test_the_fused_decode_step_matches_the_unfused_forward(models, monkeypatch, arch, quant, dtype, kv, chunk) -> None:
    loaded = models(arch, quant, dtype)
    prompts = [p for p in _prompts(loaded.config.vocab_size) if len(p) > DECODE_STEPS]
    prompts.append(prompts[-1][:DECODE_STEPS + 2])
    want, unfused = _logits(loaded, kv, chunk, prompts, fuse=False, monkeypatch=monkeypatch)
    got, step = _logits(loaded, kv, chunk, prompts, fuse=True, monkeypatch=monkeypatch)
    assert unfused is None
    # Every decode step was fused (a chunked prefill whose last chunks are single tokens
    # makes more decode-only steps).
    assert step is not None and step.steps >= DECODE_STEPS
    if quant == "Q4_K":
        assert step.layers[0].qkv.nparts == 2
    _compare(got, want)


# Speculative verification steps: each request's prompt is prefilled whole (more rows than
# the fused step takes), then fed in the chunk lengths given, all requests in lockstep. A
# chunk of 1 + k rows is what a verification step gives the model (the last verified token
# and k proposals, none of them in the cache yet); a chunk of 1 is a decode row. With
# blocks of 4 every chunk of 5 crosses a block boundary.
VERIFY_CASES = [
    # (arch, quant, dtype, kv cache, {prompt length: its chunks after the prefill})
    ("llama", "Q4_1", "float32", "auto", {23: [5, 5]}),                   # one request, 1 + 4 rows
    ("llama", "Q4_1", "bfloat16", "int8", {23: [5, 4, 1], 9: [1, 1, 1], 8: [1, 1, 1]}),  # beside 2 decode rows
    ("mistral", "Q8_0", "float32", "int8", {23: [5, 3], 9: [1, 2], 8: [1, 1]}),  # window 8 < context
    ("qwen3", "Q4_1", "bfloat16", "auto", {23: [5, 5], 9: [5, 1]}),        # 2 x (1 + 4) = 10 rows
    ("gemma2", "Q8_0", "bfloat16", "int8", {23: [5, 3], 9: [1, 2], 8: [1, 1]}),
    ("gemma3", "Q4_1", "float32", "auto", {23: [5, 5], 9: [5, 1]}),
    ("qwen3_moe", "Q8_0", "bfloat16", "int8", {23: [5, 4, 1], 9: [1, 1, 1], 8: [1, 1, 1]}),
    ("llama", "dense", "bfloat16", "auto", {23: [5, 5], 9: [3, 1]}),  # bf16 dense: up to 8 rows fused
    ("qwen2_vl", "dense", "float32", "int8", {23: [5, 3], 9: [1, 2], 8: [1, 1]}),
]


@pytest.mark.parametrize(("arch", "quant", "dtype", "kv", "tails"), VERIFY_CASES,
                         ids=[f"{a}-{q}-{d[:4]}-kv{k}-{len(t)}req" for a, q, d, k, t in VERIFY_CASES])
def test_verification_chunks_are_fused_and_match_the_unfused_forward(models, monkeypatch, arch, quant, dtype, kv,
                                                                       tails) -> None:
    """A step of short chunks (a request's query rows beside others' decode rows) runs fused,
    every row attending causally up to its own position, with the unfused forward's logits
    bit for bit: the path that attends each row of such a chunk as its own decode step
    (``CpuOps.rowwise_max_query_len``), so greedy speculation keeps plain decoding's tokens."""
    loaded = models(arch, quant, dtype)
    by_len = {len(p): p for p in _prompts(loaded.config.vocab_size)}
    prompts = [by_len[n] for n in tails]
    plans = [[len(p) - sum(tail), *tail] for p, tail in zip(prompts, tails.values(), strict=True)]
    # The fused step capped at the largest verification step here (10 rows), below these
    # prompts' prefill step (13 rows and up), which then runs unfused.
    monkeypatch.setattr(fused, "MAX_TOKENS", 10)
    assert sum(plan[0] for plan in plans) > fused.MAX_TOKENS  # the prefill step is unfused

    def run(fuse: bool):
        monkeypatch.setenv("ENGINE_FUSED_DECODE", "1" if fuse else "0")
        runner = _runner(loaded, kv)
        out = _prefill_logits(runner, prompts, None, plans=[list(plan) for plan in plans])
        return out, runner.model.fused_step

    want, unfused = run(False)
    got, step = run(True)
    assert unfused is None
    # Every step after the prefill was fused, and those with a chunk took the chunk path.
    steps = max(len(t) for t in tails.values())
    chunked = sum(any(len(t) > i and t[i] > 1 for t in tails.values()) for i in range(steps))
    assert step is not None and (step.steps, step.chunk_steps) == (steps, chunked)
    _compare(got, want)


def test_a_chunk_the_unfused_path_attends_padded_is_not_fused(models, monkeypatch) -> None:
    """With ``rowwise_max_query_len`` 1 the unfused path attends a chunk's rows together
    (padded SDPA), which the fused step does not run: it leaves such a step to it, and the
    logits are still the unfused path's."""
    from engine.ops.cpu import CpuOps

    monkeypatch.setattr(CpuOps, "rowwise_max_query_len", 1)
    loaded = models("llama", "Q4_1", "float32")
    prompts = [p for p in _prompts(loaded.config.vocab_size) if len(p) == 23]
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("ENGINE_FUSED_DECODE", flag)
        runner = _runner(loaded, "auto")
        runs[flag] = _prefill_logits(runner, prompts, None, plans=[[17, 5, 1]])
    step = runner.model.fused_step
    assert step is not None and (step.steps, step.chunk_steps) == (1, 0)  # only the decode row
    _compare(runs["1"], runs["0"])


def test_a_rows_result_does_not_depend_on_its_batch(models, monkeypatch) -> None:
    """One request decoded alone or beside others: the same logits, bit for bit (what
    continuous batching and speculative verification rely on). Qwen3 in bf16: its per-head
    q/k norm once rounded differently with several rows (a strided view took torch's
    reference RMSNorm), on the unfused path too."""
    loaded = models("qwen3", "Q8_0", "bfloat16")
    prompts = [p for p in _prompts(loaded.config.vocab_size) if len(p) > DECODE_STEPS]
    for fuse in (True, False):
        together, _ = _logits(loaded, "auto", None, prompts, fuse=fuse, monkeypatch=monkeypatch)
        alone, _ = _logits(loaded, "auto", None, prompts[-1:], fuse=fuse, monkeypatch=monkeypatch)
        assert torch.equal(together[-1], alone[0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_of_max_tokens_decode_rows_is_fused_and_matches_the_unfused_forward(models, monkeypatch,
                                                                                  dtype) -> None:
    """The widest fused step (``fused.MAX_TOKENS`` rows): the unfused path's matmuls stay
    on the int8 kernels up to there (AMX-BF16, where the CPU has it, only from the next
    row), so both give the same bits."""
    loaded = models("llama", "Q4_1", dtype)
    prompts = [[5 + i, 7, 9 + i] for i in range(fused.MAX_TOKENS)]
    runs, steps = {}, {}
    for flag in ("1", "0"):
        monkeypatch.setenv("ENGINE_FUSED_DECODE", flag)
        runner = _runner(loaded, "auto")
        runs[flag] = _prefill_logits(runner, prompts, None, plans=[[2, 1]] * len(prompts))
        steps[flag] = runner.model.fused_step
    assert steps["1"] is not None and steps["1"].steps == 1  # the decode step (the prefill's 96 rows are not)
    assert steps["0"] is None
    _compare(runs["1"], runs["0"])


def test_what_the_fused_step_does_not_cover_runs_unfused(models, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ENGINE_FUSED_DECODE", "1")
    # fp16 (the dense kernel takes fp32 and bf16)
    half = load_model(write_tiny_model(tmp_path / "llama", "llama"), dtype="float16")
    runner = _runner(half, "auto")
    assert fused.unfusable(runner.model.fused_description(), runner.kv_caches) == "activations are not fp32 or bf16 on CPU"
    # More decode rows than MAX_TOKENS: the unfused path, the same answer.
    loaded = models("llama", "Q4_1", "float32")
    runner = _runner(loaded, "auto")
    prompts = [[5 + i, 7, 9 + i] for i in range(fused.MAX_TOKENS + 1)]
    _prefill_logits(runner, prompts, None, plans=[[2, 1]] * len(prompts))
    step = runner.model.fused_step
    assert step is None or step.steps == 0


def test_a_dense_bf16_step_past_the_dense_kernels_rows_runs_unfused(models, monkeypatch) -> None:
    """Past cq.DENSE_MAX_ROWS (8 in bf16) dense projections take oneDNN: the step is left
    to the unfused path, which then gives the logits (the fused step never runs oneDNN)."""
    from engine.ops.cpu.qmatmul import DENSE_MAX_ROWS

    loaded = models("llama", "dense", "bfloat16")
    rows = DENSE_MAX_ROWS[torch.bfloat16] + 1
    prompts = [[5 + i, 7, 9 + i] for i in range(rows)]
    monkeypatch.setenv("ENGINE_FUSED_DECODE", "1")
    runner = _runner(loaded, "auto")
    got = _prefill_logits(runner, prompts, None, plans=[[2, 1]] * rows)
    step = runner.model.fused_step
    assert step is not None and step.dense and step.steps == 0
    monkeypatch.setenv("ENGINE_FUSED_DECODE", "0")
    _compare(got, _prefill_logits(_runner(loaded, "auto"), prompts, None, plans=[[2, 1]] * rows))


def test_a_bad_slot_raises_and_writes_nothing(models, monkeypatch) -> None:
    monkeypatch.setenv("ENGINE_FUSED_DECODE", "1")
    runner = _runner(models("llama", "Q4_1", "float32"), "auto")
    step = runner.model.plan_fused_step(runner.kv_caches)
    assert step is not None
    before = [k.clone() for k, _ in runner.kv_caches]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([64 * BLOCK_SIZE]), query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([1], dtype=torch.int32), block_tables=torch.tensor([[0]], dtype=torch.int32),
        max_query_len=1, max_seq_len=1, query_lens_host=(1,), seq_lens_host=(1,),
    )
    hidden = torch.zeros(1, runner.model.config.hidden_size)
    with pytest.raises(CpuKernelError):
        step.run(hidden, torch.tensor([0]), meta)
    assert all(torch.equal(b, k) for b, (k, _) in zip(before, runner.kv_caches, strict=True))


def test_the_plan_follows_the_kv_pool(models, monkeypatch) -> None:
    """A plan points into the caches it was built over: the same cache objects reuse it,
    other ones (a new pool) get a new plan, never the old pointers."""
    monkeypatch.setenv("ENGINE_FUSED_DECODE", "1")
    loaded = models("llama", "Q4_1", "float32")
    a, b = _runner(loaded, "auto"), _runner(loaded, "int8")
    step = a.model.plan_fused_step(a.kv_caches)
    assert step is not None and a.model.plan_fused_step(list(a.kv_caches)) is step
    other = a.model.plan_fused_step(b.kv_caches)
    assert other is not None and other is not step and other.model.kv_int8 == 1
    monkeypatch.setenv("ENGINE_FUSED_DECODE", "0")
    assert a.model.plan_fused_step(b.kv_caches) is None


def test_the_runner_decodes_the_same_tokens_fused_and_unfused(models, monkeypatch) -> None:
    """Through ModelRunner.execute (input preparation, sampling, logprobs): 24 greedy
    tokens for five prompts, fused and not, the same tokens and the same logprobs."""
    from greedy_driver import run_greedy

    loaded = models("qwen2", "Q4_1", "bfloat16")
    prompts = _prompts(loaded.config.vocab_size)
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("ENGINE_FUSED_DECODE", flag)
        runner = _runner(loaded, "int8")
        runs[flag] = [[(s.token_id, s.logprob) for s in run]
                      for run in run_greedy(runner, prompts, 24, chunk_size=5, block_size=BLOCK_SIZE)]
        step = runner.model.fused_step
        assert (step is not None and step.steps >= 23) == (flag == "1")
    assert runs["1"] == runs["0"]
    assert all(len({t for t, _ in run}) > 1 for run in runs["1"])  # not one token repeated
