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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cache_block, stride_cache_off, stride_cache_head,
    block_size, n_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < n_heads) & (d[None, :] < head_dim)
        dst = (
            (slot // block_size) * stride_cache_block
            + (slot % block_size) * stride_cache_off
            + h[:, None] * stride_cache_head
            + d[None, :]
        )
        k = tl.load(k_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        v = tl.load(v_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` [T, Hkv, D] (strided views allowed) at ``slot_mapping`` [T]."""
    n_tokens, n_heads, head_dim = key.shape
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("write_kv_cache needs a unit stride over head_dim")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share one layout with unit head_dim stride")
    if n_tokens == 0:
        return
    _write_kv_kernel[(n_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], n_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(n_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=2,  # a few KB per token; many small programs fill the GPU
    )
