"""Triton kernels against the torch reference (``engine.ops.reference`` / ``sampling_ref``).

On a machine without CUDA the kernels run in Triton's CPU interpreter. ``TRITON_INTERPRET``
is read when a ``@triton.jit`` decorator runs: for triton's own library that is when
``triton`` is first imported, for ours when ``engine.ops.triton`` is; and the interpreter
imports more triton modules lazily at the first launch, which assert the flag again. So it
must be set before triton is imported and stay set: this module sets it at import, before
importing anything that imports triton. Only triton reads the variable, so the rest of the
suite (CPU torch) is unaffected. pytest imports every test module before running any test,
and no module imports triton at import time (transformers pulls it in through
``torch._dynamo`` only when a model loads); the guard below fails loudly if that changes.
With CUDA the flag is left alone and the same tests run on the GPU.

Tolerances: fp32 kernels and the reference differ by summation order only (~1e-6 relative
on O(1) values); 2e-5 leaves room without hiding a wrong mask, slot or split weight (those
move outputs by O(0.1)). fp16/bf16: inputs carry 11/8 significant bits and the kernels
round probabilities to the input dtype for the P.V product (as flash attention does);
1e-2 (fp16) and 3e-2 (bf16) are a few steps of that rounding on O(1) values.
"""

from __future__ import annotations

import os
import sys

import torch

_CUDA = torch.cuda.is_available()
if not _CUDA:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "triton was imported before tests/test_kernels.py could set TRITON_INTERPRET=1; "
            "run the kernel tests first or set TRITON_INTERPRET=1 in the environment"
        )
    os.environ["TRITON_INTERPRET"] = "1"

import inspect  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402

from engine.ops import AttentionMetadata  # noqa: E402
from engine.ops.reference import TorchOps  # noqa: E402
from engine.ops.sampling_ref import apply_min_p, apply_top_k, apply_top_p, truncate  # noqa: E402
from engine.ops.triton import attention_decode, attention_prefill, sampling  # noqa: E402
from engine.ops.triton_ops import TritonOps  # noqa: E402

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("one_thread")]
DEVICE = torch.device("cuda" if _CUDA else "cpu")
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def test_kernels_are_interpreted_on_cpu() -> None:
    """Guards the env-var ordering documented above: compiled kernels cannot run on CPU."""
    kernel = attention_decode._decode_split_kernel
    assert _CUDA or type(kernel).__name__ == "InterpretedFunction"


def test_triton_ops_has_every_op_with_the_reference_signature() -> None:
    for name in ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul",
                 "gelu_tanh_and_mul", "write_kv_cache", "paged_attention_decode", "paged_attention_prefill", "sample"):
        assert inspect.signature(getattr(TritonOps, name)) == inspect.signature(getattr(TorchOps, name))


# --- pointwise --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_fused_add(dtype: torch.dtype) -> None:
    x, r, w = _rand(5, 96, seed=0, dtype=dtype), _rand(5, 96, seed=1, dtype=dtype), _rand(96, seed=2, dtype=dtype)
    torch.testing.assert_close(TritonOps().rms_norm(x, w, 1e-5), TorchOps().rms_norm(x, w, 1e-5), **TOL[dtype])
    got_out, got_sum = TritonOps().fused_add_rms_norm(x.clone(), r, w, 1e-5)
    want_out, want_sum = TorchOps().fused_add_rms_norm(x.clone(), r, w, 1e-5)
    # One rounding of x + r on both sides; equal in fp32. (The CPU interpreter's fp32->bf16
    # cast truncates where the GPU rounds to nearest, so bf16 may differ by one step.)
    torch.testing.assert_close(got_sum, want_sum, **TOL[dtype])
    if dtype == torch.float32:
        assert torch.equal(got_sum, want_sum)
    torch.testing.assert_close(got_out, want_out, **TOL[dtype])


@pytest.mark.parametrize("rot", [32, 24], ids=["whole-head", "partial"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_in_place_on_views_of_a_fused_qkv(dtype: torch.dtype, rot: int) -> None:
    t, h, hkv, d = 6, 4, 2, 32
    qkv = _rand(t, (h + 2 * hkv) * d, seed=3, dtype=dtype)
    cache = _rand(64, rot, seed=4, dtype=dtype)
    positions = torch.tensor([0, 1, 7, 8, 31, 63], device=DEVICE)
    q, k, _ = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    want_q, want_k = TorchOps().rotary_embedding(positions, q.reshape(t, h, d), k.reshape(t, hkv, d), cache)
    got_q, got_k = TritonOps().rotary_embedding(positions, q.view(t, h, d), k.view(t, hkv, d), cache)
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])
    # In place: the fused buffer itself now holds the rotated values.
    torch.testing.assert_close(qkv[:, : h * d].view(t, h, d), want_q, **TOL[dtype])


