"""Kernels behind one signature per op, with a backend chosen by the caller.

``get_ops("torch")`` gives the plain-torch reference (the oracle for every kernel);
``get_ops("cpu")`` the CPU path: C kernels for the ops torch dispatches slowly at decode
sizes, the reference for the rest; ``get_ops("triton")`` the Triton kernels (CUDA, or CPU
under ``TRITON_INTERPRET=1`` for tests). ``get_ops("auto")`` picks Triton on CUDA, and on
CPU the C kernels when they are built, else the reference. Models receive the ``Ops``
object explicitly; nothing here is global.

The protocol and the data types the ops take (:class:`Ops`, :class:`AttentionMetadata`,
:class:`QuantizedKV`, ``KVCache``; the KV-cache layout) live in ``engine.ops.base``, which
the backends import; they are re-exported here for the models and the runner.
"""

from __future__ import annotations

import torch

from engine.ops import cpu
from engine.ops.base import (
    AttentionMetadata,
    KVCache,
    LoraSegments,
    Ops,
    QuantizedKV,
    lora_rows_paired,
    lora_rows_unpaired,
)
from engine.ops.reference import TorchOps

__all__ = [
    "AttentionMetadata",
    "KVCache",
    "LoraSegments",
    "Ops",
    "QuantizedKV",
    "get_ops",
    "lora_rows_paired",
    "lora_rows_unpaired",
    "resolve_backend",
]


def resolve_backend(backend: str = "auto", device: torch.device | str = "cpu") -> str:
    """The backend :func:`get_ops` gives for ``backend`` on ``device``: "auto" resolved.

    The loader asks too: which kernels will run the model decides the layout a GGUF's
    quantized weights are kept in (see ``engine.models.loader``).
    """
    if backend not in ("auto", "torch", "cpu", "triton"):
        raise ValueError(f"unknown ops backend {backend!r}; expected auto, torch, cpu or triton")
    if backend != "auto":
        return backend
    return "triton" if torch.device(device).type == "cuda" else "cpu" if cpu.available() else "torch"


def get_ops(backend: str = "auto", device: torch.device | str = "cpu") -> Ops:
    """Return the op set for ``backend`` in {"auto", "torch", "cpu", "triton"}."""
    backend = resolve_backend(backend, device)
    if backend == "torch":
        return TorchOps()
    if backend == "cpu":
        return cpu.CpuOps()
    # Imported here, not at the top: triton is a heavy optional library (absent from a
    # CPU-only install), and importing the module decorates every kernel, which must
    # happen after a test sets TRITON_INTERPRET (see engine/ops/triton/__init__.py).
    from engine.ops.triton_ops import TritonOps

    return TritonOps()
