"""KV-cache write: scatter each new token's K/V into its slot of the paged block pool.

Layout (see ``engine/ops/__init__.py``)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

    slot s = block_id * block_size + offset   ->   k_cache[block_id, offset] : [Hkv, D]

      key [T, Hkv, D]            slot_mapping [T]           k_cache (block_size 4)
    +---------------+              +---+            block 0 +--+--+--+--+
    | token 0       | ---------->  | 5 | ---------> block 1 |  |t0|  |  |
    | token 1       | ---------->  | 2 | ---------> block 0 |  |  |t1|  |
    +---------------+              +---+                    +--+--+--+--+

One program copies one token's whole [Hkv, D] row for K and for V: a contiguous
``Hkv * D`` run in the cache, so stores are fully coalesced. A negative slot (a padding
token) is skipped.

A quantized cache (``engine.ops.QuantizedKV``) gets each head row of a token as 8-bit
codes and one fp32 scale, computed in registers as the torch reference's ``quantize_kv``
does (scale = max|row| / code_max, code = x / scale, int8 rounded half to even).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.base import KV_CODE_MAX, KVCache, QuantizedKV

ROUND_MAGIC: tl.constexpr = tl.constexpr(12582912.0)  # 1.5 * 2**23


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    n_tokens, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cache_block, stride_cache_off, stride_cache_head,
    block_size, n_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, TOKS: tl.constexpr,
):
    # [TOKS, heads, head_dim] tiles: TOKS tokens a program (one on a GPU); a slot < 0 (a
    # padded row) is written nowhere.
    tok = (tl.program_id(0) * TOKS + tl.arange(0, TOKS)).to(tl.int64)
    slot = tl.load(slot_ptr + tok, mask=tok < n_tokens, other=-1).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[None, :, None]
    d = tl.arange(0, BLOCK_D)[None, None, :]
    mask = (slot >= 0)[:, None, None] & (h < n_heads) & (d < head_dim)
    dst = (
        (slot // block_size)[:, None, None] * stride_cache_block
        + (slot % block_size)[:, None, None] * stride_cache_off
        + h * stride_cache_head
        + d
    )
    t = tok[:, None, None]
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_rows(x, mask, CODE_MAX: tl.constexpr, INT8: tl.constexpr):
    """[H, D] rows -> (int8 codes as fp32 values, or fp8 codes as bytes; [H] scales)."""
    x = tl.where(mask, x.to(tl.float32), 0.0)
    # IEEE divisions (div_rn), as torch's: a GPU's plain `/` is approximate (2 ulp), which
    # moves a code across a rounding tie (common with bf16 inputs) away from the reference.
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(amax, tl.zeros_like(amax) + CODE_MAX)
    # An all-zero row (or a padded head) has scale 0 and x == 0: dividing by 1 keeps it 0
    # without computing 0/0.
    y = tl.math.div_rn(x, tl.zeros_like(x) + tl.where(scale > 0, scale, 1.0)[:, None])
    if INT8:
        # Round half to even as torch.round: adding and subtracting 1.5 * 2**23 leaves no
        # fraction bits for |y| < 2**22, and fp32 addition rounds to nearest even (the
        # interpreter has no libdevice.rint; IEEE adds are never reassociated).
        y = (y + ROUND_MAGIC) - ROUND_MAGIC
        y = tl.minimum(tl.maximum(y, -CODE_MAX), CODE_MAX)
    else:
        y = _e4m3_bits(y)
    return y, scale


@triton.jit
def _e4m3_bits(y):
    """float8_e4m3fn bytes of fp32 values with |y| <= 448, rounded to nearest even.

    Spelled in integer ops rather than a cast: Triton 3.9's interpreter casts fp32 to fp8
    wrongly for some values (measured 124 -> 64, 150 -> 176), so the tests could not check
    the codes; the same bits come out on the GPU and in the interpreter. Normal range
    (|y| >= 2**-6): round the fp32 mantissa to 3 bits, rebias the exponent (127 -> 7).
    Below it, subnormal codes 0..7 count steps of 2**-9 (and 8, the carry, is 2**-6).
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    rounded = (mag + 0x7FFFF + ((mag >> 20) & 1)) & ~0xFFFFF
    normal = (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)
    small = ((tl.abs(y) * 512.0 + ROUND_MAGIC) - ROUND_MAGIC).to(tl.int32)
    code = tl.where(tl.abs(y) >= 0.015625, normal, small)
    return (sign | code).to(tl.uint8)


