"""The torch reference ops against naive dense computations written from their definitions.

The oracles work in float64 on un-paged tensors (attention: explicit causal mask over each
request's whole context, GQA by repeating K/V heads), so a paging, masking or head-grouping
mistake in the reference shows up as a numeric mismatch.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from engine.ops import AttentionMetadata
from engine.ops.reference import TorchOps

# fp32: the reference and the float64 oracle differ only by fp32 rounding of sums of a few
# hundred terms (~1e-6 relative); 1e-5 leaves room without hiding a wrong mask or slot.
# bf16: inputs and outputs carry 8 significant bits (relative step 2**-8 = 0.4%); values
# here are O(1), so 3e-2 is a few bf16 steps, far below the O(1) error of a real bug.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
DTYPES = [torch.float32, torch.bfloat16]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def ops() -> TorchOps:
    return TorchOps()


def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


# --- pointwise ops ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_definition(ops: TorchOps, dtype: torch.dtype) -> None:
    x, w = _rand(5, 64, seed=0, dtype=dtype), _rand(64, seed=1, dtype=dtype)
    xd = x.double()
    want = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    got = ops.rms_norm(x, w, 1e-5)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_returns_norm_and_sum(ops: TorchOps, dtype: torch.dtype) -> None:
    x, r, w = (_rand(3, 32, seed=s, dtype=dtype) if s < 2 else _rand(32, seed=s, dtype=dtype) for s in range(3))
    want_sum = x.double() + r.double()
    want = want_sum / torch.sqrt(want_sum.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    normed, summed = ops.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6)
    torch.testing.assert_close(summed.double(), want_sum, **TOL[dtype])
    torch.testing.assert_close(normed.double(), want, **TOL[dtype])


@pytest.mark.parametrize("rot", [16, 12], ids=["whole-head", "partial"])
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "views-of-one-qkv"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_rotates_each_half_pair(ops: TorchOps, dtype: torch.dtype, fused: bool, rot: int) -> None:
    """``rot`` < the head's 16 values: a partial rotary (Phi-4-mini's), the cache as wide
    as the rotated share, the rest of each head left as it was."""
    t, heads, kv_heads, dim, base = 6, 4, 2, 16, 10000.0
    positions = torch.tensor([0, 1, 7, 3, 31, 2])
    inv_freq = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    angles = torch.outer(torch.arange(32, dtype=torch.float64), inv_freq)
    cache = torch.cat((angles.cos(), angles.sin()), -1).to(dtype)
    q, k = _rand(t, heads, dim, seed=0, dtype=dtype), _rand(t, kv_heads, dim, seed=1, dtype=dtype)
    if fused:
        # As the model passes them: q and k are adjacent slices of each fused qkv row.
        v = _rand(t, kv_heads * dim, seed=2, dtype=dtype)
        qkv = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v), -1)
        q_in, k_in, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
        q_in, k_in = q_in.view(t, heads, dim), k_in.view(t, kv_heads, dim)
    else:
        q_in, k_in = q.clone(), k.clone()

    def oracle(x: torch.Tensor) -> torch.Tensor:
        # Element i and i + rot/2 form a 2-vector rotated by angle pos * inv_freq[i].
        x = x.double()
        a = angles[positions].unsqueeze(1)
        x1, x2, rest = x[..., : rot // 2], x[..., rot // 2 : rot], x[..., rot:]
        return torch.cat((x1 * a.cos() - x2 * a.sin(), x1 * a.sin() + x2 * a.cos(), rest), -1)

    got_q, got_k = ops.rotary_embedding(positions, q_in, k_in, cache)
    torch.testing.assert_close(got_q.double(), oracle(q), **TOL[dtype])
    torch.testing.assert_close(got_k.double(), oracle(k), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(ops: TorchOps, dtype: torch.dtype) -> None:
    x = _rand(4, 2 * 24, seed=3, dtype=dtype)
    a, b = x.double()[:, :24], x.double()[:, 24:]
    want = a / (1 + torch.exp(-a)) * b
    torch.testing.assert_close(ops.silu_and_mul(x).double(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul(ops: TorchOps, dtype: torch.dtype) -> None:
    x = _rand(4, 2 * 24, seed=4, dtype=dtype) * 3
    a, b = x.double()[:, :24], x.double()[:, 24:]
    want = 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3))) * b
    torch.testing.assert_close(ops.gelu_tanh_and_mul(x).double(), want, **TOL[dtype])


def test_write_kv_cache_touches_only_the_given_slots(ops: TorchOps) -> None:
    k_cache = torch.zeros(4, 4, 2, 8)
    v_cache = torch.zeros(4, 4, 2, 8)
    key, value = _rand(3, 2, 8, seed=0), _rand(3, 2, 8, seed=1)
    slots = torch.tensor([5, 0, 15])  # block 1 offset 1, block 0 offset 0, block 3 offset 3
    ops.write_kv_cache(key, value, k_cache, v_cache, slots)
    for i, (b, o) in enumerate([(1, 1), (0, 0), (3, 3)]):
        assert torch.equal(k_cache[b, o], key[i])
        assert torch.equal(v_cache[b, o], value[i])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3


# --- attention ----------------------------------------------------------------------------


def _paged_setup(
    seq_lens: list[int], heads: int, kv_heads: int, block_size: int, dtype: torch.dtype, seed: int
):
    """Random per-request K/V written into a cache through shuffled block tables."""
    dim = 16
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + 3  # spare blocks hold garbage the masks must ignore
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    k_cache = _rand(num_blocks, block_size, kv_heads, dim, seed=seed + 1, dtype=dtype)
    v_cache = _rand(num_blocks, block_size, kv_heads, dim, seed=seed + 2, dtype=dtype)
    width = max(need) + 1  # one padding column, as a runner with spare table width has
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    ks, vs = [], []
    for b, s in enumerate(seq_lens):
        blocks, perm = perm[: need[b]], perm[need[b] :]
        tables[b, : need[b]] = torch.tensor(blocks, dtype=torch.int32)
        k = _rand(s, kv_heads, dim, seed=seed + 10 + b, dtype=dtype)
        v = _rand(s, kv_heads, dim, seed=seed + 50 + b, dtype=dtype)
        slots = torch.tensor([blocks[i // block_size] * block_size + i % block_size for i in range(s)])
        k_cache.view(-1, kv_heads, dim)[slots] = k
        v_cache.view(-1, kv_heads, dim)[slots] = v
        ks.append(k)
        vs.append(v)
    return k_cache, v_cache, tables, ks, vs


def _dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0
) -> torch.Tensor:
    """q [n, H, D] at the last n positions of k/v [s, Hkv, D]; float64, explicit causal mask
    (and sliding window: position i sees j when i - j < window; Gemma 2's tanh soft-cap)."""
    n, heads, _ = q.shape
    s, kv_heads, _ = k.shape
    k = k.double().repeat_interleave(heads // kv_heads, dim=1)
    v = v.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    qpos = torch.arange(s - n, s).unsqueeze(1)
    mask = torch.arange(s).unsqueeze(0) <= qpos
    if window:
        mask &= qpos - torch.arange(s).unsqueeze(0) < window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


GQA = [(4, 4), (8, 2), (8, 1)]  # group sizes 1, 4 and 8


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_decode_matches_dense(
    ops: TorchOps, dtype: torch.dtype, heads: int, kv_heads: int, block_size: int
) -> None:
    # One token; a context ending exactly on a block boundary; one past it; several blocks.
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 2 * block_size]
    k_cache, v_cache, tables, ks, vs = _paged_setup(seq_lens, heads, kv_heads, block_size, dtype, 0)
    q = _rand(len(seq_lens), heads, 16, seed=99, dtype=dtype)
    scale = 1 / math.sqrt(16)
    got = ops.paged_attention_decode(
        q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), scale, tuple(seq_lens)
    )
    for b in range(len(seq_lens)):
        want = _dense_attention(q[b : b + 1], ks[b], vs[b], scale)[0]
        torch.testing.assert_close(got[b].double(), want, **TOL[dtype])


