"""The C repack of GGUF rows into the CPU kernels' panel layout (``quant.c``'s ``eng_qpack``).

:meth:`engine.ops.quant.QuantizedWeight.from_blocks` calls it when it builds a panel-packed
weight; it is apart from the matmul wrappers (``engine.ops.cpu.qmatmul``, which re-exports
:func:`pack`) because those take a :class:`~engine.ops.quant.QuantizedWeight`, whose
module needs this one. It reads only the formats' tables.
"""

from __future__ import annotations

import torch

from engine.ops.quant_formats import (
    FORMAT_CODES,
    QuantError,
    QuantFormat,
    check_blocks,
    panel_shapes,
)

try:  # built at install time (setup.py); absent in a source tree nobody built
    from engine.ops.cpu._kernels import ffi as _ffi
    from engine.ops.cpu._kernels import lib as _lib
except ImportError:  # pragma: no cover - depends on the install
    _ffi = _lib = None

# The status codes of quant.c's entry points.
ERRORS = {1: "bad arguments", 2: "out of memory", 3: "a row id is out of range"}


def available() -> bool:
    """Whether the compiled kernels (with quant.c) could be loaded."""
    return _lib is not None and hasattr(_lib, "eng_qpack")


def ptr(t: torch.Tensor | None, ctype: str):
    """A cffi pointer of type ``ctype`` to ``t``'s data (NULL for None)."""
    return _ffi.NULL if t is None else _ffi.cast(ctype, t.data_ptr())


def pointers(data: dict[str, torch.Tensor]) -> tuple:
    """The six field pointers quant.c's entry points take for a panel-packed weight's
    ``data``: codes, high bits, ``d``, ``m`` or ``dmin``, ``sc``, ``mn`` (NULL if absent)."""
    codes = data.get("codes4", data.get("codes8", data.get("codes2")))
    hi = data.get("hi1", data.get("hi2"))
    second = data.get("m", data.get("dmin"))
    return (
        ptr(codes, "uint8_t *"), ptr(hi, "uint8_t *"), ptr(data["d"], "uint16_t *"),
        ptr(second, "uint16_t *"), ptr(data.get("sc"), "uint8_t *"), ptr(data.get("mn"), "uint8_t *"),
    )


def pack(raw: torch.Tensor, fmt: QuantFormat, k: int, *, threads: int | None = None) -> dict[str, torch.Tensor]:
    """GGUF rows ``raw`` [N, bytes] uint8 repacked into panels (``quant.pack_panels``'s
    layout, bit for bit)."""
    check_blocks(raw, fmt, k)
    raw = raw.contiguous()
    n = raw.shape[0]
    data = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in panel_shapes(fmt, n, k).items()}
    status = _lib.eng_qpack(
        FORMAT_CODES[fmt.name], ptr(raw, "uint8_t *"), n, k, *pointers(data),
        threads or torch.get_num_threads(),
    )
    if status:
        raise QuantError(f"repacking {fmt.name} [{n}, {k}]: {ERRORS.get(status, status)}")
    return data


__all__ = ["ERRORS", "available", "pack", "pointers", "ptr"]
