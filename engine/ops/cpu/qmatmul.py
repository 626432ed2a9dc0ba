"""Python side of the quantized-weight C kernels (``quant.c``): checks, then one call.

Every argument is checked here before the C code sees a pointer, so a bad shape, dtype or
token id raises instead of reading out of bounds; the C entry points check again and
return an error code rather than trust their caller.
"""

from __future__ import annotations

import weakref

import torch

from engine.ops.cpu.qpack import ERRORS as _ERRORS
from engine.ops.cpu.qpack import pack
from engine.ops.cpu.qpack import pointers as _pointers
from engine.ops.cpu.qpack import ptr as _ptr
from engine.ops.quant import QuantizedExperts, QuantizedWeight
from engine.ops.quant_formats import FORMAT_CODES, QuantError

try:  # built at install time (setup.py); absent in a source tree nobody built
    from engine.ops.cpu._kernels import ffi as _ffi
    from engine.ops.cpu._kernels import lib as _lib
except ImportError:  # pragma: no cover - depends on the install
    _ffi = _lib = None

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # QDT_* in quant.c


def available() -> bool:
    """Whether the compiled kernels (with quant.c) could be loaded."""
    return _lib is not None and hasattr(_lib, "eng_qmatmul")


# The `isa` codes of eng_qmatmul, by index (avx2 came last, hence its place).
PATHS = ("auto", "portable", "avx512", "amx", "amx-bf16", "avx2")


def paths() -> tuple[str, ...]:
    """The kernel paths this CPU runs: portable C always, AVX2 where the CPU has it (with
    FMA and F16C), then AVX-512 VNNI, AMX-INT8 and AMX-BF16 where it has them."""
    if not available():
        return ()
    avx2 = ("avx2",) if _lib.eng_q_has_avx2() else ()
    return ("portable", *avx2, *PATHS[2 : 2 + int(_lib.eng_q_isa())])


# A weight's field pointers, made once per weight (six cffi casts a call were ~5 us, and a
# step at batch 32 makes ~120 calls); dropped with the weight. Keyed on the weight, checked
# against its data dict, which the cast pointers point into.
_FIELDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fields(w: QuantizedWeight) -> tuple:
    cached = _FIELDS.get(w)
    if cached is not None and cached[0] is w.data:
        return cached[1]
    if w.layout != "panels" or not w.device.type == "cpu":
        raise QuantError(f"the CPU kernels take panel-packed CPU weights, got {w!r}")
    fields = _pointers(w.data)
    _FIELDS[w] = (w.data, fields)
    return fields