@triton.jit
def _write_kv_quant_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cache_block, stride_cache_off, stride_cache_head, stride_sb, stride_so,
    block_size, n_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, CODE_MAX: tl.constexpr, INT8: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        h_mask = h < n_heads
        mask = h_mask[:, None] & (d[None, :] < head_dim)
        blk, off = slot // block_size, slot % block_size
        dst = blk * stride_cache_block + off * stride_cache_off + h[:, None] * stride_cache_head + d[None, :]
        s_dst = blk * stride_sb + off * stride_so + h
        k = tl.load(k_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        codes, scale = _quantize_rows(k, mask, CODE_MAX, INT8)
        tl.store(k_cache_ptr + dst, codes.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(k_scale_ptr + s_dst, scale, mask=h_mask)
        v = tl.load(v_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        codes, scale = _quantize_rows(v, mask, CODE_MAX, INT8)
        tl.store(v_cache_ptr + dst, codes.to(v_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_scale_ptr + s_dst, scale, mask=h_mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: KVCache,
    v_cache: KVCache,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` [T, Hkv, D] (strided views allowed) at ``slot_mapping`` [T]."""
    n_tokens, n_heads, head_dim = key.shape
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("write_kv_cache needs a unit stride over head_dim")
    if isinstance(k_cache, QuantizedKV) or isinstance(v_cache, QuantizedKV):
        _write_quantized(key, value, k_cache, v_cache, slot_mapping)
        return
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share one layout with unit head_dim stride")
    if n_tokens == 0:
        return
    # One token a program on a GPU; in the CPU interpreter (programs run one by one at a
    # fixed cost each) up to 64 as one block.
    toks = 1 if key.is_cuda else min(triton.next_power_of_2(n_tokens), 64)
    _write_kv_kernel[(triton.cdiv(n_tokens, toks),)](
        key, value, k_cache, v_cache, slot_mapping,
        n_tokens, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], n_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(n_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), TOKS=toks,
        num_warps=2,  # a few KB per token; many small programs fill the GPU
    )


def _write_quantized(
    key: torch.Tensor, value: torch.Tensor, k_cache: KVCache, v_cache: KVCache, slot_mapping: torch.Tensor
) -> None:
    if not (isinstance(k_cache, QuantizedKV) and isinstance(v_cache, QuantizedKV)):
        raise ValueError("K and V caches must both be quantized or both plain")
    kd, vd = k_cache.data, v_cache.data
    int8 = kd.dtype == torch.int8
    code_max = KV_CODE_MAX[kd.dtype]
    if not int8:  # fp8 codes are written as their bytes (see _e4m3_bits)
        kd, vd = kd.view(torch.uint8), vd.view(torch.uint8)
    if kd.stride() != vd.stride() or kd.stride(-1) != 1 or kd.dtype != vd.dtype:
        raise ValueError("k_cache and v_cache must share one layout with unit head_dim stride")
    if k_cache.scale.stride() != v_cache.scale.stride() or k_cache.scale.stride(-1) != 1:
        raise ValueError("K and V scales must share one layout with unit head stride")
    n_tokens, n_heads, head_dim = key.shape
    if n_tokens == 0:
        return
    _write_kv_quant_kernel[(n_tokens,)](
        key, value, kd, vd, k_cache.scale, v_cache.scale, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kd.stride(0), kd.stride(1), kd.stride(2), k_cache.scale.stride(0), k_cache.scale.stride(1),
        kd.shape[1], n_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(n_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        CODE_MAX=code_max, INT8=int8,
        num_warps=2,
    )
