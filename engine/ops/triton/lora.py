"""LoRA's shrink and expand (BGMV: each token reads its own adapter slot's A and B).

A step's tokens carry their slot (-1: the base model, left as it is). ``shrink`` writes
``A[slot] @ x`` [T, R] in fp32; ``expand`` adds ``shrunk @ Bt[slot]`` into the base
projection's output, in fp32 and rounded once, as the torch reference does
(``engine.ops.reference.lora_add_reference``). Per token rather than per segment: at
decode every token is its own request, and a prefill segment re-reads one slot's A and B,
which stay in cache (R x in and out x R at R <= 64 per slice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, tmp_ptr, K, R, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    rb = tl.program_id(1)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    slot = tl.maximum(slot, 0) + tl.zeros((BLOCK_R,), dtype=tl.int64)  # a base row reads slot 0, stores nothing
    valid = (tl.zeros((BLOCK_R,), dtype=tl.int64) + tl.load(slots_ptr + t)) >= 0
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = (rows < R) & valid
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        x = tl.load(x_ptr + t * K + ks, mask=kmask, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot[:, None] * R * K + rows[:, None] * K + ks[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(tmp_ptr + t * R + rows, acc, mask=rmask)


@triton.jit
def _expand_kernel(tmp_ptr, b_ptr, slots_ptr, out_ptr, N, R, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    slot = tl.maximum(slot, 0) + tl.zeros((BLOCK_N,), dtype=tl.int64)  # a base row reads slot 0, stores nothing
    valid = (tl.zeros((BLOCK_N,), dtype=tl.int64) + tl.load(slots_ptr + t)) >= 0
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = (cols < N) & valid
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        rmask = rs < R
        s = tl.load(tmp_ptr + t * R + rs, mask=rmask, other=0.0)
        b = tl.load(b_ptr + slot[:, None] * R * N + rs[None, :] * N + cols[:, None],
                    mask=nmask[:, None] & rmask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(b * s[None, :], axis=1)
    base = tl.load(out_ptr + t * N + cols, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * N + cols, (base + acc).to(out_ptr.dtype.element_ty), mask=nmask)


def lora_add(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor) -> None:
    """``out[t] += (a[s] @ x[t]) @ b[s]`` for every token ``t`` whose slot ``s >= 0``
    (``b`` [S, R, out]: B transposed)."""
    T, K = x.shape
    N, R = out.shape[1], a.shape[1]
    if T == 0:
        return
    x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
    assert out.is_contiguous(), "lora_add writes the projection's output in place"
    tmp = torch.empty((T, R), dtype=torch.float32, device=x.device)
    block_r = min(64, triton.next_power_of_2(R))
    _shrink_kernel[(T, triton.cdiv(R, block_r))](x, a, token_slots, tmp, K, R, BLOCK_R=block_r, BLOCK_K=64)
    block_n = 64
    _expand_kernel[(T, triton.cdiv(N, block_n))](tmp, b, token_slots, out, N, R, BLOCK_N=block_n, BLOCK_R=block_r)