def _meta(query_lens: list[int], seq_lens: list[int], tables: torch.Tensor) -> AttentionMetadata:
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),  # unused by attention
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=tuple(query_lens),
        seq_lens_host=tuple(seq_lens),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
def test_paged_prefill_matches_dense(
    ops: TorchOps, dtype: torch.dtype, heads: int, kv_heads: int
) -> None:
    bs = 4
    # (new tokens, context) pairs: fresh prompts, chunks after a cached past (ending on and
    # just past block boundaries), and single-token rows mixed into the same batch.
    query_lens = [5, 1, 3, bs, 1, 2 * bs + 1]
    seq_lens = [5, 9, 2 * bs + 3, 2 * bs, bs, 2 * bs + 1]
    k_cache, v_cache, tables, ks, vs = _paged_setup(seq_lens, heads, kv_heads, bs, dtype, 7)
    q = _rand(sum(query_lens), heads, 16, seed=5, dtype=dtype)
    scale = 0.3
    got = ops.paged_attention_prefill(q, k_cache, v_cache, _meta(query_lens, seq_lens, tables), scale)
    start = 0
    for b, n in enumerate(query_lens):
        want = _dense_attention(q[start : start + n], ks[b], vs[b], scale)
        torch.testing.assert_close(got[start : start + n].double(), want, **TOL[dtype])
        start += n