def test_silu_and_mul() -> None:
    x = _rand(3, 2 * 80, seed=5)
    torch.testing.assert_close(TritonOps().silu_and_mul(x), TorchOps().silu_and_mul(x), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul(dtype: torch.dtype) -> None:
    x = _rand(3, 2 * 80, seed=6, dtype=dtype) * 4  # both tails of the tanh
    got, want = TritonOps().gelu_tanh_and_mul(x), TorchOps().gelu_tanh_and_mul(x)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_touches_only_the_given_slots(dtype: torch.dtype) -> None:
    blocks, bs, hkv, d = 6, 4, 2, 16
    key, value = _rand(7, hkv, d, seed=6, dtype=dtype), _rand(7, hkv, d, seed=7, dtype=dtype)
    # Slots in scrambled order across blocks, including a block's first and last offset.
    slots = torch.tensor([5, 0, 23, 12, 3, 16, 9], device=DEVICE)
    caches = []
    for ops in (TritonOps(), TorchOps()):
        kc = torch.full((blocks, bs, hkv, d), float("nan"), dtype=dtype, device=DEVICE)
        vc = kc.clone()
        ops.write_kv_cache(key, value, kc, vc, slots)
        caches.append((kc, vc))
    for got, want in zip(caches[0], caches[1], strict=True):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


# --- attention --------------------------------------------------------------------------


def _paged_cache(num_blocks: int, bs: int, hkv: int, d: int, dtype: torch.dtype, seed: int):
    k = _rand(num_blocks, bs, hkv, d, seed=seed, dtype=dtype)
    v = _rand(num_blocks, bs, hkv, d, seed=seed + 1, dtype=dtype)
    return k, v


def _tables(seq_lens: list[int], bs: int, num_blocks: int, seed: int) -> torch.Tensor:
    """Each request gets its own scrambled blocks, so a wrong table lookup reads wrong data."""
    need = [math.ceil(n / bs) for n in seq_lens]
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at : at + n]
        at += n
    return table.to(DEVICE)


# Context lengths: one token, exactly one block, one past a block, and a long context that
# spans several 64-token tiles and (with num_splits=3) three splits of unequal fill.
DECODE_LENS = [1, 16, 17, 300]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "dtype", "splits"),
    [
        (4, 4, 64, torch.float32, None),  # MHA
        (8, 2, 64, torch.float32, 3),  # GQA 4, forced split-K + reduce
        (8, 1, 128, torch.float16, 3),  # MQA / GQA 8, head_dim 128, half precision
        (8, 1, 64, torch.bfloat16, 1),
        # Asking for 8 splits of 300 tokens gives five 64-token splits: the long request
        # fills all five, the short ones leave four empty splits for the reduce to skip.
        (8, 2, 128, torch.bfloat16, 8),
    ],
)
def test_paged_decode_matches_reference(heads, kv_heads, head_dim, dtype, splits) -> None:
    bs = 16
    num_blocks = sum(math.ceil(n / bs) for n in DECODE_LENS) + 2
    kc, vc = _paged_cache(num_blocks, bs, kv_heads, head_dim, dtype, seed=10)
    tables = _tables(DECODE_LENS, bs, num_blocks, seed=11)
    seq_lens = torch.tensor(DECODE_LENS, dtype=torch.int32, device=DEVICE)
    q = _rand(len(DECODE_LENS), heads, head_dim, seed=12, dtype=dtype)
    scale = head_dim**-0.5
    want = TorchOps().paged_attention_decode(q, kc, vc, tables, seq_lens, scale, tuple(DECODE_LENS))
    got = attention_decode.paged_attention_decode(
        q, kc, vc, tables, seq_lens, scale, tuple(DECODE_LENS), num_splits=splits
    )
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_decode_splits_one_long_request_but_not_a_full_batch() -> None:
    """Flash-decoding's point: a lone long request is spread over many programs, while a
    batch that already fills the device, or a short context, runs unsplit."""
    choose = attention_decode.choose_num_splits
    assert choose(1, 1, 64 * 1024, DEVICE) > 1
    assert choose(1, 1, attention_decode.MIN_PARTITION, DEVICE) == 1
    assert choose(4096, 8, 64 * 1024, DEVICE) == 1
    # Never more splits than MIN_PARTITION-token pieces of the context.
    assert choose(1, 1, 3 * attention_decode.MIN_PARTITION, DEVICE) <= 3


