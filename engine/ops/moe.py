"""The grouped expert computation of a mixture-of-experts MLP, in plain torch.

Each of ``T`` tokens is routed to ``k`` experts with a weight each. Instead of running every
expert on every token (dense) or each token through its ``k`` experts one by one, the
``T * k`` (token, slot) pairs are sorted by expert, so each expert that received tokens
runs two matmuls over one contiguous group of rows and no other expert's weights are read::

    topk_ids  [[2, 0],        pairs sorted by expert   expert 0: rows of pairs 1, 3
               [2, 3]]   ->   (stable argsort)    ->   expert 2: rows of pairs 0, 2
                                                       expert 3: row of pair 3
                                                       experts 1, 4..: nothing, not touched

Every pair's output is scaled by its routing weight and the ``k`` outputs of a token are
summed in fp32. A token routed to one expert twice (possible with hand-made ids; a real
router's top-k never repeats) is two pairs like any others and gets both contributions.

This is the torch reference of ``Ops.fused_moe`` and, being a loop over experts rather
than tokens, also the CPU path past a few tokens (``CpuOps.fused_moe`` runs the same
sorted layout in one C call at decode sizes). The Triton kernel (``engine.ops.triton.fused_moe``) runs
the same sorted layout as one grouped GEMM launch per projection.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """``(order, counts)``: the flat pair indices sorted by expert (stable, so a group keeps
    token order) and how many pairs each expert received (a host list: one sync per call)."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts.tolist()


@dataclasses.dataclass(frozen=True, slots=True)
class ClampedSwiglu:
    """gpt-oss's expert activation, in place of ``silu(gate) * up``: the gate clamped
    above and the up projection both ways at ``limit``, then
    ``(up + 1) * gate * sigmoid(alpha * gate)``; with the gate/up biases ``b13``
    [E, 2 * inter] (gate's then up's, as the weight rows) added to each expert's first
    projection."""

    b13: torch.Tensor
    alpha: float
    limit: float

    def __call__(self, h: torch.Tensor, inter: int) -> torch.Tensor:
        gate = h[:, :inter].clamp(max=self.limit)
        up = h[:, inter:].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


@dataclasses.dataclass(frozen=True, slots=True)
class SquaredRelu:
    """Nemotron 3's experts, in place of the gated ``silu(gate) * up``: no gate at all, the
    first projection's rows (``w13`` [E, inter, in]) are the up projection's alone, and
    the activation is ``relu(up) ** 2``."""

    b13: None = None

    def __call__(self, h: torch.Tensor, inter: int) -> torch.Tensor:
        return torch.square(F.relu(h))


# What an expert runs between its two projections, where it is not the SiLU-gated MLP.
ExpertActivation = ClampedSwiglu | SquaredRelu


def expert_weight(w, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e``'s ``[rows, in]`` weight of a stack: a dense stack's own, or one kept in
    blocks (:class:`engine.ops.quant.QuantizedExperts`, known here by its ``dense``:
    importing it would cycle through the CPU package) dequantized into ``dtype``."""
    dense = getattr(w, "dense", None)
    return w[e] if dense is None else dense(e, dtype)


def fused_moe_reference(
    x: torch.Tensor,  # [T, hidden]
    w13: torch.Tensor,  # [E, 2 * inter, hidden]: each expert's gate rows then up rows (or QuantizedExperts)
    w2: torch.Tensor,  # [E, hidden, inter] (or QuantizedExperts)
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int64
    activation: ExpertActivation | None = None,
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with
    ``e = topk_ids[t, j]``, for every token ``t``; returned in ``x.dtype``. ``activation``:
    gpt-oss's biased, clamped one instead (:class:`ClampedSwiglu`), or Nemotron 3's
    ungated squared ReLU (:class:`SquaredRelu`)."""
    tokens, k = topk_ids.shape
    hidden = x.shape[-1]
    inter = w2.shape[-1]
    order, counts = sort_by_expert(topk_ids, w13.shape[0])
    rows = x.index_select(0, order // k)  # [T * k, hidden]: pair rows in expert order
    out_sorted = torch.empty((tokens * k, hidden), dtype=x.dtype, device=x.device)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue  # an expert that received no token: its weights are never read
        if activation is None:
            h = F.linear(rows[start : start + n], expert_weight(w13, expert, x.dtype))
            act = F.silu(h[:, :inter]) * h[:, inter:]
        else:
            bias = None if activation.b13 is None else activation.b13[expert]
            act = activation(F.linear(rows[start : start + n], expert_weight(w13, expert, x.dtype), bias), inter)
        out_sorted[start : start + n] = F.linear(act, expert_weight(w2, expert, x.dtype))
        start += n
    return combine(out_sorted, order, topk_weights)


def combine(out_sorted: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Each token's ``k`` pair outputs (given in expert order) scaled and summed in fp32."""
    tokens, k = topk_weights.shape
    pairs = torch.empty_like(out_sorted)
    pairs.index_copy_(0, order, out_sorted)  # back to pair order: token * k + slot
    weighted = pairs.view(tokens, k, -1).float() * topk_weights.unsqueeze(-1).float()
    return weighted.sum(1).to(out_sorted.dtype)


__all__ = ["ClampedSwiglu", "ExpertActivation", "SquaredRelu", "combine", "expert_weight", "fused_moe_reference",
           "sort_by_expert"]