# (window, softcap): a window shorter than a block, one spanning blocks, and Gemma 2's
# soft-cap with and without a window (a low cap of 2 so that tanh bends the scores).
WINDOWED = [(3, 0.0), (6, 0.0), (0, 2.0), (5, 2.0)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("window", "softcap"), WINDOWED)
def test_windowed_and_softcapped_attention_match_dense(
    ops: TorchOps, dtype: torch.dtype, window: int, softcap: float
) -> None:
    bs = 4
    # Fresh prompts longer than the window, a chunk whose window reaches into its cached
    # past, a decode row far past the window, and one shorter than it.
    query_lens = [11, 3, 1, 1, 2 * bs + 1]
    seq_lens = [11, 14, 23, 2, 2 * bs + 1]
    k_cache, v_cache, tables, ks, vs = _paged_setup(seq_lens, 8, 2, bs, dtype, 17)
    q = _rand(sum(query_lens), 8, 16, seed=6, dtype=dtype)
    scale = 0.7  # large enough that soft-capping at 2 changes the answer
    meta = _meta(query_lens, seq_lens, tables)
    got = ops.paged_attention_prefill(q, k_cache, v_cache, meta, scale, window=window, softcap=softcap)
    start = 0
    for b, n in enumerate(query_lens):
        want = _dense_attention(q[start : start + n], ks[b], vs[b], scale, window, softcap)
        torch.testing.assert_close(got[start : start + n].double(), want, **TOL[dtype])
        start += n
    rows = torch.tensor([sum(query_lens[: b + 1]) - 1 for b in range(len(query_lens))])
    dec = ops.paged_attention_decode(
        q[rows], k_cache, v_cache, tables, meta.seq_lens, scale, meta.seq_lens_host,
        window=window, softcap=softcap,
    )
    torch.testing.assert_close(dec, got[rows], **TOL[dtype])
    # The window or the cap really changed something: the plain answer differs.
    plain = ops.paged_attention_prefill(q, k_cache, v_cache, meta, scale)
    assert (plain - got).abs().max() > 1e-2


def test_prefill_with_only_single_tokens_equals_decode(ops: TorchOps) -> None:
    seq_lens = [1, 4, 5, 11]
    k_cache, v_cache, tables, _, _ = _paged_setup(seq_lens, 8, 2, 4, torch.float32, 3)
    q = _rand(4, 8, 16, seed=1)
    meta = _meta([1] * 4, seq_lens, tables)
    pre = ops.paged_attention_prefill(q, k_cache, v_cache, meta, 0.25)
    dec = ops.paged_attention_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.25, meta.seq_lens_host)
    torch.testing.assert_close(pre, dec)