def _meta(query_lens: list[int], seq_lens: list[int], tables: torch.Tensor, bs: int) -> AttentionMetadata:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    slots = []
    for b, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for pos in range(s - q, s):
            slots.append(int(tables[b, pos // bs]) * bs + pos % bs)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=tuple(query_lens),
        seq_lens_host=tuple(seq_lens),
    )


# (new tokens, context incl. them): a decode row, a fresh prompt ending on a block edge,
# a chunk whose cached past ends on a block edge, a chunk one past an edge that crosses
# query tiles, and a fresh prompt longer than a query tile.
PREFILL_QUERY = [1, 8, 5, 19, 21]
PREFILL_SEQ = [9, 8, 13, 36, 21]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "dtype"),
    [(2, 2, 64, torch.float32), (8, 2, 32, torch.float32), (8, 1, 64, torch.float16),
     (4, 1, 32, torch.bfloat16), (4, 1, 128, torch.float32)],
)
def test_paged_prefill_matches_reference(heads, kv_heads, head_dim, dtype) -> None:
    bs = 8
    num_blocks = sum(math.ceil(n / bs) for n in PREFILL_SEQ) + 1
    kc, vc = _paged_cache(num_blocks, bs, kv_heads, head_dim, dtype, seed=20)
    tables = _tables(PREFILL_SEQ, bs, num_blocks, seed=21)
    meta = _meta(PREFILL_QUERY, PREFILL_SEQ, tables, bs)
    q = _rand(sum(PREFILL_QUERY), heads, head_dim, seed=22, dtype=dtype)
    scale = head_dim**-0.5
    want = TorchOps().paged_attention_prefill(q, kc, vc, meta, scale)
    # A 16-row query tile makes the 19- and 21-token chunks cross tile edges.
    got = attention_prefill.paged_attention_prefill(q, kc, vc, meta, scale, block_m=16)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize(("window", "softcap"), [(7, 0.0), (20, 0.0), (0, 2.0), (12, 2.0)])
def test_windowed_and_softcapped_attention_match_reference(window: int, softcap: float) -> None:
    """Sliding windows (shorter than a block, longer than a query tile) and Gemma 2's
    soft-cap, in prefill (tiles that straddle the window's edge) and split decode."""
    bs, heads, kv_heads, head_dim = 8, 4, 2, 32
    num_blocks = sum(math.ceil(n / bs) for n in PREFILL_SEQ) + 1
    kc, vc = _paged_cache(num_blocks, bs, kv_heads, head_dim, torch.float32, seed=40)
    tables = _tables(PREFILL_SEQ, bs, num_blocks, seed=41)
    meta = _meta(PREFILL_QUERY, PREFILL_SEQ, tables, bs)
    q = _rand(sum(PREFILL_QUERY), heads, head_dim, seed=42) * 3  # scores the cap bends
    scale = head_dim**-0.5
    kw = dict(window=window, softcap=softcap)
    want = TorchOps().paged_attention_prefill(q, kc, vc, meta, scale, **kw)
    got = attention_prefill.paged_attention_prefill(q, kc, vc, meta, scale, block_m=16, **kw)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    lens = tuple(DECODE_LENS)
    dkc, dvc = _paged_cache(sum(math.ceil(n / 16) for n in lens) + 2, 16, kv_heads, head_dim, torch.float32, seed=43)
    dtables = _tables(list(lens), 16, dkc.shape[0], seed=44)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    dq = _rand(len(lens), heads, head_dim, seed=45) * 3
    want = TorchOps().paged_attention_decode(dq, dkc, dvc, dtables, seq, scale, lens, **kw)
    for splits in (1, 3):
        got = attention_decode.paged_attention_decode(dq, dkc, dvc, dtables, seq, scale, lens, splits, **kw)
        torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("window", [0, 12])
