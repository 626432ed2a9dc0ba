"""Fused mixture-of-experts: two grouped GEMM launches over (token, slot) pairs sorted by
expert, with no per-expert launches and no host sync.

The ``T * k`` pairs are sorted by expert and each expert's group is padded to a multiple of
``BLOCK_M``, so every M tile of the sorted list belongs to exactly one expert::

    sorted pairs  | e0 e0 e0 -- | e2 e2 e2 e2 | e2 -- -- -- | e3 -- -- -- |  (-- = padding)
    tile expert   |     0       |      2      |      2      |      3      |  then unused tiles: -1

A program of the grouped GEMM takes one (M tile, N tile): it loads its tile's expert,
gathers the tile's input rows (the token's hidden state for the first projection, the pair's
activation for the second), multiplies by that expert's weight tile and stores the result
into the pairs' own rows. Experts without a pair own no tile: their weights are never read.
The tile layout is built on the device from ``topk_ids`` with a fixed worst-case size
(``T * k + E * (BLOCK_M - 1)`` rows), so the host never waits for the routing.

Per call: GEMM 1 (``x -> [T*k, 2*inter]`` through ``w13``), SiLU-and-mul (the norm_rope
kernel), GEMM 2 (``-> [T*k, hidden]`` through ``w2``, the result rounded to the model dtype
and then scaled by the pair's routing weight in fp32, as the torch reference does), and a
sum of each token's ``k`` rows in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.triton._paged import dot_precision, dot_upcast
from engine.ops.triton.norm_rope import silu_and_mul

BLOCK_N, BLOCK_K = 64, 32


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, pairs_ptr, tile_expert_ptr, weights_ptr,
    num_pairs, n_out, k_in, top_k,
    stride_a, stride_we, stride_wn, stride_out,
    A_BY_TOKEN: tl.constexpr, SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    tile_m = tl.program_id(0)
    tile_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile_m).to(tl.int64)
    if expert < 0:
        return  # past the last expert's padded group
    pair = tl.load(pairs_ptr + tile_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pair < num_pairs  # padding slots hold num_pairs
    # GEMM 1 reads the token's hidden state (every slot of a token shares it); GEMM 2 the
    # pair's own activation row.
    a_row = (pair // top_k) if A_BY_TOKEN else pair
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_out
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row.to(tl.int64)[:, None] * stride_a + ks[None, :]
    # The weight is [n_out, k_in] row-major; the tile is read as its [BLOCK_K, BLOCK_N] transpose.
    w_ptrs = w_ptr + expert * stride_we + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k_mask = (k0 + ks) < k_in
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if DOT_UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    result = acc.to(a_ptr.dtype.element_ty)  # the model dtype, as the reference's matmul
    if SCALE:
        scale = tl.load(weights_ptr + pair, mask=row_mask, other=0.0)
        result = result.to(tl.float32) * scale[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _block_m(num_pairs: int, num_experts: int) -> int:
    # Tiles are padded per expert: with few pairs per expert (decode) a small tile wastes
    # less; tl.dot needs at least 16 rows.
    return 16 if num_pairs <= 4 * num_experts else 64


def expert_tiles(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pairs, tile_expert)``: the pair indices sorted by expert with each expert's group
    padded to ``block_m`` (padding = ``T * k``), and the expert of each ``block_m`` tile
    (-1 for tiles past the end). Fixed worst-case sizes; computed on the device."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    group_start = torch.cumsum(counts, 0) - counts
    sorted_expert = flat.index_select(0, order)
    rank = torch.arange(num_pairs, device=device) - group_start.index_select(0, sorted_expert)
    dest = (padded_end - padded).index_select(0, sorted_expert) + rank
    max_rows = num_pairs + num_experts * (block_m - 1)
    max_tiles = triton.cdiv(max_rows, block_m)
    pairs = torch.full((max_tiles * block_m,), num_pairs, dtype=torch.int64, device=device)
    pairs.index_copy_(0, dest, order)
    tile_start = torch.arange(max_tiles, device=device) * block_m
    tile_expert = torch.searchsorted(padded_end, tile_start, right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    return pairs, tile_expert


def _grouped_gemm(
    a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, pairs: torch.Tensor,
    tile_expert: torch.Tensor, weights: torch.Tensor | None, top_k: int, block_m: int,
    *, by_token: bool,
) -> None:
    n_out, k_in = w.shape[1], w.shape[2]
    # Under the CPU interpreter, which pays a fixed cost per program, a program takes up
    # to 256 columns (the same sums: a column's value does not depend on its tile's width).
    block_n = BLOCK_N if a.device.type == "cuda" else min(256, max(BLOCK_N, triton.next_power_of_2(n_out)))
    grid = (tile_expert.shape[0], triton.cdiv(n_out, block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, pairs, tile_expert, weights if weights is not None else out,
        out.shape[0], n_out, k_in, top_k,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_BY_TOKEN=by_token, SCALE=weights is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        DOT_PRECISION=dot_precision(a.dtype), DOT_UPCAST=dot_upcast(a.dtype, a.device),
        num_warps=4,
    )


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``Ops.fused_moe`` (see ``engine.ops.moe`` for the semantics)."""
    tokens, top_k = topk_ids.shape
    hidden = x.shape[-1]
    num_experts, two_inter, _ = w13.shape
    num_pairs = tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    block_m = _block_m(num_pairs, num_experts)
    pairs, tile_expert = expert_tiles(topk_ids, num_experts, block_m)
    gate_up = torch.empty((num_pairs, two_inter), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, pairs, tile_expert, None, top_k, block_m, by_token=True)
    act = silu_and_mul(gate_up)
    down = torch.empty((num_pairs, hidden), dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _grouped_gemm(act, w2, down, pairs, tile_expert, weights, top_k, block_m, by_token=False)
    return down.view(tokens, top_k, hidden).sum(1).to(x.dtype)
