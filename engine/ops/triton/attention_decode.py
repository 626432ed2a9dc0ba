"""Paged decode attention, flash-decoding style: split the context, then reduce.

Grid ``(B, num_kv_heads, num_splits)``. Each program takes one request, one KV head and
one slice of the context, and attends all ``group = num_heads // num_kv_heads`` query
heads of that KV head at once (GQA/MQA: K/V are read once per group, and the group, padded
to 16 rows, is the M side of a tensor-core dot)::

    context of request b:  |---- split 0 ----|---- split 1 ----|-- split 2 --|
                              (m, l, acc)        (m, l, acc)      (m, l, acc)
                                    \\               |               /
                                     reduce: m* = max m, out = sum(acc 2^(m-m*)) / sum(l 2^(m-m*))

With one split (short contexts, or a batch already large enough to fill the GPU) the
kernel normalises and writes the output itself and no reduce is launched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.base import KVCache
from engine.ops.triton._paged import (
    LOG2E,
    LOG2E_C,
    cache_args,
    dot_precision,
    dot_upcast,
    paged_attend_tile,
)

BLOCK_N = 64  # context tokens per tile: 16 KB of fp16 K at head_dim 128
MIN_PARTITION = 256  # tokens per split at least, so a split's work outweighs its reduce share
PROGRAMS_PER_SM = 4  # enough resident programs per SM to keep HBM requests in flight
_CPU_SMS = 1  # the interpreter has no SMs; one keeps the CPU heuristic minimal


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_acc_ptr, part_ml_ptr, sinks_ptr,
    qk_scale_log2,
    stride_qb, stride_qh, stride_kb, stride_ko, stride_kh, stride_sb, stride_so, stride_bt,
    stride_ob, stride_oh,
    block_size, head_dim, partition_size, num_splits, window, softcap,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, SINGLE_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
    QUANT: tl.constexpr, SINKS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    # A sliding window sees the last `window` keys only; the splits share those out.
    start = split * partition_size
    if SLIDING:
        start += tl.maximum(seq_len - window, 0)
    end = tl.minimum(start + partition_size, seq_len)

    g = tl.arange(0, BLOCK_G)
    g_mask = g < GROUP
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    if SINKS and SINGLE_SPLIT:
        # gpt-oss's attention sink, one more logit with no value: the online softmax
        # starts from it (with splits, the reduce adds it once instead).
        m_i = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * LOG2E_C
        l_i += 1.0
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    q_pos = tl.zeros([BLOCK_G], dtype=tl.int32)  # unused: decode is never causal-masked
    for n0 in range(start, end, BLOCK_N):
        acc, m_i, l_i = paged_attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
            block_tables_ptr + b * stride_bt,
            stride_kb, stride_ko, stride_kh, stride_sb, stride_so, kv_head, block_size, n0, end,
            q_pos, qk_scale_log2, d, d_mask, window, softcap,
            CAUSAL=False, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION, DOT_UPCAST=DOT_UPCAST,
            SOFTCAP=SOFTCAP, QUANT=QUANT,
        )

    if SINGLE_SPLIT:
        # An empty context (a padding row) gives zeros rather than 0/0.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # Partials are [B, H, splits, D] and [B, H, splits, 2] (m, l), all fp32.
        row = (b * (tl.num_programs(1) * GROUP) + heads) * num_splits + split
        tl.store(part_acc_ptr + row[:, None] * BLOCK_D + d[None, :], acc, mask=q_mask)
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, sinks_ptr,
    stride_ob, stride_oh, num_heads, head_dim, num_splits,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, SINKS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_mask = s < num_splits
    d = tl.arange(0, BLOCK_D)
    row = (b * num_heads + h) * num_splits + s
    m = tl.load(part_ml_ptr + row * 2, mask=s_mask, other=float("-inf"))
    l_part = tl.load(part_ml_ptr + row * 2 + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    if SINKS:  # the sink's logit, counted once over the splits (see the split kernel)
        sink = tl.load(sinks_ptr + h).to(tl.float32) * LOG2E_C
        m_max = tl.maximum(m_max, sink)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_max)  # an empty split has m = -inf and weighs 0
    l_tot = tl.sum(l_part * w, axis=0)
    if SINKS:
        l_tot += tl.math.exp2(sink - m_max)
    acc = tl.load(part_acc_ptr + row[:, None] * BLOCK_D + d[None, :], mask=s_mask[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(l_tot > 0, l_tot, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < head_dim)


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Splits per request so that ``batch * kv_heads * splits`` programs fill the device,
    while each split keeps at least ``MIN_PARTITION`` tokens of work."""
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else _CPU_SMS
    )
    wanted = triton.cdiv(PROGRAMS_PER_SM * sms, max(batch * num_kv_heads, 1))
    return max(1, min(wanted, triton.cdiv(max_seq_len, MIN_PARTITION)))


def paged_attention_decode(
    query: torch.Tensor,
    k_cache: KVCache,
    v_cache: KVCache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    seq_lens_host: tuple[int, ...],
    num_splits: int | None = None,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per request attends its whole paged context; returns [B, H, D].

    ``num_splits`` overrides the split heuristic (tests use it to force the reduce path).
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(query)
    if batch == 0:
        return out
    k_cache, v_cache, k_scale, v_scale, stride_sb, stride_so, quant = cache_args(k_cache, v_cache)
    if query.stride(-1) != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("paged_attention_decode needs unit head_dim strides and one K/V layout")
    group = num_heads // num_kv_heads
    # Keys any request reads: its window at most.
    max_seq = min(max(seq_lens_host), window) if window > 0 else max(seq_lens_host)
    splits = num_splits or choose_num_splits(batch, num_kv_heads, max_seq, query.device)
    # Partition length: a whole number of tiles, so only a split's last tile is ragged.
    partition = triton.cdiv(triton.cdiv(max(max_seq, 1), splits), BLOCK_N) * BLOCK_N
    splits = max(1, triton.cdiv(max_seq, partition))
    block_d = triton.next_power_of_2(max(head_dim, 16))  # tl.dot needs K >= 16
    single = splits == 1
    if single:
        part_acc = part_ml = out  # unused
    else:
        part_acc = torch.empty((batch, num_heads, splits, block_d), dtype=torch.float32, device=query.device)
        part_ml = torch.empty((batch, num_heads, splits, 2), dtype=torch.float32, device=query.device)
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        query, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, out, part_acc, part_ml,
        out if sinks is None else sinks, scale * LOG2E,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), stride_sb, stride_so,
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        k_cache.shape[1], head_dim, partition, splits, window, softcap,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),  # dot needs M >= 16
        BLOCK_D=block_d, BLOCK_N=BLOCK_N, SINGLE_SPLIT=single,
        DOT_PRECISION=dot_precision(query.dtype), DOT_UPCAST=dot_upcast(query.dtype, query.device),
        SLIDING=window > 0, SOFTCAP=softcap > 0, QUANT=quant, SINKS=sinks is not None,
        num_warps=4, num_stages=3,  # memory bound: 3 stages keep two tiles' loads in flight
    )
    if not single:
        _decode_reduce_kernel[(batch, num_heads)](
            part_acc, part_ml, out, out if sinks is None else sinks, out.stride(0), out.stride(1), num_heads,
            head_dim, splits, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d, SINKS=sinks is not None,
            num_warps=4,
        )
    return out