def test_attention_sinks_match_reference(window: int) -> None:
    """gpt-oss's attention sinks in prefill (tiles crossing the window) and in decode,
    one split (the kernel starts from the sink) and three (the reduce adds it once)."""
    bs, heads, kv_heads, head_dim = 8, 4, 2, 32
    num_blocks = sum(math.ceil(n / bs) for n in PREFILL_SEQ) + 1
    kc, vc = _paged_cache(num_blocks, bs, kv_heads, head_dim, torch.float32, seed=50)
    tables = _tables(PREFILL_SEQ, bs, num_blocks, seed=51)
    meta = _meta(PREFILL_QUERY, PREFILL_SEQ, tables, bs)
    q = _rand(sum(PREFILL_QUERY), heads, head_dim, seed=52)
    sinks = _rand(heads, seed=53) * 2
    scale = head_dim**-0.5
    kw = dict(window=window, sinks=sinks)
    want = TorchOps().paged_attention_prefill(q, kc, vc, meta, scale, **kw)
    got = attention_prefill.paged_attention_prefill(q, kc, vc, meta, scale, block_m=16, **kw)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    assert (got - TorchOps().paged_attention_prefill(q, kc, vc, meta, scale, window=window)).abs().max() > 1e-2
    lens = tuple(DECODE_LENS)
    dkc, dvc = _paged_cache(sum(math.ceil(n / 16) for n in lens) + 2, 16, kv_heads, head_dim, torch.float32, seed=54)
    dtables = _tables(list(lens), 16, dkc.shape[0], seed=55)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    dq = _rand(len(lens), heads, head_dim, seed=56)
    want = TorchOps().paged_attention_decode(dq, dkc, dvc, dtables, seq, scale, lens, **kw)
    for splits in (1, 3):
        got = attention_decode.paged_attention_decode(dq, dkc, dvc, dtables, seq, scale, lens, splits, **kw)
        torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_prefill_after_kv_write_through_triton_ops() -> None:
    """The op pair a layer runs: write this step's K/V, then attend (default tiling)."""
    bs, hkv, d = 8, 2, 32
    num_blocks = sum(math.ceil(n / bs) for n in PREFILL_SEQ)
    kc, vc = _paged_cache(num_blocks, bs, hkv, d, torch.float32, seed=30)
    tables = _tables(PREFILL_SEQ, bs, num_blocks, seed=31)
    meta = _meta(PREFILL_QUERY, PREFILL_SEQ, tables, bs)
    t = sum(PREFILL_QUERY)
    q, k, v = _rand(t, 4, d, seed=32), _rand(t, hkv, d, seed=33), _rand(t, hkv, d, seed=34)
    outs = []
    for ops in (TritonOps(), TorchOps()):
        kc2, vc2 = kc.clone(), vc.clone()
        ops.write_kv_cache(k, v, kc2, vc2, meta.slot_mapping)
        outs.append(ops.paged_attention_prefill(q, kc2, vc2, meta, d**-0.5))
    torch.testing.assert_close(outs[0], outs[1], **TOL[torch.float32])


# --- sampling ---------------------------------------------------------------------------


def _rows(n: int, vocab: int, seed: int, ties: bool = False) -> torch.Tensor:
    logits = _rand(n, vocab, seed=seed) * 3
    # Quantised logits give many exact ties, including at the top-k / top-p cut.
    return logits.round() if ties else logits


def _params(n: int, **cols):
    full = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    full.update(cols)
    t = lambda v, dt: torch.as_tensor(v, dtype=dt, device=DEVICE).expand(n).clone()  # noqa: E731
    return (t(full["temperature"], torch.float32), t(full["top_k"], torch.int32),
            t(full["top_p"], torch.float32), t(full["min_p"], torch.float32))


@pytest.mark.parametrize(
    ("case", "ties"),
    [
        (dict(top_k=[1, 5, 37, 299, 300, 0]), True),
        (dict(top_p=[0.05, 0.5, 0.9, 0.99, 1.0, 0.3], temperature=[1.0, 0.5, 2.0, 1.0, 1.0, 0.7]), False),
        (dict(top_p=[0.5, 0.9, 1.0, 0.8, 0.95, 0.2]), True),
        (dict(min_p=[0.0, 0.01, 0.1, 0.5, 1.0, 0.2], temperature=[1.0, 1.0, 0.5, 1.0, 1.0, 3.0]), False),
        (dict(top_k=[3, 50, 10, 0, 200, 20], top_p=[0.9, 0.6, 1.0, 0.7, 0.95, 0.5],
              min_p=[0.0, 0.05, 0.1, 0.02, 0.0, 0.3], temperature=[0.8, 1.0, 1.5, 1.0, 0.6, 1.0]), False),
    ],
    ids=["top_k-ties", "top_p", "top_p-ties", "min_p", "all-three"],
)
def test_sampling_masks_equal_the_reference(case, ties) -> None:
    logits = _rows(6, 300, seed=40, ties=ties)
    temperature, top_k, top_p, min_p = _params(6, **case)
    got = sampling.keep_mask(logits, temperature, top_k, top_p, min_p)
    want = torch.isfinite(truncate(logits, temperature, top_k, top_p, min_p))
    assert torch.equal(got, want)
    # The case really truncates something in most rows (else the check is vacuous).
    assert (want.sum(-1) < 300).sum() >= 3


