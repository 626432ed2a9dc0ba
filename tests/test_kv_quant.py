"""The 8-bit KV cache (``kv_cache_dtype`` int8 / fp8) on CPU.

Two oracles. (1) Exactness: attention over a quantized cache must equal fp32 attention
over the *dequantized* K/V (codes times scales) up to summation order: 1e-4, as the test
rows' magnitudes spread over e**+-1.5 (so per-row scales matter) and outputs reach ~20; a
wrong scale index, code or dequantization moves outputs by O(0.1) or more. (2) The
quantization error against fp32 attention over the original K/V, bounded a priori:
int8 rounds each value to within half a step, ``|dk| <= max|k row| / 254``; a query's
scores then move by at most ``delta = scale * sum|q| * max|dk|``, which moves the softmax
weights by at most ``exp(2 delta) - 1`` in L1, so an output moves by at most
``max|dv| + (exp(2 delta) - 1) * max|v|``. The test asserts each output row within its
row's bound, and the mean error below one int8 step of the largest value.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.ops import AttentionMetadata, QuantizedKV
from engine.ops.cpu import CpuKernelError, CpuOps
from engine.ops.reference import TorchOps, dequantize_kv, quantize_kv
from engine.runner.kv_cache import allocate_kv_caches, bytes_per_block, num_kv_blocks

EXACT = dict(atol=1e-4, rtol=1e-4)
# bf16 queries: the C kernel keeps dequantized K/V in fp32, the reference rounds them to the
# query's bf16 before SDPA: a few bf16 steps (2**-8 relative) on O(1) outputs.
BF16 = dict(atol=4e-2, rtol=1e-2)


def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _quantized(x: torch.Tensor, dtype: torch.dtype = torch.int8) -> QuantizedKV:
    codes, scale = quantize_kv(x, dtype)
    return QuantizedKV(codes, scale)


# --- quantization -----------------------------------------------------------------------


def test_int8_codes_round_each_value_to_within_half_a_step_of_its_rows_scale() -> None:
    x = _rand(50, 3, 64, seed=0) * torch.linspace(0.01, 100, 50).view(50, 1, 1)
    x[7, 1] = 0.0  # an all-zero row: scale 0, codes 0, no NaN
    codes, scale = quantize_kv(x, torch.int8)
    assert codes.dtype == torch.int8 and scale.shape == (50, 3) and scale.dtype == torch.float32
    assert scale[7, 1] == 0 and not codes[7, 1].any()
    torch.testing.assert_close(scale, x.abs().amax(-1) / 127)
    assert int(codes.abs().max()) == 127  # each row's largest value takes the full range
    err = (dequantize_kv(codes, scale) - x).abs()
    assert bool((err <= scale.unsqueeze(-1) * 0.5 * (1 + 1e-5)).all())


def test_fp8_codes_keep_three_mantissa_bits_of_each_value() -> None:
    x = _rand(40, 2, 32, seed=1) * 10
    codes, scale = quantize_kv(x, torch.float8_e4m3fn)
    assert codes.dtype == torch.float8_e4m3fn
    err = (dequantize_kv(codes, scale) - x).abs()
    # e4m3: half a step is 2**-4 relative for normals; values below the smallest normal
    # (2**-6 of the scale unit) have an absolute step of 2**-9 units.
    assert bool((err <= x.abs() * 2**-4 + scale.unsqueeze(-1) * 2**-10 + 1e-7).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_write_gives_the_references_codes_and_scales(dtype: torch.dtype, threads: int) -> None:
    blocks, bs, hkv, d = 40, 16, 3, 64
    # As the model passes them: K and V are head-contiguous views of one fused qkv row.
    qkv = _rand(300, (4 + 2 * hkv) * d, seed=2, dtype=dtype)
    key = qkv[:, 4 * d : (4 + hkv) * d].view(300, hkv, d)
    value = qkv[:, (4 + hkv) * d :].view(300, hkv, d)
    key[5, 2] = 0.0
    slots = torch.randperm(blocks * bs, generator=torch.Generator().manual_seed(3))[:300]
    got = [QuantizedKV(torch.zeros(blocks, bs, hkv, d, dtype=torch.int8), torch.zeros(blocks, bs, hkv))
           for _ in range(2)]
    want = [QuantizedKV(torch.zeros(blocks, bs, hkv, d, dtype=torch.int8), torch.zeros(blocks, bs, hkv))
            for _ in range(2)]
    CpuOps().write_kv_cache(key, value, *got, slots)
    TorchOps().write_kv_cache(key, value, *want, slots)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.data, w.data) and torch.equal(g.scale, w.scale)
    assert got[0].scale.view(-1, hkv)[slots].gt(0).sum() == 300 * hkv - 1  # every slot written


def test_a_slot_outside_the_int8_cache_raises_and_writes_nothing() -> None:
    cache = [QuantizedKV(torch.zeros(2, 4, 1, 64, dtype=torch.int8), torch.zeros(2, 4, 1)) for _ in range(2)]
    x = _rand(2, 1, 64, seed=4)
    with pytest.raises(CpuKernelError, match="slot"):
        CpuOps().write_kv_cache(x, x, *cache, torch.tensor([3, 8]))
    assert not cache[0].data.any()


# --- attention --------------------------------------------------------------------------


def _paged(lens: list[int], heads: int, kv_heads: int, dim: int, bs: int, seed: int):
    per_req = [-(-n // bs) for n in lens]
    num_blocks = sum(per_req) + 3
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = torch.zeros(len(lens), max(per_req) + 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(per_req):
        tables[b, :n] = torch.tensor(order[used : used + n], dtype=torch.int32)
        used += n
    # Rows of very different magnitudes, so per-row scales matter.
    mag = torch.exp(0.5 * _rand(num_blocks, bs, kv_heads, 1, seed=seed + 4))
    k = _rand(num_blocks, bs, kv_heads, dim, seed=seed + 1) * mag
    v = _rand(num_blocks, bs, kv_heads, dim, seed=seed + 2) * mag
    q = _rand(len(lens), heads, dim, seed=seed + 3)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)


def _error_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kq: QuantizedKV,
                 vq: QuantizedKV, scale: float) -> torch.Tensor:
    """Per query row [B, H]: the a-priori bound of the module docstring (over the whole
    pool, which only loosens it)."""
    dk = (dequantize_kv(kq.data, kq.scale) - k).abs().max()
    dv = (dequantize_kv(vq.data, vq.scale) - v).abs().max()
    delta = scale * q.abs().sum(-1) * dk
    return dv + torch.expm1(2 * delta) * v.abs().max()


LENS = [1, 16, 17, 300]


@pytest.mark.parametrize(("group", "dim"), [(1, 64), (4, 64), (3, 128), (2, 80)])
def test_int8_decode_equals_attention_over_the_dequantized_cache_and_is_within_the_bound(
    group: int, dim: int, threads: int
) -> None:
    kv_heads = 2
    q, k, v, tables, lens = _paged(LENS, kv_heads * group, kv_heads, dim, 16, seed=10)
    kq, vq = _quantized(k), _quantized(v)
    scale = dim**-0.5
    args = (tables, lens, scale, tuple(LENS))
    exact = TorchOps().paged_attention_decode(
        q, dequantize_kv(kq.data, kq.scale), dequantize_kv(vq.data, vq.scale), *args
    )
    for ops in (TorchOps(), CpuOps()):
        torch.testing.assert_close(ops.paged_attention_decode(q, kq, vq, *args), exact, **EXACT)
    fp32 = TorchOps().paged_attention_decode(q, k, v, *args)
    err = (CpuOps().paged_attention_decode(q, kq, vq, *args) - fp32).abs().amax(-1)
    assert bool((err <= _error_bound(q, k, v, kq, vq, scale)).all())
    # Typically well under one int8 step of the largest value (errors average out).
    assert err.mean() < v.abs().max() / 127


def test_int8_decode_with_bf16_queries_matches_the_reference() -> None:
    q, k, v, tables, lens = _paged(LENS, 8, 2, 64, 16, seed=20)
    kq, vq = _quantized(k), _quantized(v)
    args = (q.to(torch.bfloat16), kq, vq, tables, lens, 0.125, tuple(LENS))
    got = CpuOps().paged_attention_decode(*args)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, TorchOps().paged_attention_decode(*args), **BF16)


def test_an_fp8_cache_on_cpu_takes_the_reference_path_and_stays_within_its_bound() -> None:
    q, k, v, tables, lens = _paged(LENS, 4, 2, 64, 16, seed=25)
    kq, vq = _quantized(k, torch.float8_e4m3fn), _quantized(v, torch.float8_e4m3fn)
    args = (tables, lens, 0.125, tuple(LENS))
    got = CpuOps().paged_attention_decode(q, kq, vq, *args)
    exact = TorchOps().paged_attention_decode(
        q, dequantize_kv(kq.data, kq.scale), dequantize_kv(vq.data, vq.scale), *args
    )
    torch.testing.assert_close(got, exact, **EXACT)
    err = (got - TorchOps().paged_attention_decode(q, k, v, *args)).abs().amax(-1)
    assert bool((err <= _error_bound(q, k, v, kq, vq, 0.125)).all())


def test_int8_prefill_over_chunks_equals_attention_over_the_dequantized_cache() -> None:
    # A mixed step: decode rows (C kernel) and prefill chunks over a cached past (SDPA).
    heads, kv_heads, dim, bs = 4, 2, 64, 8
    qlens, slens = [1, 5, 1, 19], [12, 9, 30, 40]
    _, k, v, tables, _ = _paged(slens, heads, kv_heads, dim, bs, seed=30)
    kq, vq = _quantized(k), _quantized(v)
    query = _rand(sum(qlens), heads, dim, seed=31)
    starts = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(qlens), dtype=torch.int64),  # unused by attention
        query_start_loc=starts, seq_lens=torch.tensor(slens, dtype=torch.int32),
        block_tables=tables, max_query_len=max(qlens), max_seq_len=max(slens),
        query_lens_host=tuple(qlens), seq_lens_host=tuple(slens),
    )
    exact = TorchOps().paged_attention_prefill(
        query, dequantize_kv(kq.data, kq.scale), dequantize_kv(vq.data, vq.scale), meta, 0.125
    )
    for ops in (TorchOps(), CpuOps()):
        torch.testing.assert_close(ops.paged_attention_prefill(query, kq, vq, meta, 0.125), exact, **EXACT)
    fp32 = TorchOps().paged_attention_prefill(query, k, v, meta, 0.125)
    err = (CpuOps().paged_attention_prefill(query, kq, vq, meta, 0.125) - fp32).abs().amax(-1)
    assert bool((err <= _error_bound(query, k, v, kq, vq, 0.125)).all())


def test_a_block_id_outside_the_int8_cache_raises() -> None:
    q, k, v, tables, lens = _paged([20], 4, 2, 64, 16, seed=40)
    tables[0, 1] = k.shape[0]
    with pytest.raises(CpuKernelError, match="block"):
        CpuOps().paged_attention_decode(q, _quantized(k), _quantized(v), tables, lens, 0.125, (20,))


# --- pool sizing -------------------------------------------------------------------------


def _config(layers: int = 30, kv_heads: int = 3, dim: int = 64):
    import types

    # The fields pool sizing reads: the KV shape, and the query heads (a tensor-parallel
    # rank's share of the KV heads is computed beside its share of the query heads).
    return types.SimpleNamespace(
        num_hidden_layers=layers, num_attention_heads=3 * kv_heads, num_key_value_heads=kv_heads,
        head_dim=dim, max_position_embeddings=8192,
    )


def test_an_int8_pool_counts_codes_and_scales_and_holds_nearly_twice_the_bf16_tokens() -> None:
    cfg = _config()  # SmolLM2-135M's shape
    bf16 = bytes_per_block(cfg, torch.bfloat16, 16)
    int8 = bytes_per_block(cfg, torch.bfloat16, 16, kv_cache_dtype="int8")
    assert bf16 == 2 * 30 * 16 * 3 * 64 * 2
    assert int8 == 2 * 30 * 16 * 3 * (64 + 4)
    budget = 1000 * bf16
    blocks = num_kv_blocks(cfg, torch.bfloat16, 16, budget, "cpu", kv_cache_dtype="int8")
    assert blocks == budget // int8 and math.isclose(blocks / 1000, 128 / 68, rel_tol=1e-2)
    caches = allocate_kv_caches(cfg, 10, 16, torch.bfloat16, "cpu", kv_cache_dtype="int8")
    k, v = caches[0]
    assert isinstance(k, QuantizedKV) and k.data.dtype == torch.int8 and k.shape == (10, 16, 3, 64)
    assert k.scale.shape == (10, 16, 3) and not k.data.any() and not v.scale.any()
    actual = sum(t.data.numel() + 4 * t.scale.numel() for pair in caches for t in pair)
    assert actual == 10 * int8


# --- end to end ----------------------------------------------------------------------------


async def test_an_engine_with_an_int8_kv_cache_serves_batches_as_it_serves_one_and_close_to_fp32(
    tmp_path_factory,
) -> None:
    import trio
    from engine_helpers import collect, greedy, random_prompts, tiny_model, token_ids

    import engine

    model = tiny_model(tmp_path_factory)
    prompts = random_prompts(12, vocab=300, lo=3, hi=70, seed=5)
    options = dict(dtype="float32", block_size=16, max_num_batched_tokens=64, kv_cache_memory=4 * 2**20)
    results: dict[str, list[list[int]]] = {}
    totals: dict[str, int] = {}
    together: list[list[int]] = [[] for _ in prompts]

    async def one(eng: engine.Engine, i: int) -> None:
        together[i] = token_ids(await collect(eng, prompts[i], greedy(12)))

    for kv in ("auto", "int8"):
        async with engine.open_engine(str(model), kv_cache_dtype=kv, **options) as eng:
            results[kv] = [token_ids(await collect(eng, p, greedy(12))) for p in prompts]
            totals[kv] = eng.statistics().kv_blocks_total
            if kv == "int8":
                async with trio.open_nursery() as nursery:
                    for i in range(len(prompts)):
                        nursery.start_soon(one, eng, i)
    # The C kernel attends each request on its own: batching changes nothing.
    assert together == results["int8"]
    # fp32 K/V: 4 bytes a value; int8: 1 byte plus a 4-byte scale per head row.
    dim = 16  # the tiny model's head_dim
    assert math.isclose(totals["int8"] / totals["auto"], 4 * dim / (dim + 4), rel_tol=0.01)
    # Quantization noise may flip a near-tie late in a sequence, never the whole output.
    same = sum(a == b for x, y in zip(results["auto"], results["int8"], strict=True) for a, b in zip(x, y, strict=True))
    assert same >= 0.9 * 12 * len(prompts), (results["auto"], results["int8"])
    assert all(x[0] == y[0] for x, y in zip(results["auto"], results["int8"], strict=True))
