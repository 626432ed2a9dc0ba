"""Row-wise elementwise kernels: (fused add +) RMSNorm, in-place neox RoPE, SiLU-and-mul,
GELU(tanh)-and-mul.

Each is one pass over its rows; on GPU they replace several torch kernels and their
intermediates (add, pow, mean, rsqrt, mul, mul for the norm; slice, neg, cat, mul, add for
RoPE), so they are bound by a single read and write of the activations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    n_rows, n_cols, stride_x, stride_res, stride_out, stride_res_out, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + rows * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        # The sum is rounded to the activation dtype before the norm, as the torch
        # reference (and HF) compute it: the residual stream lives in that dtype.
        x_rounded = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + rows * stride_res_out + cols, x_rounded, mask=mask)
        x = x_rounded.to(tl.float32)
    var = tl.sum(x * x, axis=1) / n_cols
    y = x * tl.rsqrt(var + eps)[:, None]
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0)
    # Rounded to the activation dtype before the weight multiply, as HF and the torch
    # reference do, so fp16/bf16 outputs match them bit for bit in the common case.
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + rows * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows_per_program(x: torch.Tensor, n_rows: int) -> int:
    """Rows a program of a row-wise kernel takes: one on a GPU (a row fills a program's
    threads); in the CPU interpreter, which runs programs one after another at a fixed cost
    each, up to 64, as one block."""
    return 1 if x.is_cuda else min(triton.next_power_of_2(max(n_rows, 1)), 64)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """View ``t`` as [rows, last_dim] with a unit inner stride (copying only if needed)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    out = torch.empty_like(x2)
    # With a residual the sum goes into x2 (x itself, or its private copy), as the
    # reference's `x.add_(residual)`; without one res2 is an unused placeholder.
    res2 = x2 if residual is None else _rows(residual)
    block = triton.next_power_of_2(n_cols)
    if n_rows:
        rows = _rows_per_program(x2, n_rows)
        _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
            x2, res2, weight, out, x2,
            n_rows, n_cols, x2.stride(0), res2.stride(0), out.stride(0), x2.stride(0), eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, ROWS=rows,
            # Wide rows (4-8k) need more warps to keep 16-byte loads per thread.
            num_warps=min(max(block // 256, 1), 16),
        )
    return out.view(x.shape), x2.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, in fp32, returned in ``x.dtype``."""
    return _launch_rms_norm(x, weight, eps, None)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass.

    The sum is written into ``x``'s storage (as the torch reference's ``x.add_``) when
    ``x`` has unit-stride rows, so the residual stream needs no new allocation per layer.
    """
    return _launch_rms_norm(x, weight, eps, residual)


@triton.jit
def _rope_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr,
    n_tokens, stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    n_q_heads, n_k_heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, TOKS: tl.constexpr,
):
    # [TOKS, heads, d/2] tiles: TOKS tokens a program (one on a GPU, see _rows_per_program).
    tok = (tl.program_id(0) * TOKS + tl.arange(0, TOKS)).to(tl.int64)
    t_mask = tok < n_tokens
    pos = tl.load(pos_ptr + tok, mask=t_mask, other=0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HALF
    cs_mask = t_mask[:, None] & d_mask[None, :]
    cs = cache_ptr + pos[:, None] * stride_cache + d[None, :]
    cos = tl.load(cs, mask=cs_mask, other=0.0).to(tl.float32)[:, None, :]
    sin = tl.load(cs + HALF, mask=cs_mask, other=0.0).to(tl.float32)[:, None, :]
    h = tl.arange(0, BLOCK_H)
    # Query and key share the same rotation; one loop body per tensor keeps it in place.
    for which in tl.static_range(2):
        if which == 0:
            base = q_ptr + tok * stride_qt
            stride_h = stride_qh
            n_heads = n_q_heads
        else:
            base = k_ptr + tok * stride_kt
            stride_h = stride_kh
            n_heads = n_k_heads
        mask = t_mask[:, None, None] & (h[None, :, None] < n_heads) & d_mask[None, None, :]
        p1 = base[:, None, None] + h[None, :, None] * stride_h + d[None, None, :]
        x1 = tl.load(p1, mask=mask, other=0.0)
        x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
        y1 = x1.to(tl.float32) * cos - x2.to(tl.float32) * sin
        y2 = x2.to(tl.float32) * cos + x1.to(tl.float32) * sin
        tl.store(p1, y1.to(x1.dtype), mask=mask)
        tl.store(p1 + HALF, y2.to(x1.dtype), mask=mask)


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox (rotate-half) RoPE applied in place on ``query`` [T, H, D] and ``key`` [T, Hkv, D]:
    the first ``R`` values of each head, for a cache of ``[max_pos, R]`` (``R`` < D: a
    partial rotary; the rest pass as they are).

    Either may be a strided view (e.g. slices of a fused QKV output); only the head-dim
    stride must be 1.
    """
    n_tokens, n_q_heads, head_dim = query.shape
    n_k_heads = key.shape[1]
    if query.stride(-1) != 1 or key.stride(-1) != 1:
        raise ValueError("rotary_embedding needs a unit stride over head_dim")
    half = cos_sin_cache.shape[-1] // 2
    if 2 * half > head_dim:
        raise ValueError(f"a cos/sin cache of {cos_sin_cache.shape[-1]} is wider than head_dim {head_dim}")
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    if n_tokens:
        toks = _rows_per_program(query, n_tokens)
        _rope_kernel[(triton.cdiv(n_tokens, toks),)](
            positions, query, key, cache,
            n_tokens, query.stride(0), query.stride(1), key.stride(0), key.stride(1), cache.stride(0),
            n_q_heads, n_k_heads,
            HALF=half,
            BLOCK_H=triton.next_power_of_2(max(n_q_heads, n_k_heads)),
            BLOCK_D=triton.next_power_of_2(half), TOKS=toks,
            num_warps=4,  # a [heads, d/2] tile of a few KB: one program per token is enough
        )
    return query, key


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, n_rows, d, stride_x, stride_out, BLOCK: tl.constexpr,
                        ROWS: tl.constexpr, GELU_TANH: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = (rows < n_rows) & (cols < d)
    gate = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + rows * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:
        # gelu_tanh(g) = g / 2 * (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3); with
        # 1 + tanh(u) = 2 sigmoid(2u) that is g * sigmoid(2u). The sigmoid takes exp of a
        # non-positive argument only, so it never overflows at either tail.
        two_u = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)
        e = tl.exp(-tl.abs(two_u))
        act = gate * tl.where(two_u >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    else:
        act = gate * tl.sigmoid(gate)
    # Round the activation to the activation dtype before the multiply, as torch computes it.
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + rows * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    x2 = _rows(x)
    n_rows, two_d = x2.shape
    d = two_d // 2
    out = torch.empty((n_rows, d), dtype=x.dtype, device=x.device)
    block = 1024  # columns per program: 4 KB of fp32 per operand, enough to hide latency
    if n_rows:
        rows = _rows_per_program(x2, n_rows)
        _act_and_mul_kernel[(triton.cdiv(n_rows, rows), triton.cdiv(d, block))](
            x2, out, n_rows, d, x2.stride(0), out.stride(0), BLOCK=block, ROWS=rows, GELU_TANH=gelu_tanh,
            num_warps=4,
        )
    return out.view(*x.shape[:-1], d)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` in one pass (torch needs three kernels and two temps)."""
    return _act_and_mul(x, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu(x[..., :d], approximate="tanh") * x[..., d:]`` in one pass (Gemma's GeGLU)."""
    return _act_and_mul(x, gelu_tanh=True)