def test_sampling_over_a_vocabulary_of_several_chunks() -> None:
    """Real vocabularies span many 1024-token chunks of the kernel's loops (the tests above
    fit one): the online max/sum, the earliest-argmax rule, the radix counts and the race
    must all carry across chunk edges, the last chunk ragged."""
    vocab = 2500
    logits = _rows(4, vocab, seed=44, ties=True)
    # Row 0: the maximum tied in the second and third chunk (the lower id must win);
    # row 1: the maximum in the ragged last chunk.
    logits[0, 1500] = logits[0, 2200] = 20.0
    logits[1, 2499] = 20.0
    temperature, top_k, top_p, min_p = _params(
        4, temperature=[0.0, 0.0, 0.7, 1.3], top_k=[0, 0, 1500, 40],
        top_p=[1.0, 1.0, 0.9, 0.6], min_p=[0.0, 0.0, 0.01, 0.0],
    )
    seeds = torch.arange(4, device=DEVICE)
    tokens, logprobs = TritonOps().sample(logits, temperature, top_k, top_p, min_p, seeds)
    assert tokens[:2].tolist() == [1500, 2499]
    want_lp = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs, want_lp, atol=1e-5, rtol=0)
    got = sampling.keep_mask(logits[2:], temperature[2:], top_k[2:], top_p[2:], min_p[2:])
    want = torch.isfinite(truncate(logits[2:], temperature[2:], top_k[2:], top_p[2:], min_p[2:]))
    assert torch.equal(got, want)
    assert (want.sum(-1) < vocab).all()
    assert all(bool(want[r, tokens[2 + r]]) for r in range(2))  # drawn from the kept set


def test_reference_mask_helpers_agree_with_truncate() -> None:
    """``truncate`` is the composition the kernel reproduces; pin its order here too."""
    logits = _rows(2, 50, seed=41)
    k = torch.tensor([5, 10], dtype=torch.int32, device=DEVICE)
    p = torch.tensor([0.8, 0.5], device=DEVICE)
    m = torch.tensor([0.1, 0.0], device=DEVICE)
    one = torch.ones(2, device=DEVICE)
    want = apply_min_p(apply_top_p(apply_top_k(logits, k), p), m)
    assert torch.equal(torch.isfinite(truncate(logits, one, k, p, m)), torch.isfinite(want))


def test_greedy_rows_and_logprobs_match_the_reference() -> None:
    logits = _rows(5, 300, seed=42, ties=True)  # ties at the max: the lowest id must win
    temperature = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0], device=DEVICE)
    _, top_k, top_p, min_p = _params(5, top_k=3)
    seeds = torch.arange(5, device=DEVICE)
    got_tok, got_lp = TritonOps().sample(logits, temperature, top_k, top_p, min_p, seeds)
    want_tok, _ = TorchOps().sample(logits, temperature, top_k, top_p, min_p, seeds)
    greedy = temperature == 0
    assert torch.equal(got_tok[greedy], want_tok[greedy])
    want_lp = torch.log_softmax(logits, -1).gather(-1, got_tok[:, None]).squeeze(-1)
    torch.testing.assert_close(got_lp, want_lp, atol=1e-5, rtol=0)
    # The sampled (non-greedy) row stays inside its top-3.
    assert got_tok[3] in torch.topk(logits[3], 3).indices


