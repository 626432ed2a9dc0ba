"""The engine's model and runner against Hugging Face transformers, token for token.

Every tiny architecture greedy-decodes a batch of mixed-length prompts through the paged
runner (whole prompts, and chunked prefill whose chunks straddle block boundaries), once
with the torch reference ops and once with the CPU path's C kernels, and must produce
exactly the tokens of ``transformers``' greedy ``generate`` in fp32. Each token's
logprob must also match transformers' ``log_softmax`` of its logits. Separately, the full
logits row at every prompt position (whole, chunked and one-token-per-step prefill over
scrambled blocks) must match transformers' forward in fp32, bf16 and fp16.

Logprob and fp32 logit tolerance, 1e-4 absolute: both sides compute in fp32 and differ
only in summation order (fused q/k/v and gate/up matmuls, paged attention over gathered
blocks versus a dense mask); measured at most 1e-5 on logits up to 18 in magnitude. Any
real fault (a wrong rope position, a missed norm weight, a masked key leaking in) moves
logprobs and logits by 1e-2 or more.

bf16/fp16 logit tolerance: twice transformers' own rounding error in that dtype, i.e.
``max|ours - hf(dtype)| <= 2 * max|hf(dtype) - hf(fp32)|``. Both sides round at the same
places but accumulate in different orders, so they may differ by as much as either differs
from fp32; measured ratios are at most 1.45 (bf16) and 1.4 (fp16). A missed norm weight
gives ratios of at least 4 (bf16) and 40 (fp16) on these models.

The tiny Gemma 2, Gemma 3 and Phi-3 (sliding windows of 8 on Gemma's local layers and on
the tiny Mistral, prompts up to 23 tokens plus 32 decoded) hold to the same tolerances:
measured fp32 logits within 8e-6, bf16/fp16 ratios at most 1.32.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from greedy_driver import run_greedy
from safetensors.torch import load_file
from text_fixtures import hf_causal_lm

from engine.models.config import ModelConfig
from engine.models.loader import default_model_path, load_model
from engine.models.testing import (
    MISTRAL_WINDOW,
    PHI3_ORIGINAL_POSITIONS,
    TINY_ARCHITECTURES,
    write_tiny_model,
)
from engine.ops import AttentionMetadata, get_ops
from engine.runner.model_runner import ModelRunner

NEW_TOKENS = 32
LOGPROB_ATOL = 1e-4  # see the module docstring
LOGIT_ATOL_FP32 = 1e-4  # see the module docstring
LOW_PRECISION_SLACK = 2.0  # x transformers' own bf16/fp16 error; see the module docstring


pytestmark = pytest.mark.usefixtures("one_thread")


def _prompts(vocab: int) -> list[list[int]]:
    # Lengths 1 to 23: one token, exactly one and two blocks of 4 / one of 8, one past a
    # block, and several blocks; seeded so failures reproduce.
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 4, 8, 9, 23)]


# The torch reference, and the CPU path's C kernels (what the engine runs on CPU).
OPS = ["torch", "cpu"]


def _runner(loaded: types.SimpleNamespace, block_size: int, ops: str) -> ModelRunner:
    # Triton runs on CUDA when there is one, else interpreted on CPU (conftest sets
    # TRITON_INTERPRET); the other op sets are the CPU path.
    device = "cuda" if ops == "triton" and torch.cuda.is_available() else "cpu"
    return ModelRunner(
        loaded,
        device=device,
        ops=get_ops(ops),
        num_blocks=512 // block_size,
        block_size=block_size,
        max_num_batched_tokens=512,
        max_num_seqs=8,
    )


def _hf_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs for one prompt (no padding involved)."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs


def _hf_model(folder: Path, dtype: torch.dtype = torch.float32):
    model = hf_causal_lm(folder, dtype)
    # Generate exactly NEW_TOKENS: the engine side ignores EOS too.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module", params=TINY_ARCHITECTURES)
def tiny(request, tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    loaded = types.SimpleNamespace(
        config=config, weights=load_file(str(folder / "model.safetensors")), dtype=torch.float32
    )
    hf = _hf_model(folder)
    prompts = _prompts(config.vocab_size)
    expected = [_hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    return loaded, prompts, expected, folder


def _check_fused(runner: ModelRunner, ops: str) -> None:
    """On the C kernels every decode step ran fused (ops/cpu/fused.c): transformers then
    checks that path; on the torch ops none did."""
    fused = runner.model.fused_step
    assert (fused is not None and fused.steps >= NEW_TOKENS - 1) == (ops == "cpu")


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize(
    ("block_size", "chunk_size"),
    [(4, None), (8, None), (4, 3), (8, 5)],
    ids=["bs4", "bs8", "bs4-chunk3", "bs8-chunk5"],
)
def test_greedy_tokens_and_logprobs_match_transformers(tiny, block_size, chunk_size, ops) -> None:
    loaded, prompts, expected, _ = tiny
    runner = _runner(loaded, block_size, ops)
    runs = run_greedy(runner, prompts, NEW_TOKENS, chunk_size=chunk_size, block_size=block_size)
    _check_fused(runner, ops)
    for run, (want_tokens, want_logprobs) in zip(runs, expected, strict=True):
        assert [s.token_id for s in run] == want_tokens
        got = torch.tensor([s.logprob for s in run], dtype=torch.float64)
        torch.testing.assert_close(got, torch.tensor(want_logprobs, dtype=torch.float64), atol=LOGPROB_ATOL, rtol=0)


def test_tiny_models_do_not_degenerate(tiny) -> None:
    """A model that repeats one token would make every parity test above vacuous."""
    _, _, expected, _ = tiny
    assert all(len(set(tokens)) > 1 for tokens, _ in expected)


def _chunk_lengths(n: int, chunk_size: int | None) -> list[int]:
    """``n`` tokens cut into ``chunk_size`` pieces (``None``: one piece)."""
    if chunk_size is None:
        return [n]
    return [chunk_size] * (n // chunk_size) + ([n % chunk_size] if n % chunk_size else [])


def _prefill_logits(
    runner: ModelRunner, prompts: list[list[int]], chunk_size: int | None, *, plans: list[list[int]] | None = None
) -> list[torch.Tensor]:
    """fp32 logits [len(p), vocab] at every position of each prompt, all prompts prefilled
    together ``chunk_size`` tokens a step (``None``: whole prompts; 1: decode-only steps),
    or each prompt in its own ``plans[i]`` chunk lengths (the steps of a request that
    prefills its prompt whole or chunked and then decodes a token a step).

    Calls the model directly, as the runner does, but keeps every row's logits. Blocks are
    handed out in reverse order, so token order and block order disagree everywhere.
    """
    plans = plans or [_chunk_lengths(len(p), chunk_size) for p in prompts]
    assert [sum(plan) for plan in plans] == [len(p) for p in prompts]
    plans = [list(plan) for plan in plans]
    bs = runner.block_size
    need = [-(-len(p) // bs) for p in prompts]
    free = list(reversed(range(sum(need))))
    tables = [[free.pop(0) for _ in range(n)] for n in need]
    done = [0] * len(prompts)
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    while active := [i for i, p in enumerate(prompts) if done[i] < len(p)]:
        ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for i in active:
            n = plans[i].pop(0)
            span = range(done[i], done[i] + n)
            ids += prompts[i][span.start : span.stop]
            positions += span
            slots += [tables[i][t // bs] * bs + t % bs for t in span]
            query_lens.append(n)
            seq_lens.append(span.stop)
        width = max(len(tables[i]) for i in active)
        dev = runner.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=dev),
            query_start_loc=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor([tables[i] + [0] * (width - len(tables[i])) for i in active],
                                      dtype=torch.int32, device=dev),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_host=tuple(query_lens),
            seq_lens_host=tuple(seq_lens),
        )
        hidden = runner.model.forward(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), meta,
                                      runner.kv_caches)
        # Compared on the host, with transformers' CPU logits.
        for i, rows in zip(active, runner.model.compute_logits(hidden).cpu().split(query_lens), strict=True):
            logits[i].append(rows)
            done[i] += rows.shape[0]
    return [torch.cat(rows) for rows in logits]


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_logits_at_every_position_match_transformers(tiny, dtype, ops) -> None:
    loaded, prompts, _, folder = tiny
    with torch.inference_mode():
        want = [_hf_model(folder, dtype)(torch.tensor([p])).logits[0].float() for p in prompts]
    if dtype == torch.float32:
        atol = LOGIT_ATOL_FP32
    else:
        with torch.inference_mode():
            exact = [_hf_model(folder)(torch.tensor([p])).logits[0] for p in prompts]
        hf_error = max((w - e).abs().max().item() for w, e in zip(want, exact, strict=True))
        assert hf_error > 0  # transformers really ran in low precision
        atol = LOW_PRECISION_SLACK * hf_error
    loaded = types.SimpleNamespace(config=loaded.config, weights=loaded.weights, dtype=dtype)
    for chunk_size in (None, 5, 1):
        got = _prefill_logits(_runner(loaded, 4, ops), prompts, chunk_size)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=atol, rtol=0, msg=lambda m, c=chunk_size: f"chunk {c}: {m}")


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """The tiny Mistral (every layer slides over MISTRAL_WINDOW tokens)."""
    folder = write_tiny_model(tmp_path_factory.mktemp("windowed"), "mistral")
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    assert config.layer_windows == (MISTRAL_WINDOW,) * config.num_hidden_layers
    loaded = types.SimpleNamespace(
        config=config, weights=load_file(str(folder / "model.safetensors")), dtype=torch.float32
    )
    return loaded, folder


# 25x the window: keys far out of every window must be masked, not merely unlikely.
LONG_PROMPT = 200


@pytest.mark.parametrize("ops", OPS)
def test_a_request_far_longer_than_the_window_matches_transformers(windowed, ops) -> None:
    loaded, folder = windowed
    g = torch.Generator().manual_seed(99)
    prompt = torch.randint(3, loaded.config.vocab_size, (LONG_PROMPT,), generator=g).tolist()
    hf = _hf_model(folder)
    want_tokens, want_logprobs = _hf_greedy(hf, prompt, NEW_TOKENS)
    assert len(set(want_tokens)) > 1
    for chunk in (None, 48):
        runner = _runner(loaded, 16, ops)
        (run,) = run_greedy(runner, [prompt], NEW_TOKENS, chunk_size=chunk, block_size=16)
        _check_fused(runner, ops)
        assert [s.token_id for s in run] == want_tokens
        got = torch.tensor([s.logprob for s in run], dtype=torch.float64)
        torch.testing.assert_close(got, torch.tensor(want_logprobs, dtype=torch.float64), atol=LOGPROB_ATOL, rtol=0)
    with torch.inference_mode():
        want = hf(torch.tensor([prompt])).logits[0]
    (got,) = _prefill_logits(_runner(loaded, 16, ops), [prompt], 37)
    torch.testing.assert_close(got, want, atol=LOGIT_ATOL_FP32, rtol=0)
    # The window matters: the same weights with full attention give other logits.
    full = types.SimpleNamespace(
        config=dataclasses.replace(loaded.config, layer_windows=(0,) * loaded.config.num_hidden_layers),
        weights=loaded.weights,
        dtype=torch.float32,
    )
    (unwindowed,) = _prefill_logits(_runner(full, 16, ops), [prompt], None)
    assert (unwindowed[MISTRAL_WINDOW:] - want[MISTRAL_WINDOW:]).abs().max() > 100 * LOGIT_ATOL_FP32


def _rescaled(tmp_path, arch: str, extra: dict) -> tuple[types.SimpleNamespace, Path]:
    folder = write_tiny_model(tmp_path, arch)
    raw = json.loads((folder / "config.json").read_text()) | extra
    (folder / "config.json").write_text(json.dumps(raw))
    config = ModelConfig.from_hf(raw)
    loaded = types.SimpleNamespace(
        config=config, weights=load_file(str(folder / "model.safetensors")), dtype=torch.float32
    )
    return loaded, folder


@pytest.mark.parametrize("ops", OPS)
def test_yarn_rope_matches_transformers_past_the_original_length(tmp_path, ops) -> None:
    """YaRN (Qwen2.5's long-context recipe) on the tiny Qwen2: logits at every position of a
    prompt three times the original length, and 32 greedy tokens after it."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    loaded, folder = _rescaled(tmp_path, "qwen2", {"rope_scaling": yarn})
    assert loaded.config.max_position_embeddings == 512  # 4 x 32 < the configured 512
    prompt = torch.randint(3, loaded.config.vocab_size, (96,), generator=torch.Generator().manual_seed(5)).tolist()
    hf = _hf_model(folder)
    with torch.inference_mode():
        want = hf(torch.tensor([prompt])).logits[0]
    (got,) = _prefill_logits(_runner(loaded, 16, ops), [prompt], 40)
    torch.testing.assert_close(got, want, atol=LOGIT_ATOL_FP32, rtol=0)
    want_tokens, _ = _hf_greedy(hf, prompt, NEW_TOKENS)
    (run,) = run_greedy(_runner(loaded, 16, ops), [prompt], NEW_TOKENS, chunk_size=40, block_size=16)
    assert [s.token_id for s in run] == want_tokens
    # Without the scaling the same weights answer differently past the original length.
    plain = types.SimpleNamespace(
        config=dataclasses.replace(loaded.config, rope_scaling=None), weights=loaded.weights, dtype=torch.float32
    )
    (unscaled,) = _prefill_logits(_runner(plain, 16, ops), [prompt], None)
    assert (unscaled - want).abs().max() > 100 * LOGIT_ATOL_FP32


@pytest.mark.parametrize("ops", OPS)
def test_dynamic_ntk_rope_matches_transformers_while_decoding_past_the_trained_length(tmp_path, ops) -> None:
    """Dynamic NTK re-bases RoPE for every length past the trained one (32 here): a 20-token
    prompt decoded 32 tokens crosses it, and every token and logprob matches transformers."""
    dynamic = {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 32}
    loaded, folder = _rescaled(tmp_path, "llama", dynamic)
    assert loaded.config.max_position_embeddings == 64  # factor x trained, as vLLM
    prompt = torch.randint(3, loaded.config.vocab_size, (20,), generator=torch.Generator().manual_seed(6)).tolist()
    want_tokens, want_logprobs = _hf_greedy(_hf_model(folder), prompt, NEW_TOKENS)
    (run,) = run_greedy(_runner(loaded, 4, ops), [prompt], NEW_TOKENS, chunk_size=7, block_size=4)
    assert [s.token_id for s in run] == want_tokens
    got = torch.tensor([s.logprob for s in run], dtype=torch.float64)
    torch.testing.assert_close(got, torch.tensor(want_logprobs, dtype=torch.float64), atol=LOGPROB_ATOL, rtol=0)
    # The tokens decoded past position 32 are what tells dynamic from plain RoPE.
    plain = types.SimpleNamespace(
        config=dataclasses.replace(loaded.config, rope_scaling=None), weights=loaded.weights, dtype=torch.float32
    )
    (unscaled,) = run_greedy(_runner(plain, 4, ops), [prompt], NEW_TOKENS, chunk_size=7, block_size=4)
    assert [s.logprob for s in unscaled][:12] == pytest.approx([s.logprob for s in run][:12], abs=LOGPROB_ATOL)
    assert max(abs(a.logprob - b.logprob) for a, b in zip(unscaled[13:], run[13:], strict=True)) > 100 * LOGPROB_ATOL


def _per_position_longrope(hf, original: int) -> None:
    """Make transformers' Phi-3 rotate each position with the factors of its own position:
    short below ``original``, long from it (the engine's rule, see engine/models/layers/rope.py),
    frequencies and attention factor from transformers' own longrope initialiser. Unpatched,
    transformers rotates a whole sequence with the long factors once it is longer than
    ``original`` (re-encoding the prompt), which a paged KV cache cannot do."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS["longrope"]
    short, factor = init(hf.config, None)
    long, long_factor = init(hf.config, None, seq_len=original + 1)
    assert factor == long_factor and not torch.equal(short, long)

    def rotary(x, position_ids):
        pos = position_ids[..., None].float()
        freqs = pos * torch.where(pos < original, short, long)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * factor).to(x.dtype), (emb.sin() * factor).to(x.dtype)

    hf.model.rotary_emb.forward = rotary


def _greedy_by_forward(hf, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens by a full forward per token (no KV cache: nothing to re-encode)."""
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(new_tokens):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize("ops", OPS)
def test_phi3_longrope_past_the_original_length_matches_transformers(tmp_path, ops) -> None:
    """The tiny Phi-3 (longrope switch at PHI3_ORIGINAL_POSITIONS = 64) on an 80-token prompt
    prefilled in 24-token chunks (one straddles position 64) and a 40-token one that crosses
    64 while decoding, 32 greedy tokens each: every token, and the logits at every position
    of the first, match transformers rotating each position with its own factors."""
    folder = write_tiny_model(tmp_path, "phi3")
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    loaded = types.SimpleNamespace(config=config, weights=load_file(str(folder / "model.safetensors")), dtype=torch.float32)
    hf = _hf_model(folder)
    _per_position_longrope(hf, PHI3_ORIGINAL_POSITIONS)
    g = torch.Generator().manual_seed(64)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist() for n in (80, 40)]
    want_tokens = [_greedy_by_forward(hf, p, NEW_TOKENS) for p in prompts]
    assert all(len(set(t)) > 1 for t in want_tokens)
    runs = run_greedy(_runner(loaded, 16, ops), prompts, NEW_TOKENS, chunk_size=24, block_size=16)
    assert [[s.token_id for s in run] for run in runs] == want_tokens
    seq = prompts[0] + want_tokens[0][:-1]
    with torch.inference_mode():
        want = hf(torch.tensor([seq])).logits[0]
    plan = _chunk_lengths(len(prompts[0]), 24) + [1] * (NEW_TOKENS - 1)
    (got,) = _prefill_logits(_runner(loaded, 16, ops), [seq], None, plans=[plan])
    torch.testing.assert_close(got, want, atol=LOGIT_ATOL_FP32, rtol=0)
    # The long factors are on trial: with the short ones everywhere, the logits agree
    # below position 64 and part from it.
    short = dict(config.rope_scaling, long_factor=config.rope_scaling["short_factor"])
    plain = types.SimpleNamespace(
        config=dataclasses.replace(config, rope_scaling=short), weights=loaded.weights, dtype=torch.float32
    )
    (unscaled,) = _prefill_logits(_runner(plain, 16, ops), [seq], None, plans=[plan])
    switch = PHI3_ORIGINAL_POSITIONS
    torch.testing.assert_close(unscaled[:switch], want[:switch], atol=LOGIT_ATOL_FP32, rtol=0)
    assert (unscaled[switch:] - want[switch:]).abs().max() > 100 * LOGIT_ATOL_FP32


