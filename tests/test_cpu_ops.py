"""The C kernels of the CPU path (``CpuOps``) against the torch reference.

Tolerances: fp32 differs from the reference by summation order only (~1e-6 relative on
O(1) values). bf16: the C RMSNorm and RoPE round where Hugging Face's bf16 modules round
(the product, then the weight product / the sum), the reference where torch's fused ops do,
so single elements differ by one bf16 step (2**-8 relative, 0.03 on values up to 8); the
attention keeps probabilities in fp32 where SDPA rounds them. A wrong slot, mask, head
group or position moves outputs by O(1), far past either tolerance.
"""

from __future__ import annotations

import pytest
import torch

from engine.ops import AttentionMetadata, get_ops
from engine.ops import cpu as cpu_ops
from engine.ops.cpu import CpuKernelError, CpuOps
from engine.ops.recurrent_reference import MambaDecodeSpec
from engine.ops.reference import TorchOps

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=4e-2, rtol=1e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def test_the_kernels_are_built_and_chosen_on_cpu() -> None:
    # make test installs the package, which compiles them; without this check every test
    # below could silently compare the reference with itself.
    assert cpu_ops.available()
    assert isinstance(get_ops("auto", "cpu"), CpuOps)
    assert type(get_ops("torch")) is TorchOps


def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


# --- RMSNorm ---------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576 crosses the parallel threshold
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_the_reference(dtype: torch.dtype, rows: int, threads: int) -> None:
    x, w = _rand(rows, 576, seed=0, dtype=dtype), _rand(576, seed=1, dtype=dtype)
    got = CpuOps().rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, TorchOps().rms_norm(x, w, 1e-5), **TOL[dtype])


def test_bf16_rms_norm_rounds_like_hugging_face() -> None:
    # HF's LlamaRMSNorm: weight * (x * rsqrt(mean(x^2) + eps)).to(bf16), two roundings.
    x, w = _rand(16, 576, seed=2, dtype=torch.bfloat16), _rand(576, seed=3, dtype=torch.bfloat16)
    xf = x.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    got = CpuOps().rms_norm(x, w, 1e-5)
    # Summation order of the mean may flip a rounding now and then, never more than one step.
    assert (got != want).float().mean() < 0.01
    torch.testing.assert_close(got, want, atol=0.07, rtol=2**-7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_leaves_the_sum_in_x(dtype: torch.dtype, threads: int) -> None:
    x, r, w = _rand(5, 64, seed=4, dtype=dtype), _rand(5, 64, seed=5, dtype=dtype), _rand(64, seed=6, dtype=dtype)
    want_normed, want_sum = TorchOps().fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6)
    xc = x.clone()
    normed, summed = CpuOps().fused_add_rms_norm(xc, r.clone(), w, 1e-6)
    assert summed.data_ptr() == xc.data_ptr()
    assert torch.equal(summed, want_sum)  # one rounded add: bitwise the reference's
    torch.testing.assert_close(normed, want_normed, **TOL[dtype])


def test_unsupported_inputs_take_the_reference_path() -> None:
    ops, ref = CpuOps(), TorchOps()
    x16, w16 = _rand(3, 32, seed=7, dtype=torch.float16), _rand(32, seed=8, dtype=torch.float16)
    assert torch.equal(ops.rms_norm(x16, w16, 1e-5), ref.rms_norm(x16, w16, 1e-5))
    # A strided view (Qwen3's per-head q norm over a fused qkv row) is not a plain array.
    qkv = _rand(4, 3 * 32, seed=9)
    view = qkv[:, :64].view(4, 2, 32)
    w = _rand(32, seed=10)
    assert torch.equal(ops.rms_norm(view, w, 1e-5), ref.rms_norm(view, w, 1e-5))


