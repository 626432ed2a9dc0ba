"""Varlen prefill attention over paged KV: online softmax, no score matrix.

Grid ``(cdiv(max_query_len, BLOCK_M), B, num_heads)``. Request ``b`` has ``q_len`` new
tokens at the end of its ``seq_len`` tokens of context; its first ``ctx = seq_len - q_len``
tokens (an earlier chunk or a prefix-cache hit) are already in the cache, and this step's
K/V have been written there too before the call. A program takes ``BLOCK_M`` of the new
queries and walks the keys in two phases::

    keys:  0 ............................ ctx+m0 ........ ctx+m0+BLOCK_M
           |<-- phase 1: every key is -->|<-- phase 2: causal mask -->|
           |    before every query       |   key_pos <= query_pos     |

so the causal mask is only evaluated on the diagonal tiles. Programs whose query tile lies
past ``q_len`` (shorter requests in a mixed batch) return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.base import AttentionMetadata, KVCache
from engine.ops.triton._paged import (
    LOG2E,
    LOG2E_C,
    cache_args,
    dot_precision,
    dot_upcast,
    paged_attend_tile,
)

# Query rows x key columns per tile. 64 x 64 keeps the interpreter and small GPUs happy;
# on sm_80+ with head_dim <= 128 a 128-row query tile doubles the reuse of each K/V tile.
BLOCK_M_SMALL, BLOCK_M_LARGE = 64, 128
BLOCK_N = 64


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr,
    query_start_ptr, out_ptr, sinks_ptr,
    qk_scale_log2,
    stride_qt, stride_qh, stride_kb, stride_ko, stride_kh, stride_sb, stride_so, stride_bt,
    stride_ot, stride_oh,
    block_size, head_dim, window, softcap,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr, QUANT: tl.constexpr, SINKS: tl.constexpr,
):
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    m0 = tile * BLOCK_M
    if m0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len
    kv_head = head // GROUP

    rows = m0 + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    tok = (q_start + rows).to(tl.int64)
    q_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head * stride_qh + d[None, :], mask=q_mask, other=0.0)
    q_pos = ctx + rows

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SINKS:
        # gpt-oss's attention sink: one more logit with no value. The online softmax starts
        # from it (its max in log2 units, exp2(0) = 1 in the sum, nothing in acc).
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(sinks_ptr + head).to(tl.float32) * LOG2E_C
        l_i += 1.0
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + b * stride_bt
    diag = ctx + m0  # the first key that some query of this tile must not see
    # With a sliding window, keys before the tile's first query's window are skipped; the
    # window mask then trims what the tile's later queries no longer see.
    lo = 0
    if SLIDING:
        lo = tl.maximum(diag - window + 1, 0)
    for n0 in range(lo, diag, BLOCK_N):
        acc, m_i, l_i = paged_attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table,
            stride_kb, stride_ko, stride_kh, stride_sb, stride_so, kv_head, block_size, n0, diag,
            q_pos, qk_scale_log2, d, d_mask, window, softcap,
            CAUSAL=False, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION, DOT_UPCAST=DOT_UPCAST,
            SLIDING=SLIDING, SOFTCAP=SOFTCAP, QUANT=QUANT,
        )
    diag_end = tl.minimum(diag + BLOCK_M, seq_len)
    for n0 in range(diag, diag_end, BLOCK_N):
        acc, m_i, l_i = paged_attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table,
            stride_kb, stride_ko, stride_kh, stride_sb, stride_so, kv_head, block_size, n0,
            diag_end, q_pos, qk_scale_log2, d, d_mask, window, softcap,
            CAUSAL=True, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION, DOT_UPCAST=DOT_UPCAST,
            SLIDING=SLIDING, SOFTCAP=SOFTCAP, QUANT=QUANT,
        )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + tok[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _block_m(device: torch.device, head_dim: int) -> int:
    if device.type == "cuda" and head_dim <= 128 and torch.cuda.get_device_capability(device)[0] >= 8:
        return BLOCK_M_LARGE
    return BLOCK_M_SMALL


def paged_attention_prefill(
    query: torch.Tensor,
    k_cache: KVCache,
    v_cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
    block_m: int | None = None,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal varlen attention of ``query`` [T, H, D] over the paged cache; returns [T, H, D].

    ``block_m`` overrides the query tile (tests use a small one to cross tile edges).
    """
    n_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(query)
    batch = meta.query_start_loc.shape[0] - 1
    if n_tokens == 0 or batch == 0:
        return out
    k_cache, v_cache, k_scale, v_scale, stride_sb, stride_so, quant = cache_args(k_cache, v_cache)
    if query.stride(-1) != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("paged_attention_prefill needs unit head_dim strides and one K/V layout")
    bm = block_m or _block_m(query.device, head_dim)
    block_d = triton.next_power_of_2(max(head_dim, 16))  # tl.dot needs K >= 16
    grid = (triton.cdiv(meta.max_query_len, bm), batch, num_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, k_scale, v_scale, meta.block_tables, meta.seq_lens,
        meta.query_start_loc, out, out if sinks is None else sinks,
        scale * LOG2E,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), stride_sb, stride_so,
        meta.block_tables.stride(0),
        out.stride(0), out.stride(1),
        k_cache.shape[1], head_dim, window, softcap,
        GROUP=num_heads // num_kv_heads, BLOCK_M=bm, BLOCK_N=min(BLOCK_N, bm), BLOCK_D=block_d,
        DOT_PRECISION=dot_precision(query.dtype), DOT_UPCAST=dot_upcast(query.dtype, query.device),
        SLIDING=window > 0, SOFTCAP=softcap > 0, QUANT=quant, SINKS=sinks is not None,
        # 8 warps for the 128-row tile (two warpgroups of MMA), 4 for 64 rows.
        num_warps=8 if bm >= 128 else 4, num_stages=3,
    )
    return out
