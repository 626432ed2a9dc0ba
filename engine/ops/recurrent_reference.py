"""Plain-torch references of the recurrent layers' decode tokens (Gated DeltaNet's delta
rule, the causal convolution, Mamba-2's state-space step, Mamba-1's selective scan): the
CPU path where no C kernel takes a call, Triton's (which has no kernel of its own for
them), and the oracle of the C kernels (tests/test_cpu_ops.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def selective_decode_reference(state: torch.Tensor, u: torch.Tensor, dt: torch.Tensor, a: torch.Tensor,
                               b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """One decode token of Mamba-1's selective scan for N requests (see
    :meth:`engine.ops.Ops.selective_decode`), in torch's batched ops: the decays, the
    ``dt u B`` outer product, read against C."""
    state.mul_(torch.exp(dt[:, :, None] * a)).add_((dt * u)[:, :, None] * b[:, None, :])
    return (state @ c[:, :, None]).squeeze(-1) + d * u


__all__ = ["conv_decode_reference", "delta_rule_decode_reference", "selective_decode_reference",
           "ssd_decode_reference"]