def test_sampled_tokens_fit_the_truncated_distribution() -> None:
    """Chi-square goodness of fit of 240 seeded draws to softmax(x / T) after min-p.

    Each row of the batch is one draw with its own seed (the interpreter runs ~0.1 s per
    row, hence the modest count). Target after temperature 0.8 and min_p 0.15 over five
    logits: the last two tokens are cut, the others keep their renormalised probabilities.
    With 2 degrees of freedom the 0.1% critical value is 13.82; seeds are fixed, so the test is
    deterministic, and a wrong temperature, a wrong mask or a biased draw lands far above.
    """
    n = 240
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -1.5], device=DEVICE).expand(n, 5).contiguous()
    temperature, top_k, top_p, min_p = _params(n, temperature=0.8, min_p=0.15)
    seeds = torch.arange(1000, 1000 + n, device=DEVICE)
    tokens, _ = TritonOps().sample(logits, temperature, top_k, top_p, min_p, seeds)
    target = torch.softmax(truncate(logits[:1], temperature[:1], top_k[:1], top_p[:1], min_p[:1])[0], -1)
    assert (target[3:] == 0).all() and (target[:3] > 0.1).all()
    counts = torch.bincount(tokens.cpu(), minlength=5).double()
    assert (counts[3:] == 0).all()
    expected = target[:3].cpu().double() * n
    chi2 = ((counts[:3] - expected) ** 2 / expected).sum().item()
    assert chi2 < 13.82, (counts.tolist(), expected.tolist())


def test_seeded_rows_draw_the_same_token_in_any_batch() -> None:
    vocab = 300
    logits = _rows(6, vocab, seed=43)  # high entropy: different seeds give different draws
    temperature, top_k, top_p, min_p = _params(6, temperature=1.5, top_p=0.95)
    seeds = torch.tensor([7, 8, 9, 10, 11, 12], device=DEVICE)
    full, _ = TritonOps().sample(logits, temperature, top_k, top_p, min_p, seeds)
    # The same requests in another order, and two of them alone, beside other parameters.
    order = torch.tensor([4, 1, 5, 0], device=DEVICE)
    part, _ = TritonOps().sample(
        logits[order], temperature[order], top_k[order], top_p[order], min_p[order], seeds[order]
    )
    assert torch.equal(part, full[order])
    solo, _ = TritonOps().sample(logits[2:3], temperature[2:3], top_k[2:3], top_p[2:3], min_p[2:3], seeds[2:3])
    assert solo.item() == full[2].item()
    # Same logits, another seed: the draws are not all the same (the seed is used).
    reseeded, _ = TritonOps().sample(logits, temperature, top_k, top_p, min_p, seeds + 100)
    assert not torch.equal(reseeded, full)


# --- empty batch ------------------------------------------------------------------------


def test_every_op_accepts_an_empty_batch() -> None:
    """A step can leave a kernel with no rows (no decode rows, no sampled rows): each op
    returns an empty result of the right shape instead of launching an empty grid."""
    ops = TritonOps()
    kc = _rand(4, 4, 2, 16, seed=50)
    vc = kc.clone()
    q = _rand(0, 4, 16, seed=51)
    none32 = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    none64 = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    tables = torch.zeros(0, 1, dtype=torch.int32, device=DEVICE)
    assert ops.paged_attention_decode(q, kc, vc, tables, none32, 0.25, ()).shape == (0, 4, 16)
    meta = AttentionMetadata(none64, torch.zeros(1, dtype=torch.int32, device=DEVICE), none32, tables, 0, 0, (), ())
    assert ops.paged_attention_prefill(q, kc, vc, meta, 0.25).shape == (0, 4, 16)
    before = kc.clone()
    ops.write_kv_cache(_rand(0, 2, 16, seed=52), _rand(0, 2, 16, seed=53), kc, vc, none64)
    assert torch.equal(kc, before)
    empty = torch.zeros(0, device=DEVICE)
    tokens, logprobs = ops.sample(_rand(0, 10, seed=54), empty, none32, empty + 1, empty, none64)
    assert tokens.shape == logprobs.shape == (0,)
    assert ops.rms_norm(_rand(0, 8, seed=55), _rand(8, seed=56), 1e-5).shape == (0, 8)
    assert ops.silu_and_mul(_rand(0, 8, seed=57)).shape == (0, 4)
    rq, rk = ops.rotary_embedding(none64, q, _rand(0, 2, 16, seed=58), _rand(8, 16, seed=59))
    assert rq.shape == (0, 4, 16) and rk.shape == (0, 2, 16)


# --- model level ------------------------------------------------------------------------
# The model-level check (greedy tokens and logprobs of every tiny architecture on TritonOps
# against transformers) lives beside the other parity tests, in tests/test_parity.py.