def qmatmul(
    x: torch.Tensor,
    w: QuantizedWeight,
    *,
    out: torch.Tensor | None = None,
    path: str = "auto",
    threads: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x @ w.T`` for ``x`` [..., K] (fp32 or bf16, CPU): the result in ``x``'s dtype.

    ``out`` [tokens, N] (rows of any stride, columns contiguous: a column slice of a wider
    output) receives the result. ``path`` "auto" picks by CPU and batch (AMX-BF16 from 49
    tokens, else AVX-512 VNNI, else AVX2, else portable C); "portable", "avx2", "avx512",
    "amx" and "amx-bf16" force one (tests; a path the CPU lacks falls back to the int8 one
    below it). ``threads`` defaults to
    torch's thread count. ``out_dtype=torch.float32`` with bf16 ``x`` returns fp32 holding
    the bf16-rounded results (``qmatmul(x, w).float()`` in one pass).
    """
    n, k = w.shape
    code = _DTYPES.get(x.dtype)
    widen = out_dtype is not None and out_dtype != x.dtype
    if widen:
        if x.dtype != torch.bfloat16 or out_dtype != torch.float32 or out is not None:
            raise QuantError(f"quantized matmul: no {x.dtype} -> {out_dtype} output")
        code = 2  # QDT_BF16_F32
    if code is None:
        raise QuantError(f"quantized matmul takes float32 or bfloat16 activations, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise QuantError(f"quantized matmul: activations {list(x.shape)} do not end in K = {k}")
    if not x.is_cpu:
        raise QuantError("quantized matmul (CPU kernels): activations must be in CPU memory")
    lead = x.shape[:-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, k)  # (each torch op costs ~10 us cold in a step)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        result = torch.empty((x2.shape[0], n), dtype=torch.float32 if widen else x.dtype)
    elif out.shape != (x2.shape[0], n) or out.dtype != x.dtype or out.stride(-1) != 1 or not out.is_cpu:
        raise QuantError(f"quantized matmul: out must be {x.dtype} [{x2.shape[0]}, {n}] with contiguous rows")
    else:
        result = out
    status = _lib.eng_qmatmul(
        FORMAT_CODES[w.fmt.name], PATHS.index(path), code, _ptr(result, "void *"), result.stride(0),
        _ptr(x2, "void *"), x2.stride(0), x2.shape[0], k, n, *_fields(w),
        threads or torch.get_num_threads(),
    )
    if status:
        raise QuantError(f"quantized matmul {w!r}: {_ERRORS.get(status, status)}")
    return result if out is not None or x.dim() == 2 else result.view(*lead, n)


def qrows(w: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype, *, threads: int | None = None) -> torch.Tensor:
    """Rows ``ids`` of ``w`` dequantized into ``dtype``: [*ids.shape, K] (an embedding)."""
    n, k = w.shape
    code = _DTYPES.get(dtype)
    if code is None:
        raise QuantError(f"quantized rows come as float32 or bfloat16, not {dtype}")
    if ids.dtype != torch.int64 or not ids.is_cpu:
        raise QuantError(f"row ids must be int64 in CPU memory, got {ids.dtype} on {ids.device}")
    flat = ids if ids.dim() == 1 and ids.is_contiguous() else ids.reshape(-1).contiguous()
    out = torch.empty((flat.numel(), k), dtype=dtype)
    status = _lib.eng_qrows(
        FORMAT_CODES[w.fmt.name], code, _ptr(out, "void *"), _ptr(flat, "int64_t *"), flat.numel(), k, n,
        *_fields(w), threads or torch.get_num_threads(),
    )
    if status == 3:
        raise QuantError(f"row id out of range for a table of {n} rows")
    if status:
        raise QuantError(f"quantized rows {w!r}: {_ERRORS.get(status, status)}")
    return out if ids.dim() == 1 else out.view(*ids.shape, k)


# Each stack's EngQPart array (quant.c's eng_qmoe takes its parts so), made once per stack
# and dropped with it, as _FIELDS is for a weight.
_EXPERT_PARTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _expert_parts(w: QuantizedExperts):
    cached = _EXPERT_PARTS.get(w)
    if cached is not None:
        return cached
    if w.device.type != "cpu":
        raise QuantError(f"the CPU kernels take panel-packed CPU weights, got {w!r}")
    parts = _ffi.new("EngQPart[]", len(w.parts))
    col = 0
    for i, (part, rows) in enumerate(zip(w.parts, w.rows, strict=True)):
        codes, hi, d, m, sc, mn = _pointers(part.data)
        parts[i].fmt, parts[i].N, parts[i].col = FORMAT_CODES[part.fmt.name], rows, col
        parts[i].codes, parts[i].hi, parts[i].d, parts[i].m, parts[i].sc, parts[i].mn = codes, hi, d, m, sc, mn
        col += rows
    _EXPERT_PARTS[w] = parts
    return parts


def qmoe(x: torch.Tensor, w13: QuantizedExperts, w2: QuantizedExperts, topk_weights: torch.Tensor,
         topk_ids: torch.Tensor, *, gated: bool = True, threads: int | None = None) -> torch.Tensor:
    """The routed experts' output ``[T, hidden]`` in ``x``'s dtype (``Ops.fused_moe``'s
    computation) with both projections kept in their blocks: quant.c's ``eng_qmoe``, the
    quantized matmuls' int8 kernels over each expert's group of (token, slot) pairs.
    ``gated``: ``w13`` is each expert's gate then up (SiLU-and-mul between), else its up
    alone (Nemotron 3's ``relu(up) ** 2``)."""
    t, k = topk_ids.shape
    e, r, h = w13.shape
    inter = w2.shape[2]
    code = _DTYPES.get(x.dtype)
    if code is None or x.dim() != 2 or not x.is_cpu or x.shape[1] != h:
        raise QuantError(f"quantized experts: activations {x.dtype} {list(x.shape)} do not fit {w13!r}")
    if (len(w13.parts) != (2 if gated else 1) or r != (2 if gated else 1) * inter or w2.shape[:2] != (e, h)
            or len(w2.parts) != 1):
        raise QuantError(f"quantized experts: {w13!r} and {w2!r} are not one layer's (gated={gated})")
    if topk_ids.dtype != torch.int64 or topk_weights.dtype != torch.float32 or topk_weights.shape != (t, k):
        raise QuantError("quantized experts: routing ids must be int64 and weights float32, both [T, k]")
    x = x.contiguous()
    ids, weights = topk_ids.contiguous(), topk_weights.contiguous()
    out = torch.empty_like(x)
    if t == 0:
        return out
    status = _lib.eng_qmoe(
        code, _ptr(out, "void *"), _ptr(x, "void *"), t, h, inter, k, e, _expert_parts(w13), len(w13.parts),
        _expert_parts(w2), int(gated), _ptr(weights, "float *"), _ptr(ids, "int64_t *"),
        threads or torch.get_num_threads(),
    )
    if status == -2:
        raise QuantError(f"an expert id is out of range for {e} experts")
    if status:
        raise QuantError(f"quantized experts {w13!r}: {'out of memory' if status == -3 else 'bad arguments'}")
    return out


__all__ = ["PATHS", "available", "pack", "paths", "qmatmul", "qmoe", "qrows"]


# Rows of activations up to which a dense projection on CPU takes quant.c's dense kernel
# (Linear and the fused decode step alike, so both give the same bits): decode steps and
# speculative verification chunks. Past it oneDNN's packed GEMM is faster: in bf16 from 9
# rows on an AMX CPU (its tiles against AVX512-BF16 dot products; SmolLM2 decode at 10
# rows was 10% slower fused than on oneDNN, at 8 the same), in fp32 past the fused step's
# 10 (1.26x faster fused at 10). Read at every call (bench/decode.py changes it).
DENSE_MAX_ROWS = {torch.float32: 10, torch.bfloat16: 8}


def dense_ok(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`dense_matmul` takes this weight (and bias): fp32 or bf16 on a CPU
    with AVX-512 (elsewhere its portable loops trail oneDNN, and Linear keeps oneDNN)."""
    return (available() and hasattr(_lib, "eng_dense_isa") and _lib.eng_dense_isa() > 0 and weight.dtype in _DTYPES
            and weight.dim() == 2 and weight.is_cpu and weight.is_contiguous() and weight.shape[1] > 0
            and (bias is None or (bias.dtype == weight.dtype and bias.is_contiguous()
                                  and bias.shape == (weight.shape[0],))))


def dense_matmul(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor,
                 *, threads: int | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x`` [M, K] contiguous in the weight's dtype (fp32
    or bf16; accumulated in fp32, rounded once). The caller checked :func:`dense_ok`."""
    m, k = x.shape
    if k != weight.shape[1] or x.dtype != weight.dtype or not x.is_contiguous():
        raise QuantError(f"dense matmul: activations {tuple(x.shape)} {x.dtype} do not fit the weight "
                         f"{tuple(weight.shape)} {weight.dtype}")
    out = torch.empty((m, weight.shape[0]), dtype=x.dtype)
    status = _lib.eng_dense_matmul(
        _DTYPES[x.dtype], _ptr(out, "void *"), _ptr(x, "void *"), m, k, weight.shape[0], _ptr(weight, "void *"),
        _ptr(bias, "void *"), torch.get_num_threads() if threads is None else threads,
    )
    if status:
        raise QuantError(f"dense matmul: {_ERRORS.get(-status, 'bad arguments')}")
    return out