# Triton in the CPU interpreter costs ~0.4 s per step of the tiny model, so its check runs
# a few tokens on the prompts of 1 to 9 tokens (one token, one block, two blocks, one past),
# in 3-token chunks that straddle the 4-token blocks.
TRITON_NEW_TOKENS = 3
TRITON_PROMPTS = 4  # the first four of _prompts(): lengths 1, 4, 8, 9


@pytest.mark.kernels
def test_triton_backend_greedy_tokens_and_logprobs_match_transformers(tiny) -> None:
    """The kernels issue's model-level check: this file's parity test with ``TritonOps``."""
    loaded, prompts, expected, _ = tiny
    prompts, expected = prompts[:TRITON_PROMPTS], expected[:TRITON_PROMPTS]
    assert [len(p) for p in prompts] == [1, 4, 8, 9]
    runs = run_greedy(_runner(loaded, 4, "triton"), prompts, TRITON_NEW_TOKENS, chunk_size=3, block_size=4)
    for run, (want_tokens, want_logprobs) in zip(runs, expected, strict=True):
        assert [s.token_id for s in run] == want_tokens[:TRITON_NEW_TOKENS]
        got = torch.tensor([s.logprob for s in run], dtype=torch.float64)
        want = torch.tensor(want_logprobs[:TRITON_NEW_TOKENS], dtype=torch.float64)
        torch.testing.assert_close(got, want, atol=LOGPROB_ATOL, rtol=0)


