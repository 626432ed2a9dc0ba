"""The CPU op set's recurrent decode tokens (:class:`engine.ops.cpu.CpuOps` inherits them):
the causal convolution, Mamba-2's state-space step and its whole mixer between the
projections, Mamba-1's selective scan; one C call each (kernels.c), the torch reference
for any input the kernels do not take.

A Mamba-2 mixer's decode token (:meth:`RecurrentKernels.mamba2_decode`) is one call where
the torch path makes some twenty small ops: in a model each of those runs after the
projections have streamed their weights through the caches, and costs several times what
it costs alone (on Nemotron-H's mixer, 0.54 of its 0.87 ms a token).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.ops.cpu.errors import CpuKernelError
from engine.ops.recurrent_reference import MambaDecodeSpec
from engine.ops.reference import TorchOps

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # enum in kernels.c


class RecurrentKernels(TorchOps):
    """The recurrent layers' decode kernels of the CPU op set. ``_lib`` and ``_ffi`` are
    the compiled module's (engine.ops.cpu's import of it, which :class:`CpuOps` sets: this
    module is part of that package's import, and may not import it back)."""

    _lib: Any = None
    _ffi: Any = None

    def _ptr(self, t: torch.Tensor, ctype: str = "void *") -> Any:  # a cffi pointer to the tensor's data
        return self._ffi.cast(ctype, t.data_ptr())

    def conv_decode(self, conv: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
        """One C call for the step's rows: the window's dot product, SiLU and shift per
        channel, where the reference concatenates, copies, multiplies and sums."""
        code = _DTYPE_CODES.get(conv.dtype)
        n, c, w = conv.shape if conv.dim() == 3 else (0, 0, 0)
        if (code is None or x.dtype != conv.dtype or not conv.is_cpu or not conv.is_contiguous() or x.dim() != 2
                or x.shape != (n, c) or (n and x.stride(-1) != 1) or weight.dtype != torch.float32
                or not weight.is_contiguous() or weight.shape != (c, w + 1)
                or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()
                                          or bias.shape != (c,)))):
            return super().conv_decode(conv, x, weight, bias)
        out = torch.empty(n, c, dtype=torch.float32)
        rc = self._lib.eng_conv_decode(code, self._ptr(conv), self._ptr(x), x.stride(0) if n else c, self._ptr(weight, "float *"),
                                  self._ffi.NULL if bias is None else self._ptr(bias, "float *"), self._ptr(out, "float *"), n, c, w,
                                  torch.get_num_threads())
        if rc:
            raise CpuKernelError(f"conv_decode: the kernel failed ({rc})")
        return out

    def selective_decode(self, state: torch.Tensor, u: torch.Tensor, dt: torch.Tensor, a: torch.Tensor,
                         b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """One C call for every (request, channel): one pass over each state row where the
        reference's batched ops make four, and no [N, D, S] temporaries."""
        n, dch, ds = state.shape
        tensors = (state, u, dt, a, b, c, d)
        if (any(t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() for t in tensors)
                or u.shape != (n, dch) or dt.shape != (n, dch) or a.shape != (dch, ds) or b.shape != (n, ds)
                or c.shape != (n, ds) or d.shape != (dch,)):
            return super().selective_decode(state, u, dt, a, b, c, d)
        y = torch.empty(n, dch, dtype=torch.float32)
        rc = self._lib.eng_selective_decode(*(self._ptr(t, "float *") for t in (state, u, dt, a, b, c, d, y)), n, dch, ds,
                                       torch.get_num_threads())
        if rc:
            raise CpuKernelError(f"selective_decode: the kernel failed ({rc})")
        return y

    def ssd_decode(self, state: torch.Tensor, x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor,
                   a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """One C call for every (request, head): one pass over each state where the
        reference's batched ops make three, and no copy of B and C per head."""
        n, h, p, ds = state.shape
        g = b.shape[1] if b.dim() == 3 else 0
        tensors = (state, x, b, c, dt, a, d)
        if (any(t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() for t in tensors)
                or not g or h % g or x.shape != (n, h, p) or b.shape != (n, g, ds) or c.shape != b.shape
                or dt.shape != (n, h) or a.shape != (h,) or d.shape != (h,)):
            return super().ssd_decode(state, x, b, c, dt, a, d)
        y = torch.empty(n, h, p, dtype=torch.float32)
        rc = self._lib.eng_ssd_decode(*(self._ptr(t, "float *") for t in (state, x, b, c, dt, a, d, y)), n, h, g, p, ds,
                                 torch.get_num_threads())
        if rc:
            raise CpuKernelError(f"ssd_decode: the kernel failed ({rc})")
        return y

    def mamba1_decode(self, state: torch.Tensor, u: torch.Tensor, dt_raw: torch.Tensor, dt_bias: torch.Tensor,
                      a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor,
                      z: torch.Tensor) -> torch.Tensor:
        """One C call (kernels.c's ``eng_mamba1_decode``): dt, the selective scan's step
        over every (request, channel), the gate; the reference's numbers."""
        code = _DTYPE_CODES.get(u.dtype)
        n, dch, ds = state.shape if state.dim() == 3 else (0, 0, 0)
        if (code is None or not n or not u.is_cpu or state.dtype != torch.float32 or not state.is_contiguous()
                or any(t.dtype != u.dtype for t in (dt_raw, b, c, z)) or not (u.is_contiguous() and dt_raw.is_contiguous())
                or u.shape != (n, dch) or dt_raw.shape != (n, dch) or z.shape != (n, dch) or b.shape != (n, ds)
                or c.shape != (n, ds) or b.stride() != c.stride() or b.stride(1) != 1 or z.stride(1) != 1
                or any(t.dtype != torch.float32 or not t.is_contiguous() for t in (dt_bias, a, d))
                or a.shape != (dch, ds) or dt_bias.shape != (dch,) or d.shape != (dch,)):
            return super().mamba1_decode(state, u, dt_raw, dt_bias, a, b, c, d, z)
        out = torch.empty(n, dch, dtype=u.dtype)
        scratch = torch.empty(2 * n * ds, dtype=torch.float32)
        rc = self._lib.eng_mamba1_decode(
            code, self._ptr(state, "float *"), self._ptr(u), self._ptr(dt_raw), self._ptr(b), self._ptr(c), b.stride(0),
            self._ptr(z), z.stride(0), self._ptr(dt_bias, "float *"), self._ptr(a, "float *"), self._ptr(d, "float *"),
            self._ptr(out), self._ptr(scratch, "float *"), n, dch, ds, torch.get_num_threads())
        if rc:
            return super().mamba1_decode(state, u, dt_raw, dt_bias, a, b, c, d, z)
        return out

    def mamba2_decode(self, zx: torch.Tensor, conv: torch.Tensor, state: torch.Tensor, conv_weight: torch.Tensor,
                      conv_bias: torch.Tensor | None, dt_bias: torch.Tensor, a: torch.Tensor, d: torch.Tensor,
                      norm: torch.Tensor | None, spec: MambaDecodeSpec) -> torch.Tensor:
        """One C call (kernels.c's ``eng_mamba2_decode``): dt, the convolution, the
        state-space step over the heads (the team's), the gated norm; the reference's
        numbers, SiLU's exp aside."""
        code = _DTYPE_CODES.get(zx.dtype)
        n, heads = zx.shape[0], dt_bias.shape[0]
        conv_dim = conv.shape[1] if conv.dim() == 3 else 0
        width = spec.d_inner + conv_dim + heads
        fp32 = (conv_weight, dt_bias, a, d) + (() if conv_bias is None else (conv_bias,))
        if (code is None or not n or zx.dim() != 2 or zx.shape[1] != width or zx.stride(1) != 1 or not zx.is_cpu
                or conv.dtype != zx.dtype or not conv.is_contiguous() or conv.shape[0] != n
                or state.dtype != torch.float32 or not state.is_contiguous() or state.dim() != 4
                or state.shape[:2] != (n, heads) or state.shape[2] * heads != spec.d_inner
                or state.shape[3] != spec.d_state
                or any(t.dtype != torch.float32 or not t.is_contiguous() for t in fp32)
                or conv_weight.shape != (conv_dim, conv.shape[2] + 1)
                or (spec.gated_norm and (norm is None or norm.numel() != spec.d_inner))):
            return super().mamba2_decode(zx, conv, state, conv_weight, conv_bias, dt_bias, a, d, norm, spec)
        weight = norm if spec.gated_norm else dt_bias  # (unread without a norm)
        if spec.gated_norm and (norm.dtype != torch.float32 or not norm.is_contiguous()
                                or spec.norm_dtype not in (torch.float32, zx.dtype)):
            return super().mamba2_decode(zx, conv, state, conv_weight, conv_bias, dt_bias, a, d, norm, spec)
        flags = (spec.gated_norm | spec.norm_before_gate << 1
                 | (spec.gated_norm and not spec.weight_fp32 and spec.norm_dtype == torch.bfloat16) << 2)
        out = torch.empty(n, spec.d_inner, dtype=zx.dtype)
        scratch = torch.empty(n * (conv_dim + heads + 2 * spec.d_inner), dtype=torch.float32)
        rc = self._lib.eng_mamba2_decode(
            code, self._ptr(zx), zx.stride(0), self._ptr(conv), self._ptr(state, "float *"), self._ptr(conv_weight, "float *"),
            self._ffi.NULL if conv_bias is None else self._ptr(conv_bias, "float *"), self._ptr(dt_bias, "float *"),
            self._ptr(a, "float *"), self._ptr(d, "float *"), self._ptr(weight, "float *"), spec.dt_min, spec.dt_max, spec.eps,
            flags, n, spec.d_inner, conv_dim, conv.shape[2], heads, spec.n_groups, spec.d_state,
            self._ptr(scratch, "float *"), self._ptr(out), torch.get_num_threads())
        if rc:
            return super().mamba2_decode(zx, conv, state, conv_weight, conv_bias, dt_bias, a, d, norm, spec)
        return out


__all__ = ["RecurrentKernels"]
