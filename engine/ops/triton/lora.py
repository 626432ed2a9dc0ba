"""LoRA's shrink and expand as SGMV: the step's adapter tokens grouped by slot.

The runner's :class:`engine.ops.LoraSegments` lists the adapter tokens sorted by slot
(``order``), cut into one group per slot (``group_bounds``, ``group_slots``); base-model
tokens are in no group and left as they are. A program takes a tile of one group's tokens:
``shrink`` writes ``x[tokens] @ A[slot].T`` [M, R] in fp32 (a tile of A read once for the
tile's tokens, where going token by token read it once per token), ``expand`` adds
``shrunk @ Bt[slot]`` into the base projection's output, in fp32 and rounded once, as the
torch reference does (``engine.ops.reference.lora_add_reference``). The dots run in full
fp32 (``input_precision="ieee"``: TF32 would move fp32 outputs by ~1e-3).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, order_ptr, bounds_ptr, gslots_ptr, tmp_ptr, K, R,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    g = tl.program_id(2)
    start = tl.load(bounds_ptr + g)
    end = tl.load(bounds_ptr + g + 1)
    slot = tl.load(gslots_ptr + g).to(tl.int64)
    pos = start + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # past the group's end: masked
    pmask = pos < end
    tok = tl.load(order_ptr + pos, mask=pmask, other=0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        x = tl.load(x_ptr + tok[:, None] * K + ks[None, :], mask=pmask[:, None] & kmask[None, :], other=0.0)
        a = tl.load(a_ptr + slot * R * K + rows[None, :] * K + ks[:, None], mask=kmask[:, None] & rmask[None, :],
                    other=0.0)  # [BLOCK_K, BLOCK_R]: A's rows as columns
        acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
    tl.store(tmp_ptr + pos[:, None] * R + rows[None, :], acc, mask=pmask[:, None] & rmask[None, :])


@triton.jit
def _expand_kernel(tmp_ptr, b_ptr, order_ptr, bounds_ptr, gslots_ptr, out_ptr, N, R,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    g = tl.program_id(2)
    start = tl.load(bounds_ptr + g)
    end = tl.load(bounds_ptr + g + 1)
    slot = tl.load(gslots_ptr + g).to(tl.int64)
    pos = start + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pmask = pos < end
    tok = tl.load(order_ptr + pos, mask=pmask, other=0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        rmask = rs < R
        s = tl.load(tmp_ptr + pos[:, None] * R + rs[None, :], mask=pmask[:, None] & rmask[None, :], other=0.0)
        b = tl.load(b_ptr + slot * R * N + rs[:, None] * N + cols[None, :], mask=rmask[:, None] & nmask[None, :],
                    other=0.0)
        acc += tl.dot(s, b.to(tl.float32), input_precision="ieee")
    omask = pmask[:, None] & nmask[None, :]
    base = tl.load(out_ptr + tok[:, None] * N + cols[None, :], mask=omask, other=0.0).to(tl.float32)
    tl.store(out_ptr + tok[:, None] * N + cols[None, :], (base + acc).to(out_ptr.dtype.element_ty), mask=omask)


# tl.dot's smallest tile side is 16; a decode group is often 1-8 tokens, padded (masked) to it.
_BLOCK_M = 16


def lora_add(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             groups: tuple[tuple[int, int, int], ...], order: torch.Tensor, group_bounds: torch.Tensor,
             group_slots: torch.Tensor) -> None:
    """``out[t] += (a[s] @ x[t]) @ b[s]`` for every token ``t`` of each group (``b``
    [S, R, out]: B transposed); ``groups`` is the host copy of the bounds (its longest
    group sizes the grid)."""
    if not groups:
        return
    K = x.shape[1]
    N, R = out.shape[1], a.shape[1]
    x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
    assert out.is_contiguous(), "lora_add writes the projection's output in place"
    longest = max(end - start for start, end, _ in groups)
    tmp = torch.empty((groups[-1][1], R), dtype=torch.float32, device=x.device)  # shrunk rows, in order's order
    block_r = max(16, min(64, triton.next_power_of_2(R)))
    m_tiles = triton.cdiv(longest, _BLOCK_M)
    _shrink_kernel[(m_tiles, triton.cdiv(R, block_r), len(groups))](
        x, a, order, group_bounds, group_slots, tmp, K, R, BLOCK_M=_BLOCK_M, BLOCK_R=block_r, BLOCK_K=64)
    block_n = 64
    _expand_kernel[(m_tiles, triton.cdiv(N, block_n), len(groups))](
        tmp, b, order, group_bounds, group_slots, out, N, R, BLOCK_M=_BLOCK_M, BLOCK_N=block_n, BLOCK_R=block_r)