# The architectures with a sliding window (the tiny Mistral's every layer, the Gemmas' local
# ones) or new ops (Phi-3's fused weights and longrope): their Triton check runs a prompt
# past the window and 32 tokens after it, at ~0.35 s per interpreted step.
TRITON_LONG_ARCHITECTURES = ("mistral", "gemma2", "gemma3", "phi3")


def check_triton_past_the_window(
    loaded: types.SimpleNamespace,
    folder: Path,
    prompt: list[int],
    *,
    chunk_sizes: tuple[int | None, ...] = (None, 5),
    dtype: torch.dtype = torch.float32,
    excuse: Callable[[list[list[int]]], torch.Tensor] | None = None,
) -> None:
    """The Triton backend (interpreted on CPU) on ``prompt`` and the 32 tokens transformers
    greedy-decodes after it, fed back one a step: one request per entry of ``chunk_sizes`` in
    one batch (by default one prefilling the prompt whole and one in 5-token chunks), then
    all decoding. The logits at every
    position (prompt and decode) must match transformers' forward over the same tokens in
    fp32 within ``LOGIT_ATOL_FP32``, and each decode row's argmax must be transformers' next
    token: greedy decoding on these logits gives transformers' 32 tokens, chunked or not.

    ``dtype`` bf16/fp16: the model and transformers both run in it, over the same tokens;
    the logits must match within ``LOW_PRECISION_SLACK`` times transformers' own error in
    that dtype (as ``test_logits_at_every_position_match_transformers``), and each row's
    argmax must be transformers' wherever its top two logits are further apart than twice
    that tolerance (closer, rounding may rightly pick either).

    ``excuse`` (low precision only): called with the requests' chunk plans after our run,
    returns a bool [requests, positions] of rows our run may get wrong for a reason of its
    own (``test_moe``: a routing near-tie that rounding may break either way). Those rows
    are held to nothing, in every request, and transformers' own error is taken over the
    others.

    (Sampling through the Triton sampler is ``test_triton_backend_greedy_tokens_and_logprobs_
    match_transformers``'s and ``test_kernels``'; feeding transformers' tokens back instead of
    our own lets both requests share every decode step.)"""
    hf = _hf_model(folder)
    want_tokens, _ = _hf_greedy(hf, prompt, NEW_TOKENS)
    assert len(set(want_tokens)) > 1
    seq = prompt + want_tokens[:-1]
    with torch.inference_mode():
        want = hf(torch.tensor([seq])).logits[0]
    assert excuse is None or dtype != torch.float32  # fp32 parity is exact everywhere
    if dtype != torch.float32:
        with torch.inference_mode():
            low = _hf_model(folder, dtype)(torch.tensor([seq])).logits[0].float()
        hf_rows, want = (low - want).abs().amax(-1), low
        loaded = types.SimpleNamespace(config=loaded.config, weights=loaded.weights, dtype=dtype)
    n, decode = len(prompt), [1] * (NEW_TOKENS - 1)
    plans = [_chunk_lengths(n, size) + decode for size in chunk_sizes]
    got = _prefill_logits(_runner(loaded, 4, "triton"), [seq] * len(plans), None, plans=plans)
    held = torch.ones(len(seq), dtype=torch.bool)
    if excuse is not None:
        held = ~excuse(plans).any(0).cpu()  # the engine may have routed on the GPU
    atol = LOGIT_ATOL_FP32
    if dtype != torch.float32:
        assert hf_rows[held].max() > 0  # transformers really ran in low precision
        atol = LOW_PRECISION_SLACK * hf_rows[held].max().item()
    top2 = want[n - 1 :].topk(2, -1).values
    clear = ((top2[:, 0] - top2[:, 1] > 2 * atol) & held[n - 1 :]).tolist()
    if dtype == torch.float32:
        assert all(clear)  # fp32 greedy parity is exact: no row may be excused
    for g, plan in zip(got, plans, strict=True):
        torch.testing.assert_close(g[held], want[held], atol=atol, rtol=0, msg=lambda m, p=plan: f"{p[:6]}: {m}")
        picked, best = g[n - 1 :].argmax(-1).tolist(), want[n - 1 :].argmax(-1).tolist()
        assert [a for a, c in zip(picked, clear, strict=True) if c] == [b for b, c in zip(best, clear, strict=True) if c]
        if dtype == torch.float32:
            assert picked == want_tokens


