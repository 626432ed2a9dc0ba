"""``y = x @ W.T`` with ``W`` in GGUF blocks (Q4_0, Q4_1, Q8_0, Q4_K), for CUDA.

The weight stays in GGUF's own row layout (``QuantizedWeight`` with layout ``"blocks"``:
``raw`` [N, K / block * block_bytes] uint8). Each program computes a ``BM x BN`` tile of
``y``; per 32 columns (one Q4_0/Q4_1/Q8_0 block, or one sub-block of a Q4_K super-block)
it loads the ``BN`` rows' bytes, dequantizes them in registers to the activation dtype
(fp16/bf16; fp32 stays fp32, with exact fp32 products, not TF32: see
:func:`engine.ops.triton._paged.dot_precision`) and feeds ``tl.dot`` with fp32
accumulation. QuantLinear calls it for the blocks the loader keeps when the Triton ops
backend runs the model (see ``engine.models.loader``). The fp16 scale
fields are assembled from two bytes and bitcast, so no alignment is assumed. Under the CPU
interpreter bf16 operands go to the dot as fp32 after the same rounding
(:func:`engine.ops.triton._paged.dot_upcast`: its bf16 dots return garbage).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.quant import LAYOUT_FORMATS, QuantError, QuantizedWeight
from engine.ops.triton._paged import dot_precision, dot_upcast

_FORMATS = {name: i for i, name in enumerate(LAYOUT_FORMATS["blocks"])}  # FMT: Q4_0, Q4_1, Q8_0, Q4_K


@triton.jit
def _f16_at(ptr):
    """The little-endian fp16 at byte pointer(s) ``ptr``, as fp32."""
    lo = tl.load(ptr).to(tl.uint16)
    hi = tl.load(ptr + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _quant_matmul_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_ym, row_bytes,
    FMT: tl.constexpr, BLOCK_BYTES: tl.constexpr, BLOCK_COLS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    cols = tl.arange(0, 32)
    m_ok = rm < M
    n_ok = rn < N
    rn_safe = tl.where(n_ok, rn, 0).to(tl.int64)  # masked rows read row 0, never past the end
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, 32):
        blk = rn_safe * row_bytes + (k0 // BLOCK_COLS) * BLOCK_BYTES  # [BN] byte offsets
        if FMT == 0:  # Q4_0: d, 16 bytes; byte l holds columns l (low) and l + 16 (high)
            d = _f16_at(w_ptr + blk)
            q = tl.load(w_ptr + blk[:, None] + 2 + (cols[None, :] % 16))
            code = (q >> ((cols[None, :] // 16) * 4).to(tl.uint8)) & 15
            w = (code.to(tl.float32) - 8.0) * d[:, None]
        elif FMT == 1:  # Q4_1: d, m, 16 bytes
            d = _f16_at(w_ptr + blk)
            mn = _f16_at(w_ptr + blk + 2)
            q = tl.load(w_ptr + blk[:, None] + 4 + (cols[None, :] % 16))
            code = (q >> ((cols[None, :] // 16) * 4).to(tl.uint8)) & 15
            w = code.to(tl.float32) * d[:, None] + mn[:, None]
        elif FMT == 2:  # Q8_0: d, 32 int8
            d = _f16_at(w_ptr + blk)
            q = tl.load(w_ptr + blk[:, None] + 2 + cols[None, :]).to(tl.int8, bitcast=True)
            w = q.to(tl.float32) * d[:, None]
        else:  # Q4_K: d, dmin, 12 scale bytes, 128 bytes of nibbles; sub-block j of 8
            j = (k0 % 256) // 32
            d = _f16_at(w_ptr + blk)
            dmin = _f16_at(w_ptr + blk + 2)
            s = w_ptr + blk + 4
            if j < 4:
                sc = tl.load(s + j) & 63
                mn = tl.load(s + j + 4) & 63
            else:
                sc = (tl.load(s + j + 4) & 15) | ((tl.load(s + j - 4) >> 6) << 4)
                mn = (tl.load(s + j + 4) >> 4) | ((tl.load(s + j) >> 6) << 4)
            q = tl.load(w_ptr + blk[:, None] + 16 + 32 * (j // 2) + cols[None, :])
            code = (q >> ((j % 2) * 4)) & 15
            w = code.to(tl.float32) * (d * sc.to(tl.float32))[:, None] - (dmin * mn.to(tl.float32))[:, None]
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k0 + cols[None, :], mask=m_ok[:, None], other=0.0)
        w = w.to(x.dtype)  # the weight rounded to the activations' dtype, on every device
        if DOT_UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION, out_dtype=tl.float32)
    out = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def supports(w: QuantizedWeight) -> bool:
    return w.layout == "blocks" and w.fmt.name in _FORMATS


def quant_matmul(x: torch.Tensor, w: QuantizedWeight, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] @ ``w``.T -> [..., N] in ``x``'s dtype (fp32 accumulation).

    ``out`` [tokens, N] in ``x``'s dtype (rows of any stride, columns contiguous: a column
    slice of a wider output, as parts of different formats write side by side) receives
    the result, as the CPU kernels' ``qmatmul`` does.
    """
    if not supports(w):
        raise QuantError(f"the Triton quantized matmul takes Q4_0/Q4_1/Q8_0/Q4_K blocks, got {w!r}")
    n, k = w.shape
    if x.shape[-1] != k:
        raise QuantError(f"quantized matmul: activations {list(x.shape)} do not end in K = {k}")
    raw = w.data["raw"]
    if raw.device != x.device:
        raise QuantError(f"weight on {raw.device}, activations on {x.device}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if out is None:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.device != x.device or out.stride(-1) != 1:
        raise QuantError(f"quantized matmul: out must be {x.dtype} [{m}, {n}] with contiguous columns, "
                         f"got {out.dtype} {list(out.shape)} stride {out.stride()}")
    else:
        y = out
    if m == 0:
        return y if out is not None else y.view(*x.shape[:-1], n)
    bm, bn = 16, 64  # tl.dot needs 16+ rows; decode steps have few tokens
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _quant_matmul_kernel[grid](
        x2, raw, y, m, n, k, x2.stride(0), y.stride(0), raw.stride(0),
        FMT=_FORMATS[w.fmt.name], BLOCK_BYTES=w.fmt.block_bytes, BLOCK_COLS=w.fmt.block,
        BM=bm, BN=bn, DOT_PRECISION=dot_precision(x.dtype), DOT_UPCAST=dot_upcast(x.dtype, x.device),
    )
    return y if out is not None else y.view(*x.shape[:-1], n)


__all__ = ["quant_matmul", "supports"]