# --- SiLU-and-mul ---------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 3, 64])  # 64 x 1536 crosses the parallel threshold
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_the_reference(dtype: torch.dtype, rows: int, threads: int) -> None:
    # Gate values from -20 to 20: both sides of the sigmoid's branch, and its tails.
    x = torch.cat([torch.linspace(-20, 20, 1536).expand(rows, 1536), _rand(rows, 1536, seed=16)], -1)
    x = x.to(dtype).contiguous()
    got = CpuOps().silu_and_mul(x)
    assert got.shape == (rows, 1536)
    torch.testing.assert_close(got, TorchOps().silu_and_mul(x), **TOL[dtype])


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_matches_the_reference(dtype: torch.dtype, rows: int, threads: int) -> None:
    # Gemma's GeGLU: gate values from -20 to 20 cover the tanh's two tails and zero.
    x = torch.cat([torch.linspace(-20, 20, 1536).expand(rows, 1536), _rand(rows, 1536, seed=17)], -1)
    x = x.to(dtype).contiguous()
    got = CpuOps().gelu_tanh_and_mul(x)
    assert got.shape == (rows, 1536) and got.dtype == dtype
    torch.testing.assert_close(got, TorchOps().gelu_tanh_and_mul(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rms_norm_matches_transformers_arithmetic(dtype: torch.dtype, threads: int) -> None:
    """Gemma's norm as transformers' Gemma2RMSNorm computes it: fp32 throughout, times
    (1 + w) in fp32, one rounding; also over strided per-head views of a q/k/v row."""
    x, w = _rand(300, 576, seed=18, dtype=dtype), 1.0 + _rand(576, seed=19)
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w).to(dtype)
    got = CpuOps().gemma_rms_norm(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.bfloat16:  # the mean's summation order may flip a rounding, by one step
        assert (got != want).float().mean() < 0.01
    torch.testing.assert_close(got, want, **TOL[dtype])
    qkv = _rand(4, 3 * 32, seed=20, dtype=dtype)
    heads = qkv[:, :64].view(4, 2, 32)
    wh = 1.0 + _rand(32, seed=21)
    assert torch.equal(CpuOps().gemma_rms_norm(heads, wh, 1e-6), CpuOps().gemma_rms_norm(heads.contiguous(), wh, 1e-6))


# --- RoPE --------------------------------------------------------------------------------


def _cos_sin(max_pos: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), -1).to(dtype)


def _qkv_views(qkv: torch.Tensor, heads: int, kv_heads: int, dim: int):
    t = qkv.shape[0]
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    return q.view(t, heads, dim), k.view(t, kv_heads, dim)


@pytest.mark.parametrize("fused", [True, False], ids=["views-of-one-qkv", "separate"])
@pytest.mark.parametrize(("dim", "rot"), [(64, 64), (128, 128), (128, 96)])  # 96: Phi-4-mini's partial rotary
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_matches_the_reference(dtype: torch.dtype, dim: int, rot: int, fused: bool, threads: int) -> None:
    t, heads, kv_heads, max_pos = 6, 8, 2, 64
    positions = torch.tensor([0, 1, 15, 16, 40, 63])
    cache = _cos_sin(max_pos, rot, dtype)
    qkv = _rand(t, (heads + 2 * kv_heads) * dim, seed=11, dtype=dtype)
    results = []
    for ops in (CpuOps(), TorchOps()):
        if fused:
            row = qkv.clone()
            q, k = _qkv_views(row, heads, kv_heads, dim)
        else:
            q, k = _rand(t, heads, dim, seed=12, dtype=dtype), _rand(t, kv_heads, dim, seed=13, dtype=dtype)
        q2, k2 = ops.rotary_embedding(positions, q, k, cache)
        results.append((q2.clone(), k2.clone(), row.clone() if fused else None))
    (cq, ck, crow), (rq, rk, rrow) = results
    torch.testing.assert_close(cq, rq, **TOL[dtype])
    torch.testing.assert_close(ck, rk, **TOL[dtype])
    if fused:  # V, after q and k in each row, is untouched
        v_start = (heads + kv_heads) * dim
        assert torch.equal(crow[:, v_start:], qkv[:, v_start:])


def test_rope_position_past_the_cache_raises() -> None:
    cache = _cos_sin(16, 64, torch.float32)
    q, k = _rand(2, 4, 64, seed=14), _rand(2, 2, 64, seed=15)
    with pytest.raises(CpuKernelError, match="position"):
        CpuOps().rotary_embedding(torch.tensor([3, 16]), q, k, cache)


# --- paged decode attention --------------------------------------------------------------


def _paged_batch(lens: list[int], heads: int, kv_heads: int, dim: int, block_size: int,
                 dtype: torch.dtype, seed: int):
    """A cache whose blocks are handed out in a shuffled order, and tables over it."""
    per_req = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_req) + 3  # spare blocks nobody reads
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = torch.zeros(len(lens), max(per_req) + 1, dtype=torch.int32)  # padded width
    used = 0
    for b, n in enumerate(per_req):
        tables[b, :n] = torch.tensor(order[used : used + n], dtype=torch.int32)
        used += n
    k_cache = _rand(num_blocks, block_size, kv_heads, dim, seed=seed + 1, dtype=dtype)
    v_cache = _rand(num_blocks, block_size, kv_heads, dim, seed=seed + 2, dtype=dtype)
    q = _rand(len(lens), heads, dim, seed=seed + 3, dtype=dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


# One token; exactly one block; one past it; a long context over many 64-key tiles.
LENS = [1, 16, 17, 300]


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dim", [64, 128, 80])  # 80: the generic (not unrolled) loop
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_matches_the_reference(dtype: torch.dtype, dim: int, group: int, threads: int) -> None:
    kv_heads = 2
    q, kc, vc, tables, lens = _paged_batch(LENS, kv_heads * group, kv_heads, dim, 16, dtype, seed=20)
    args = (q, kc, vc, tables, lens, dim**-0.5, tuple(LENS))
    got = CpuOps().paged_attention_decode(*args)
    torch.testing.assert_close(got, TorchOps().paged_attention_decode(*args), **TOL[dtype])


@pytest.mark.parametrize(("heads", "dim"), [(40, 24), (16, 576), (20, 576)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_latent_attention_decode_matches_the_reference(dtype: torch.dtype, heads: int, dim: int, threads: int) -> None:
    """DeepSeek's cache: one KV head (the latent, up to 512 + 64 wide) read as both K and V
    by every query head; groups past the kernel's 16 heads an item are cut into pieces."""
    q, kc, _vc, tables, lens = _paged_batch(LENS, heads, 1, dim, 16, dtype, seed=27)
    args = (q, kc, kc, tables, lens, 0.1, tuple(LENS))
    got = CpuOps()._decode(*args[:6])
    assert got is not None  # the C kernel took it
    torch.testing.assert_close(got, TorchOps().paged_attention_decode(*args), **TOL[dtype])
    one = CpuOps()._decode(q[3:], kc, kc, tables[3:], lens[3:], 0.1)  # one stream: a head an item
    torch.testing.assert_close(one, got[3:], rtol=0, atol=0)


@pytest.mark.parametrize(("window", "softcap"), [(1, 0.0), (16, 0.0), (37, 0.0), (0, 3.0), (20, 3.0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sliding_window_and_softcap_decode_match_the_reference(
    dtype: torch.dtype, window: int, softcap: float
) -> None:
    # Windows of one key, exactly one block, and one not on a block edge, over contexts
    # shorter and far longer than each; Gemma 2's soft-cap alone and with a window.
    q, kc, vc, tables, lens = _paged_batch(LENS, 8, 2, 64, 16, dtype, seed=25)
    args = (q * 4, kc, vc, tables, lens, 64**-0.5, tuple(LENS))  # x4: scores the cap bends
    got = CpuOps().paged_attention_decode(*args, window=window, softcap=softcap)
    want = TorchOps().paged_attention_decode(*args, window=window, softcap=softcap)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert (got - CpuOps().paged_attention_decode(*args)).abs().max() > 1e-2


@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("dim", [64, 80])  # the AVX-512 item and the generic loop
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_sinks_decode_match_the_reference(dtype: torch.dtype, dim: int, window: int, threads: int) -> None:
    # gpt-oss's sinks: the softmax starts from one more logit a head (some above the
    # scores, some below), with and without a window.
    q, kc, vc, tables, lens = _paged_batch(LENS, 8, 2, dim, 16, dtype, seed=26)
    sinks = _rand(8, seed=27) * 3
    args = (q, kc, vc, tables, lens, dim**-0.5, tuple(LENS))
    got = CpuOps().paged_attention_decode(*args, window=window, sinks=sinks)
    want = TorchOps().paged_attention_decode(*args, window=window, sinks=sinks)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert (got.float() - CpuOps().paged_attention_decode(*args, window=window).float()).abs().max() > 1e-2


def test_a_query_view_with_row_stride_reads_the_right_rows() -> None:
    # As the model passes q: [B, H, D] rows of a wider fused qkv tensor.
    heads, kv_heads, dim = 4, 2, 64
    q, kc, vc, tables, lens = _paged_batch([5, 33], heads, kv_heads, dim, 8, torch.float32, seed=30)
    wide = torch.cat([q.reshape(2, -1), _rand(2, 2 * kv_heads * dim, seed=31)], -1)
    view = wide[:, : heads * dim].view(2, heads, dim)
    got = CpuOps().paged_attention_decode(view, kc, vc, tables, lens, 0.125, (5, 33))
    want = TorchOps().paged_attention_decode(q, kc, vc, tables, lens, 0.125, (5, 33))
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("dim", [64, 128, 80])
@pytest.mark.parametrize("dtype", DTYPES)
def test_results_do_not_depend_on_the_thread_count_or_the_batch(dtype: torch.dtype, dim: int) -> None:
    # Alone on one thread a row is attended one query head per work item (fewer than two
    # (row, KV head) pairs a thread); in the batch, one item per KV head. Bit for bit equal.
    q, kc, vc, tables, lens = _paged_batch(LENS, 8, 2, dim, 16, dtype, seed=40)
    ops = CpuOps()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = ops.paged_attention_decode(q, kc, vc, tables, lens, 0.125, tuple(LENS))
        torch.set_num_threads(1)
        alone = [
            ops.paged_attention_decode(q[b : b + 1], kc, vc, tables[b : b + 1], lens[b : b + 1], 0.125, (n,))
            for b, n in enumerate(LENS)
        ]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(together, torch.cat(alone))


def test_a_block_id_outside_the_cache_raises_instead_of_reading_it() -> None:
    q, kc, vc, tables, lens = _paged_batch([20], 4, 2, 64, 16, torch.float32, seed=50)
    tables[0, 1] = kc.shape[0]  # one past the last block
    with pytest.raises(CpuKernelError, match="block"):
        CpuOps().paged_attention_decode(q, kc, vc, tables, lens, 0.125, (20,))


def test_a_mixed_step_sends_its_one_token_rows_through_the_kernel() -> None:
    # Two prefill chunks and two decode rows interleaved, as the scheduler mixes them.
    heads, kv_heads, dim, bs = 4, 2, 64, 8
    qlens, slens = [1, 5, 1, 3], [12, 9, 30, 3]
    q_all, kc, vc, tables, _ = _paged_batch(slens, heads, kv_heads, dim, bs, torch.float32, seed=60)
    query = _rand(sum(qlens), heads, dim, seed=61)
    starts = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(qlens), dtype=torch.int64),  # unused by attention
        query_start_loc=starts,
        seq_lens=torch.tensor(slens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(qlens),
        max_seq_len=max(slens),
        query_lens_host=tuple(qlens),
        seq_lens_host=tuple(slens),
    )
    got = CpuOps().paged_attention_prefill(query, kc, vc, meta, 0.125)
    want = TorchOps().paged_attention_prefill(query, kc, vc, meta, 0.125)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    # The decode rows equal the kernel's own decode answer for those requests alone.
    for row, b in ((0, 0), (6, 2)):
        alone = CpuOps().paged_attention_decode(
            query[row : row + 1], kc, vc, tables[b : b + 1], meta.seq_lens[b : b + 1], 0.125, (slens[b],)
        )
        assert torch.equal(got[row : row + 1], alone)


# --- an encoder's attention (BERT) ----------------------------------------------------------

ENC_LENS = (25, 1, 16, 17, 300, 7)  # one row, whole vectors of 16 and one past, a long one


@pytest.mark.parametrize("heads,dim", [(12, 32), (4, 64), (3, 20)])  # 20: a head past whole vectors
@pytest.mark.parametrize("dtype", DTYPES)
def test_encoder_attention_matches_the_reference(dtype: torch.dtype, heads: int, dim: int, threads: int) -> None:
    qkv = _rand(sum(ENC_LENS), 3 * heads * dim, seed=60, dtype=dtype)
    got = CpuOps().encoder_attention(qkv, ENC_LENS, heads, dim)
    assert got.shape == (sum(ENC_LENS), heads * dim) and got.dtype == dtype
    torch.testing.assert_close(got, TorchOps().encoder_attention(qkv, ENC_LENS, heads, dim), **TOL[dtype])


def test_an_encoder_sequence_gets_the_same_rows_alone_as_in_its_batch() -> None:
    qkv = _rand(sum(ENC_LENS), 3 * 6 * 32, seed=61)
    ops = CpuOps()
    together = ops.encoder_attention(qkv, ENC_LENS, 6, 32)
    start = 0
    for n in ENC_LENS:
        alone = ops.encoder_attention(qkv[start:start + n].contiguous(), (n,), 6, 32)
        assert torch.equal(together[start:start + n], alone)
        start += n


def test_encoder_attention_refuses_lengths_that_do_not_cover_the_rows() -> None:
    qkv = _rand(10, 3 * 2 * 16, seed=62)
    with pytest.raises(ValueError, match="cover"):
        CpuOps().encoder_attention(qkv, (4, 5), 2, 16)
    with pytest.raises(ValueError, match="row"):
        CpuOps().encoder_attention(qkv, (10, 0), 2, 16)


def test_a_strided_qkv_takes_the_reference_path() -> None:
    wide = _rand(20, 4 * 2 * 16, seed=63)
    qkv = wide[:, : 3 * 2 * 16]  # rows 128 apart, 96 wide: not a plain array
    assert torch.equal(CpuOps().encoder_attention(qkv, (12, 8), 2, 16),
                       TorchOps().encoder_attention(qkv, (12, 8), 2, 16))


# --- greedy sampling ----------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [1, 5, 63, 64, 65, 49152])
def test_greedy_matches_the_reference_sampler(vocab: int, threads: int) -> None:
    logits = _rand(4, vocab, seed=60) * 6
    logits[0, vocab // 2] = logits.max() + 1  # a tie: the first index wins, as torch.argmax
    logits[0, vocab - 1] = logits[0, vocab // 2]
    if vocab > 3:
        logits[1, : vocab // 2] = float("-inf")
        logits[2, :] = logits[2, 1]  # a flat row
    zero = torch.zeros(4)
    ids, lps = CpuOps().greedy(logits)
    want_ids, want_lps = TorchOps().sample(logits, zero, torch.zeros(4, dtype=torch.int32), zero + 1, zero,
                                           torch.zeros(4, dtype=torch.int64))
    assert ids == want_ids.tolist()
    torch.testing.assert_close(torch.tensor(lps), want_lps, atol=1e-5, rtol=1e-6)
    # sample() takes the same pass for an all-greedy batch
    got_ids, got_lps = CpuOps().sample(logits, zero, torch.zeros(4, dtype=torch.int32), zero + 1, zero,
                                       torch.zeros(4, dtype=torch.int64))
    assert torch.equal(got_ids, want_ids) and torch.equal(got_lps, torch.tensor(lps))


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_greedy_declines_rows_it_cannot_sample(poison: float) -> None:
    logits = _rand(3, 100, seed=61)
    logits[1, 40] = poison
    assert CpuOps().greedy(logits) is None
    logits[1] = float("-inf")
    assert CpuOps().greedy(logits) is None
    assert CpuOps().greedy(logits.to(torch.bfloat16)) is None  # fp32 rows only


# --- small-batch dense matmul (quant.c; Linear and the fused decode step) -------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(7, 5), (16, 33), (100, 64), (203, 576)])  # row and column tails
def test_the_dense_kernel_matches_f_linear_and_not_its_batch(dtype: torch.dtype, n: int, k: int, threads: int) -> None:
    """``x @ w.T + b`` against fp32 F.linear, and every row the same bits at 1-10 rows (a
    row's tile changes with the batch: 8 x 1, 4 x 2-4 or single rows)."""
    from engine.models.layers.linear import Linear
    from engine.ops.cpu import qmatmul as cq

    w, b, x = _rand(n, k, seed=30, dtype=dtype), _rand(n, seed=31, dtype=dtype), _rand(10, k, seed=32, dtype=dtype)
    assert cq.dense_ok(w, b)
    for bias in (None, b):
        full = cq.dense_matmul(w, bias, x)
        want = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
        if dtype == torch.float32:
            torch.testing.assert_close(full, want, atol=1e-4, rtol=1e-5)
        else:  # one rounding of an fp32 sum: within a bf16 step of the exact value
            torch.testing.assert_close(full.float(), want, atol=1e-2, rtol=2**-7)
        for m in range(1, 11):
            assert torch.equal(cq.dense_matmul(w, bias, x[:m].contiguous()), full[:m])
        lin = Linear(w, bias, pack=False)
        assert lin.small_batch and torch.equal(lin(x[:3]), full[:3])


@pytest.mark.parametrize("rows", [3, 37, 300])  # the small-batch kernel, and oneDNN's packed path
def test_linear_gelu_and_residual_epilogues_match_torch(rows: int, threads: int) -> None:
    """``Linear.gelu`` and ``Linear.add`` (BERT's fused epilogues) against F.gelu and a
    plain add on fp32 F.linear, at row counts each path takes."""
    from engine.models.layers.linear import Linear

    w, b = _rand(96, 64, seed=40, dtype=torch.float32), _rand(96, seed=41, dtype=torch.float32)
    x, res = _rand(rows, 64, seed=42, dtype=torch.float32), _rand(rows, 96, seed=43, dtype=torch.float32)
    lin = Linear(w, b)
    want = torch.nn.functional.linear(x, w, b)
    torch.testing.assert_close(lin.gelu(x), torch.nn.functional.gelu(want), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lin.add(x, res), want + res, atol=1e-5, rtol=1e-5)


# --- Gated DeltaNet's decode step --------------------------------------------------------


@pytest.mark.parametrize("k_heads,v_heads", [(4, 4), (2, 4), (2, 8)])
@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
@pytest.mark.parametrize("n,dk,dv", [(1, 16, 16), (3, 64, 128), (2, 128, 64)])
def test_delta_rule_decode_matches_the_reference(k_heads: int, v_heads: int, tiled: bool, n: int, dk: int, dv: int,
                                                 threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The output and the state it leaves, for each value head's key head in either order
    (the C kernel's: the reference it would fall back to is taken away)."""
    state = _rand(n, v_heads, dk, dv, seed=70) * 0.3
    q = torch.nn.functional.normalize(_rand(n, k_heads, dk, seed=71), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(_rand(n, k_heads, dk, seed=72), dim=-1)
    v, g = _rand(n, v_heads, dv, seed=73), -torch.nn.functional.softplus(_rand(n, v_heads, seed=74))
    beta = torch.sigmoid(_rand(n, v_heads, seed=75))
    want_state, got_state = state.clone(), state.clone()
    want = TorchOps().delta_rule_decode(want_state, q, k, v, g, beta, tiled)
    monkeypatch.delattr(TorchOps, "delta_rule_decode")
    got = CpuOps().delta_rule_decode(got_state, q, k, v, g, beta, tiled)
    assert got.shape == (n, v_heads, dv)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    torch.testing.assert_close(got_state, want_state, **TOL[torch.float32])
    assert not torch.equal(got_state, state)  # it moved, in place


# --- Mamba-2's decode step --------------------------------------------------------------


@pytest.mark.parametrize("heads,groups", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("n,p,ds", [(1, 16, 16), (3, 64, 128), (2, 32, 64)])
def test_ssd_decode_matches_the_reference(heads: int, groups: int, n: int, p: int, ds: int, threads: int,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The output and the state it leaves, each head reading its group's B and C (the C
    kernel's: the reference it would fall back to is taken away)."""
    state = _rand(n, heads, p, ds, seed=80) * 0.3
    x, b, c = _rand(n, heads, p, seed=81), _rand(n, groups, ds, seed=82), _rand(n, groups, ds, seed=83)
    dt = torch.nn.functional.softplus(_rand(n, heads, seed=84))
    a, d = -torch.exp(_rand(heads, seed=85)), _rand(heads, seed=86)
    want_state, got_state = state.clone(), state.clone()
    want = TorchOps().ssd_decode(want_state, x, b, c, dt, a, d)
    monkeypatch.delattr(TorchOps, "ssd_decode")
    got = CpuOps().ssd_decode(got_state, x, b, c, dt, a, d)
    assert got.shape == (n, heads, p)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    torch.testing.assert_close(got_state, want_state, **TOL[torch.float32])
    assert not torch.equal(got_state, state)  # it moved, in place


# --- a Mamba-2 mixer's whole decode token, between its projections -----------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["gated-norm", "norm-then-gate-fp32-weight", "no-norm"])
@pytest.mark.parametrize("n,groups", [(1, 2), (3, 1)])
def test_mamba2_decode_matches_the_reference(dtype: torch.dtype, form: str, n: int, groups: int, threads: int,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Output, window and state against the torch reference (the torch convolution and
    state-space step, then the gated norm), in_proj's rows a column slice of a wider tensor,
    dt's clamp biting at both ends (the C kernel's: the reference is taken away)."""
    heads, p, ds, width = 4, 8, 16, 3
    d_inner, conv_dim = heads * p, heads * p + 2 * groups * ds
    spec = MambaDecodeSpec(d_inner=d_inner, n_groups=groups, d_state=ds, dt_min=0.05, dt_max=2.0, eps=1e-5,
                           gated_norm=form != "no-norm", norm_before_gate=form.startswith("norm-then"),
                           weight_fp32=form.startswith("norm-then"), norm_dtype=dtype)
    zx = (_rand(n, d_inner + conv_dim + heads + 40, seed=60) * 2).to(dtype)[:, 8:8 + d_inner + conv_dim + heads]
    conv = _rand(n, conv_dim, width, seed=61, dtype=dtype)
    state = _rand(n, heads, p, ds, seed=62) * 0.3
    weight, bias = _rand(conv_dim, width + 1, seed=63) * 0.5, _rand(conv_dim, seed=64)
    dt_bias, a, d = _rand(heads, seed=65), -torch.exp(_rand(heads, seed=66)), _rand(heads, seed=67)
    norm = _rand(d_inner, seed=68).to(dtype).float()  # (a model-dtype weight's values)
    args = (weight, bias, dt_bias, a, d, norm, spec)
    want_conv, want_state = conv.clone(), state.clone()
    want = TorchOps().mamba2_decode(zx, want_conv, want_state, *args)
    monkeypatch.delattr(TorchOps, "mamba2_decode")
    got_conv, got_state = conv.clone(), state.clone()
    got = CpuOps().mamba2_decode(zx, got_conv, got_state, *args)
    assert got.dtype == dtype and got.shape == (n, d_inner)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    torch.testing.assert_close(got_state, want_state, **TOL[torch.float32])
    assert torch.equal(got_conv, want_conv) and not torch.equal(got_state, state)


# --- Mamba-1's decode step ---------------------------------------------------------------


@pytest.mark.parametrize("n,channels,ds", [(1, 16, 16), (3, 96, 16), (2, 40, 8)])
def test_selective_decode_matches_the_reference(n: int, channels: int, ds: int, threads: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The output and the state it leaves, each channel decaying at rates of its own (the C
    kernel's: the reference it would fall back to is taken away)."""
    state = _rand(n, channels, ds, seed=70) * 0.3
    u, b, c = _rand(n, channels, seed=71), _rand(n, ds, seed=72), _rand(n, ds, seed=73)
    dt = torch.nn.functional.softplus(_rand(n, channels, seed=74))
    a, d = -torch.exp(_rand(channels, ds, seed=75)), _rand(channels, seed=76)
    want_state, got_state = state.clone(), state.clone()
    want = TorchOps().selective_decode(want_state, u, dt, a, b, c, d)
    monkeypatch.delattr(TorchOps, "selective_decode")
    got = CpuOps().selective_decode(got_state, u, dt, a, b, c, d)
    assert got.shape == (n, channels)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    torch.testing.assert_close(got_state, want_state, **TOL[torch.float32])
    assert not torch.equal(got_state, state)  # it moved, in place


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3])
def test_mamba1_decode_matches_the_reference(dtype: torch.dtype, n: int, threads: int,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A Mamba-1 mixer's token after its dt projection: output and state against the torch
    reference (its softplus, the selective step, the gate), B and C column slices of x_proj's
    output and z of in_proj's, as the mixer passes them (the reference is taken away)."""
    channels, ds, rank = 40, 16, 8
    state = _rand(n, channels, ds, seed=50) * 0.3
    u, dt_raw = _rand(n, channels, seed=51, dtype=dtype), (_rand(n, channels, seed=52) * 3).to(dtype)
    proj = _rand(n, rank + 2 * ds, seed=53, dtype=dtype)
    b, c = proj[:, rank:rank + ds], proj[:, rank + ds:]
    z = _rand(n, 2 * channels, seed=54, dtype=dtype)[:, channels:]
    dt_bias, a, d = _rand(channels, seed=55), -torch.exp(_rand(channels, ds, seed=56)), _rand(channels, seed=57)
    want_state, got_state = state.clone(), state.clone()
    want = TorchOps().mamba1_decode(want_state, u, dt_raw, dt_bias, a, b, c, d, z)
    monkeypatch.delattr(TorchOps, "mamba1_decode")
    got = CpuOps().mamba1_decode(got_state, u, dt_raw, dt_bias, a, b, c, d, z)
    assert got.dtype == dtype and got.shape == (n, channels)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    torch.testing.assert_close(got_state, want_state, **TOL[torch.float32])
    assert not torch.equal(got_state, state)


# --- a recurrent layer's causal convolution, one decode token -------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("width", [3, 5])  # (3: d_conv 4, the released models', its taps unrolled)
def test_conv_decode_matches_the_reference(dtype: torch.dtype, bias: bool, n: int, width: int, threads: int,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The output and the window it leaves, x a column slice of a wider projection (its rows
    strided), as a mixer passes it (the C kernel's: the reference it would fall back to is
    taken away)."""
    channels = 96
    conv = _rand(n, channels, width, seed=90, dtype=dtype)
    x = _rand(n, channels + 40, seed=91, dtype=dtype)[:, 8:8 + channels]
    weight = _rand(channels, width + 1, seed=92)
    b = _rand(channels, seed=93) if bias else None
    want_conv, got_conv = conv.clone(), conv.clone()
    want = TorchOps().conv_decode(want_conv, x, weight, b)
    monkeypatch.delattr(TorchOps, "conv_decode")
    got = CpuOps().conv_decode(got_conv, x, weight, b)
    assert got.dtype == torch.float32 and got.shape == (n, channels)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    assert torch.equal(got_conv, want_conv) and torch.equal(got_conv[:, :, -1], x)  # moved on by x, exactly
