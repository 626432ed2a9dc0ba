"""Plain-torch references of the recurrent layers' decode tokens (Gated DeltaNet's delta
rule, the causal convolution, Mamba-2's state-space step and its whole mixer between the
projections, Mamba-1's selective scan): the CPU path where no C kernel takes a call,
Triton's (which has no kernel of its own for them), and the oracle of the C kernels
(tests/test_cpu_ops.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True, slots=True)
class MambaDecodeSpec:
    """What a Mamba-2 mixer's decode token needs of its config (engine.models'
    ``MambaConfig``, which this floor does not import): its widths, dt's clamp, and its
    gated norm's form (``gated_norm``: normed at all; ``norm_before_gate``: y normed, then
    gated; ``weight_fp32``: the weight times the fp32 row, else the weight in the model
    dtype times the rounded row)."""

    d_inner: int
    n_groups: int
    d_state: int
    dt_min: float
    dt_max: float
    eps: float
    gated_norm: bool
    norm_before_gate: bool
    weight_fp32: bool
    norm_dtype: torch.dtype  # the weight's as the checkpoint gives it (the product's rounding, not weight_fp32)


def gated_rms_norm_reference(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor | None,
                             spec: MambaDecodeSpec) -> torch.Tensor:
    """A Mamba-2 mixer's gated RMS norm (see :class:`MambaDecodeSpec`) of ``y`` [T, d_inner]
    (fp32) with the gate ``silu(z)``, over each group's channels, on one rank; ``weight``
    fp32 (a model-dtype weight's values). fp32, or ``spec.norm_dtype`` (the caller rounds
    it to the model's)."""
    gate = F.silu(z.float())
    if not spec.gated_norm:
        return y * gate
    gated = (y if spec.norm_before_gate else y * gate).reshape(y.shape[0], spec.n_groups, -1)
    # (torch's one fused op: at decode sizes separate ones were most of the norm's time)
    normed = F.rms_norm(gated, (gated.shape[-1],), eps=spec.eps).reshape(y.shape[0], spec.d_inner)
    assert weight is not None
    out = weight * normed if spec.weight_fp32 else weight.to(spec.norm_dtype) * normed.to(spec.norm_dtype)
    return out * gate if spec.norm_before_gate else out


def mamba2_decode_reference(ops: Any, zx: torch.Tensor, conv: torch.Tensor, state: torch.Tensor,
                            conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, dt_bias: torch.Tensor,
                            a: torch.Tensor, d: torch.Tensor, norm: torch.Tensor | None,
                            spec: MambaDecodeSpec) -> torch.Tensor:
    """One decode token of a Mamba-2 mixer for N requests, between its projections (see
    :meth:`engine.ops.Ops.mamba2_decode`), through ``ops``' own convolution and state-space
    step."""
    n, heads = zx.shape[0], dt_bias.shape[0]
    z, xbc, dt = zx.split([spec.d_inner, conv.shape[1], heads], dim=-1)
    dt = F.softplus(dt.float() + dt_bias).clamp(spec.dt_min, spec.dt_max)
    mixed = ops.conv_decode(conv, xbc, conv_weight, conv_bias)
    gs = spec.n_groups * spec.d_state
    xs, b, c = mixed.split([spec.d_inner, gs, gs], dim=-1)
    y = ops.ssd_decode(state, xs.reshape(n, heads, -1).contiguous(),
                       b.reshape(n, spec.n_groups, spec.d_state).contiguous(),
                       c.reshape(n, spec.n_groups, spec.d_state).contiguous(), dt.contiguous(), a, d)
    return gated_rms_norm_reference(y.reshape(n, spec.d_inner), z, norm, spec).to(zx.dtype)


def delta_rule_decode_reference(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                g: torch.Tensor, beta: torch.Tensor, tiled: bool) -> torch.Tensor:
    """One decode token of the gated delta rule for N requests (see
    :meth:`engine.ops.Ops.delta_rule_decode`), in torch's batched ops: decay, read ``S^T k``,
    write, read ``S^T q``."""
    n, hv, dk, dv = state.shape
    per = hv // k.shape[1]
    if per > 1:  # each value head its key head's q and k
        q, k = (t.repeat(1, per, 1) if tiled else t.repeat_interleave(per, dim=1) for t in (q, k))
    state.mul_(torch.exp(g)[:, :, None, None])
    flat = state.view(n * hv, dk, dv)
    keys = k.reshape(n * hv, dk, 1)
    missed = (flat.transpose(1, 2) @ keys).view(n, hv, dv)  # S^T k
    delta = (v - missed) * beta[:, :, None]
    flat.baddbmm_(keys, delta.reshape(n * hv, 1, dv))
    return (flat.transpose(1, 2) @ q.reshape(n * hv, dk, 1)).view(n, hv, dv)


def conv_decode_reference(conv: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """One token a row through a recurrent layer's causal convolution (see
    :meth:`engine.ops.Ops.conv_decode`): the window ``[conv | x]`` times the weight, summed,
    SiLU'd, in fp32; the window shifts by one in place."""
    window = torch.cat([conv, x.unsqueeze(-1).to(conv.dtype)], dim=-1)
    conv.copy_(window[:, :, 1:])
    mixed = (window.float() * weight).sum(-1)
    return F.silu(mixed if bias is None else mixed + bias)


def ssd_decode_reference(state: torch.Tensor, x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor,
                         a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """One decode token of Mamba-2's state-space model for N requests (see
    :meth:`engine.ops.Ops.ssd_decode`), in torch's batched ops: decay, the ``dt x B^T``
    outer product, read against C."""
    n, h, p, ds = state.shape
    per = h // b.shape[1]
    if per > 1:  # each head its group's B and C
        b, c = b.repeat_interleave(per, dim=1), c.repeat_interleave(per, dim=1)
    state.mul_(torch.exp(dt * a)[:, :, None, None])
    flat = state.view(n * h, p, ds)
    flat.baddbmm_((dt[:, :, None] * x).reshape(n * h, p, 1), b.reshape(n * h, 1, ds))
    return (state @ c.unsqueeze(-1)).squeeze(-1) + d[:, None] * x


def mamba1_decode_reference(ops: Any, state: torch.Tensor, u: torch.Tensor, dt_raw: torch.Tensor,
                            dt_bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor,
                            z: torch.Tensor) -> torch.Tensor:
    """A Mamba-1 mixer's decode token after its dt projection, for N requests (see
    :meth:`engine.ops.Ops.mamba1_decode`), through ``ops``' own selective-scan step."""
    dt = F.softplus(dt_raw.float() + dt_bias)
    y = ops.selective_decode(state, u.float(), dt.contiguous(), a, b.float().contiguous(), c.float().contiguous(), d)
    return (y * F.silu(z.float())).to(z.dtype)


def selective_decode_reference(state: torch.Tensor, u: torch.Tensor, dt: torch.Tensor, a: torch.Tensor,
                               b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """One decode token of Mamba-1's selective scan for N requests (see
    :meth:`engine.ops.Ops.selective_decode`), in torch's batched ops: the decays, the
    ``dt u B`` outer product, read against C."""
    state.mul_(torch.exp(dt[:, :, None] * a)).add_((dt * u)[:, :, None] * b[:, None, :])
    return (state @ c[:, :, None]).squeeze(-1) + d * u


__all__ = ["MambaDecodeSpec", "conv_decode_reference", "delta_rule_decode_reference", "gated_rms_norm_reference",
           "mamba1_decode_reference", "mamba2_decode_reference", "selective_decode_reference",
           "ssd_decode_reference"]