@pytest.mark.kernels
@pytest.mark.parametrize("tiny", TRITON_LONG_ARCHITECTURES, indirect=True)
def test_triton_backend_logits_and_32_greedy_tokens_past_the_window_match_transformers(tiny) -> None:
    loaded, prompts, _, folder = tiny
    prompt = prompts[-1]
    windows = [w for w in loaded.config.layer_windows if w]
    assert len(prompt) > max(windows, default=0) * 2  # Phi-3 has none: longrope is on trial
    check_triton_past_the_window(loaded, folder, prompt)


@pytest.mark.kernels
def test_the_interpreter_rounds_fp32_to_bf16_as_torch_does(interpreter_rounds_to_nearest) -> None:
    """The fixture the bf16 model checks below take: the interpreter's fp32 -> bf16 casts,
    explicit (``.to``) and on a store, give torch's values on ones that round up, ties,
    subnormals, overflow to infinity, infinity and NaN (truncating, 61 of the 128 differ)."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast_twice(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(src + offs, mask=offs < n)
        tl.store(dst + offs, x.to(tl.bfloat16), mask=offs < n)
        tl.store(dst + n + offs, x, mask=offs < n)

    g = torch.Generator().manual_seed(0)
    edges = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.4e38, 1e-40, 0.0, float("inf"), float("nan")]
    x = torch.cat([torch.randn(120, generator=g) * torch.logspace(-30, 30, 120), torch.tensor(edges)])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.empty(2 * len(x), dtype=torch.bfloat16, device=device)
    cast_twice[(1,)](x.to(device), out, len(x), BLOCK=128)
    for got in out.cpu().split(len(x)):
        torch.testing.assert_close(got, x.to(torch.bfloat16), atol=0, rtol=0, equal_nan=True)


# The bf16 Triton check runs on the same architectures (~5 s each interpreted), with the
# interpreter rounding casts to bf16 as a GPU does (it truncates them otherwise, see
# conftest's interpreter_rounds_to_nearest). Measured ratios of our error to transformers'
# own bf16 error, rounding (truncating): 1.01 (1.77) Mistral, 0.97 (0.97) Gemma 2,
# 0.95 (0.95) Gemma 3, 1.11 (2.21) Phi-3; the torch ops give 1.01 and 1.11 on Mistral and
# Phi-3 over the same tokens.
TRITON_BF16_ARCHITECTURES = TRITON_LONG_ARCHITECTURES


@pytest.mark.kernels
@pytest.mark.usefixtures("interpreter_rounds_to_nearest")
@pytest.mark.parametrize("tiny", TRITON_BF16_ARCHITECTURES, indirect=True)
def test_triton_backend_bf16_logits_past_the_window_match_transformers(tiny) -> None:
    """The Triton backend in bf16 on a prompt past twice the sliding window (Phi-3: none)
    and 31 decode steps after it, whole and 5-token-chunked prefill (see
    check_triton_past_the_window)."""
    loaded, prompts, _, folder = tiny
    windows = [w for w in loaded.config.layer_windows if w]
    assert len(prompts[-1]) > 2 * max(windows, default=0)
    check_triton_past_the_window(loaded, folder, prompts[-1], dtype=torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("ops", OPS)
def test_smollm2_gguf_greedy_matches_transformers(ops: str) -> None:
    """The real default model: 32 identical greedy tokens from the same dequantized weights.

    The engine's loader converts the GGUF once into a cached Hugging Face folder and
    transformers loads that folder; the loader's own tests check its dequantization
    against transformers' GGUF reader, so here only the model and runner are on trial.
    """
    # The dequantized weights transformers also runs (the kept-quantized path: test_quant_fidelity).
    loaded = load_model(default_model_path(), dtype="float32", quantization="none")
    hf = _hf_model(loaded.folder)
    # "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    # and a bare "The capital of France is", as SmolLM2's tokenizer spells them.
    prompts = [
        [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
        [504, 3575, 282, 4649, 314],
    ]
    runner = _runner(loaded, 16, ops)
    runs = run_greedy(runner, prompts, NEW_TOKENS, chunk_size=7, block_size=16)
    for run, prompt in zip(runs, prompts, strict=True):
        want_tokens, want_logprobs = _hf_greedy(hf, prompt, NEW_TOKENS)
        assert [s.token_id for s in run] == want_tokens
        got = torch.tensor([s.logprob for s in run], dtype=torch.float64)
        # 30 layers instead of 2: fp32 reordering noise grows, still far below a fault's.
        torch.testing.assert_close(got, torch.tensor(want_logprobs, dtype=torch.float64), atol=1e-3, rtol=0)
