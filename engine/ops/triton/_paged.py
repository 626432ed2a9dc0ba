"""The inner step shared by the decode and prefill attention kernels.

One call attends a tile of queries to ``BLOCK_N`` consecutive context tokens read through
the request's block table, and folds the result into the running online-softmax state
(``m`` the running max in log2 units, ``l`` the running sum, ``acc`` the unnormalised
output). Scores are never materialised beyond one [rows, BLOCK_N] tile.

Token ``t`` of a request lives at ``block_table[t // block_size]``, offset
``t % block_size``: the gather is per token, so any block size works, and the
``head_dim`` run of each token is contiguous, which keeps loads 16 bytes wide.

With ``QUANT`` the caches hold 8-bit codes (int8 or fp8 e4m3) and the scale arrays one
fp32 scale per token and KV head (``engine.ops.QuantizedKV``): a tile is dequantized in
registers (code * scale, then the query's dtype) right after its load, so the HBM traffic
is the codes' bytes plus 4 bytes a token-head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.base import QuantizedKV

LOG2E = 1.4426950408889634  # exp(x) == exp2(x * log2(e)); exp2 is the native instruction
# The same inside kernels: a compiled kernel reads only globals that are constexpr objects.
LOG2E_C: tl.constexpr = tl.constexpr(LOG2E)


@triton.jit
def paged_attend_tile(
    q, acc, m_i, l_i,
    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr,
    stride_kb, stride_ko, stride_kh, stride_sb, stride_so, kv_head,
    block_size, n0, key_end, q_pos, qk_scale_log2,
    d, d_mask, window, softcap,
    CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr, SLIDING: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    QUANT: tl.constexpr = False,
):
    toks = n0 + tl.arange(0, BLOCK_N)
    t_mask = toks < key_end
    blk = tl.load(block_table_ptr + toks // block_size, mask=t_mask, other=0).to(tl.int64)
    off = blk * stride_kb + (toks % block_size) * stride_ko + kv_head * stride_kh
    kv_mask = t_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if QUANT:
        s_off = blk * stride_sb + (toks % block_size) * stride_so + kv_head
        k_scale = tl.load(k_scale_ptr + s_off, mask=t_mask, other=0.0)
        k = (k.to(tl.float32) * k_scale[:, None]).to(q.dtype)
    if DOT_UPCAST:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
    if SOFTCAP:
        # Gemma 2: cap * tanh(x / cap) on the scaled score x (s is x * log2(e) here);
        # tanh(y) = 1 - 2 / (e^(2y) + 1), exact at both tails (the exp overflows to 1).
        y = s / (softcap * LOG2E_C)
        s = (1.0 - 2.0 / (tl.math.exp2(y * (2.0 * LOG2E_C)) + 1.0)) * (softcap * LOG2E_C)
    valid = t_mask[None, :]
    if CAUSAL:
        valid = valid & (toks[None, :] <= q_pos[:, None])
    if SLIDING:
        # transformers' sliding window: key j is visible from query i iff i - j < window.
        valid = valid & (toks[None, :] > q_pos[:, None] - window)
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with no valid key yet keeps m = -inf; subtracting 0 instead avoids inf - inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if QUANT:
        v_scale = tl.load(v_scale_ptr + s_off, mask=t_mask, other=0.0)
        v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
    if DOT_UPCAST:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


def dot_upcast(dtype, device) -> bool:
    """True where bf16 operands must go to fp32 before ``tl.dot``: the CPU interpreter of
    triton 3.9 returns garbage for bf16 dots (measured: errors of 1e10 on a 16x16 product).
    Never on GPU, where bf16 feeds the tensor cores directly."""
    return device.type == "cpu" and dtype == torch.bfloat16


def dot_precision(dtype) -> str:
    """fp32 caches get exact fp32 products (tf32 would cost ~3e-4 relative error and can
    flip greedy tokens against the reference); half types use the tensor cores anyway."""
    return "ieee" if dtype == torch.float32 else "tf32"


def cache_args(k_cache, v_cache):
    """``(k data, v data, k scales, v scales, scale block stride, scale offset stride,
    QUANT)`` for a kernel launch; a plain cache passes its own tensors as unused scales."""
    if isinstance(k_cache, QuantizedKV):
        if not isinstance(v_cache, QuantizedKV) or k_cache.scale.stride() != v_cache.scale.stride():
            raise ValueError("K and V caches must both be quantized, with one scale layout")
        if k_cache.scale.stride(-1) != 1:
            raise ValueError("KV scales need a unit stride over heads")
        return (k_cache.data, v_cache.data, k_cache.scale, v_cache.scale,
                k_cache.scale.stride(0), k_cache.scale.stride(1), True)
    return k_cache, v_cache, k_cache, v_cache, 0, 0, False