def test_step_plans_are_not_reused_across_new_metadata(ops: TorchOps) -> None:
    """Regression guard for the per-step memo: same shapes, new tables, must re-plan."""
    seq_lens = [6, 6]
    k_cache, v_cache, tables, ks, vs = _paged_setup(seq_lens, 4, 2, 4, torch.float32, 11)
    q = _rand(2, 4, 16, seed=2)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    first = ops.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.25, (6, 6))
    swapped = tables.flip(0).contiguous()  # request 0 now reads request 1's blocks
    second = ops.paged_attention_decode(q, k_cache, v_cache, swapped, lens, 0.25, (6, 6))
    torch.testing.assert_close(first[0].double(), _dense_attention(q[:1], ks[0], vs[0], 0.25)[0], **TOL[torch.float32])
    torch.testing.assert_close(second[0].double(), _dense_attention(q[:1], ks[1], vs[1], 0.25)[0], **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_agrees_with_f_linear_at_every_batch_size(dtype: torch.dtype, bias: bool) -> None:
    from engine.models.layers.linear import Linear

    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if bias else None
    lin = Linear(w, b)
    for rows in (1, 5, 32, 77):
        x = torch.randn(rows, 64, generator=g).to(dtype)
        if dtype == torch.float32:
            # oneDNN and MKL sum in different orders: equal up to fp32 rounding of 64 terms.
            torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(lin(x), F.linear(x, w, b)), rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 5])
def test_attention_sinks_match_transformers_gpt_oss(ops: TorchOps, dtype: torch.dtype, window: int) -> None:
    """gpt-oss's attention sinks (one more logit a head, with no value), against
    transformers' own eager attention of that model over each request's dense K/V, in
    prefill (chunks after a cached past) and decode; with and without a sliding window."""
    bs, heads, kv_heads = 4, 8, 2
    query_lens = [7, 3, 1, 2 * bs + 1]
    seq_lens = [7, 12, 19, 2 * bs + 1]
    k_cache, v_cache, tables, ks, vs = _paged_setup(seq_lens, heads, kv_heads, bs, dtype, 23)
    q = _rand(sum(query_lens), heads, 16, seed=8, dtype=dtype)
    sinks = _rand(heads, seed=9) * 2  # some above the scores, some below
    scale = 0.4
    meta = _meta(query_lens, seq_lens, tables)
    got = ops.paged_attention_prefill(q, k_cache, v_cache, meta, scale, window=window, sinks=sinks)
    module = SimpleNamespace(sinks=sinks.double(), num_key_value_groups=heads // kv_heads, training=False)
    start = 0
    for b, n in enumerate(query_lens):
        s = seq_lens[b]
        qpos = torch.arange(s - n, s).unsqueeze(1)
        kpos = torch.arange(s).unsqueeze(0)
        visible = (kpos <= qpos) & ((qpos - kpos < window) if window else True)
        mask = torch.zeros(n, s, dtype=torch.float64).masked_fill(~visible, float("-inf"))
        want, _ = eager_attention_forward(
            module, q[start : start + n].double().transpose(0, 1)[None], ks[b].double().transpose(0, 1)[None],
            vs[b].double().transpose(0, 1)[None], mask[None, None], scale)
        torch.testing.assert_close(got[start : start + n].double(), want[0], **TOL[dtype])
        start += n
    rows = torch.tensor([sum(query_lens[: b + 1]) - 1 for b in range(len(query_lens))])
    dec = ops.paged_attention_decode(q[rows], k_cache, v_cache, tables, meta.seq_lens, scale,
                                     meta.seq_lens_host, window=window, sinks=sinks)
    torch.testing.assert_close(dec, got[rows], **TOL[dtype])
    plain = ops.paged_attention_prefill(q, k_cache, v_cache, meta, scale, window=window)
    assert (plain - got).abs().max() > 1e-2  # the sinks changed the answer
