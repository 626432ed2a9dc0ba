"""The selective-scan mixer of Mamba-1 (``MambaForCausalLM``, ``FalconMambaForCausalLM``),
over the per-request recurrent states the runner keeps (engine.models.mamba_config.Mamba1Config)::

    conv_state [slots, d_inner, d_conv - 1]   the convolution's last inputs (model dtype)
    ssm_state  [slots, d_inner, d_state]      fp32

For a token, with ``u`` the convolved and SiLU'd half of in_proj's output and ``z`` the
other half::

    dt_r, B, C = split(x_proj(u))                 (FalconMamba: each RMS-normed, no weight)
    dt = softplus(dt_proj(dt_r))                  [d_inner]
    state = exp(dt A) state + (dt u) B^T          A = -exp(A_log): [d_inner, d_state]
    y = state C + D u;   out = out_proj(y * silu(z))

A channel's state decays by a rate of its own for each state value, so the state-space
dual's block form (layers/mamba.py) has no shared decay to factor: a prompt chunk computes
every token's decay and input at once, in blocks of :data:`SCAN_TOKENS` tokens, and the
recurrence steps through a block's tokens one multiply-add each. Decode rows, one token on
a context, are updated together. The runner's slots, checkpoints and decode-row grouping
are those of layers/recurrent.py.

Over tensor-parallel ranks each rank keeps ``d_inner / world`` channels: their rows of
in_proj (x and z), of the convolution, dt_proj, A and D, and their states. x_proj and
out_proj read those channels as row-parallel projections, so dt's bottleneck, B and C are
summed over the ranks, every rank selecting with all of them, and the output is whole.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from engine.models.layers.recurrent import (
    conv_prompt,
    decode_only,
    mix_by_request,
    save_after_decode,
    slot_views,
    write_back,
)
from engine.models.mamba_config import Mamba1Config
from engine.ops import AttentionMetadata

# Tokens of a prompt chunk whose decays and inputs are computed at once ([tokens, d_inner,
# d_state] fp32 each: 32 MiB at Mamba-2.8B's 5,120 x 16 and 128 tokens).
SCAN_TOKENS = 128


def mamba1_weight_names(config: Mamba1Config, prefix: str) -> list[str]:
    """The checkpoint tensors of one layer's mixer under ``prefix`` ("model.layers.N.")."""
    p = prefix + config.module + "."
    names = [p + "in_proj.weight", p + "conv1d.weight", p + "x_proj.weight", p + "dt_proj.weight",
             p + "dt_proj.bias", p + "A_log", p + "D", p + "out_proj.weight"]
    if config.proj_bias:
        names += [p + "in_proj.bias", p + "out_proj.bias"]
    if config.conv_bias:
        names.append(p + "conv1d.bias")
    if config.bcdt_norm_weights:
        names += [p + f"{n}_layernorm.weight" for n in ("dt", "b", "c")]
    return names


@dataclasses.dataclass(slots=True)
class Mamba1Mixer:
    """One layer's selective-scan mixer (the module docstring's)."""

    config: Mamba1Config
    in_proj: Any  # Linear: [2 d_inner, hidden] (x, then z)
    conv_weight: torch.Tensor  # [d_inner, d_conv] fp32
    conv_bias: torch.Tensor | None  # [d_inner] fp32
    x_proj: Any  # Linear: [dt_rank + 2 d_state, d_inner]
    dt_proj: Any  # Linear: [d_inner, dt_rank], no bias (added in fp32)
    dt_bias: torch.Tensor  # [d_inner] fp32
    a: torch.Tensor  # [d_inner, d_state] fp32: -exp(A_log)
    d: torch.Tensor  # [d_inner] fp32
    out_proj: Any  # Linear: [hidden, d_inner]
    ops: Any  # the convolution's and the scan's decode tokens (Ops.conv_decode, Ops.selective_decode)
    # Jamba's norms of dt's bottleneck, B and C (model dtype), or None.
    norms: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, config: Mamba1Config, get: Any, prefix: str, make_linear: Any, ops: Any) -> Mamba1Mixer:
        """Layer ``prefix``'s mixer from ``get`` (a ShardedWeights): over tensor-parallel
        ranks, this rank's channels of in_proj's x and z, of the convolution, dt_proj, dt's
        bias, A_log and D; x_proj and out_proj row-parallel over those channels (x_proj's
        dt bottleneck, B and C summed over the ranks: every rank selects with all of them)."""
        p = prefix + config.module + "."
        d, tp = config.d_inner, get.tp

        def fp32(name: str) -> torch.Tensor:
            return get.rows(name).float()

        def row_parallel(name: str, bias: bool = False) -> Any:
            return get.row_parallel(p + name + ".weight") if tp.enabled else make_linear(
                [get(p + name + ".weight")], get(p + name + ".bias") if bias else None)

        local = config.local(tp.world_size)
        return cls(
            config=local,
            in_proj=make_linear([get.rows(p + "in_proj.weight", sizes=(d, d))],
                                get.rows(p + "in_proj.bias", sizes=(d, d)) if config.proj_bias else None),
            conv_weight=fp32(p + "conv1d.weight").reshape(local.d_inner, config.d_conv),
            conv_bias=fp32(p + "conv1d.bias") if config.conv_bias else None,
            x_proj=row_parallel("x_proj"),
            dt_proj=make_linear([get.rows(p + "dt_proj.weight")]),
            dt_bias=fp32(p + "dt_proj.bias"),
            a=-torch.exp(fp32(p + "A_log")),
            d=fp32(p + "D"),
            out_proj=row_parallel("out_proj", config.proj_bias),
            ops=ops,
            norms=tuple(get(p + f"{n}_layernorm.weight") for n in ("dt", "b", "c"))  # type: ignore[arg-type]
            if config.bcdt_norm_weights else None,
        )

    def __call__(self, x: torch.Tensor, meta: AttentionMetadata, conv_state: torch.Tensor,
                 ssm_state: torch.Tensor) -> torch.Tensor:
        """The mixer's output [T, hidden] for the step's normed hidden states ``x`` [T,
        hidden]; advances each request's states in its slot."""
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        if decode_only(meta):  # after the projections, one op: dt, the scan's step, the gate
            conv, state, in_place = slot_views(conv_state, ssm_state, meta.state_slots, meta.state_slots_host)
            u = self.ops.conv_decode(conv, xs, self.conv_weight, self.conv_bias).to(x.dtype)
            dt_r, b, cc = self._projected(u)
            gated = self.ops.mamba1_decode(state, u, self.dt_proj(dt_r), self.dt_bias, self.a, b, cc, self.d, z)
            write_back(conv_state, ssm_state, meta.state_slots, conv, state, in_place)
            save_after_decode(meta, (conv_state, ssm_state))
            return self.out_proj(gated.to(x.dtype))
        y = torch.empty(x.shape[0], self.config.d_inner, dtype=torch.float32, device=x.device)

        def decode(pick, slots: torch.Tensor, host: tuple[int, ...]) -> torch.Tensor:
            conv, state, in_place = slot_views(conv_state, ssm_state, slots, host)  # state [N, D, S]
            u = self.ops.conv_decode(conv, pick(xs), self.conv_weight, self.conv_bias).to(x.dtype)
            dt, b, c = self._select(u)
            out = self.ops.selective_decode(state, u.float(), dt.contiguous(), self.a, b.contiguous(), c.contiguous(),
                                            self.d)
            write_back(conv_state, ssm_state, slots, conv, state, in_place)
            return out

        def chunk(lo: int, hi: int, slot: int, fresh: bool) -> torch.Tensor:
            u = conv_prompt(conv_state, slot, fresh, xs[lo:hi], self.conv_weight, self.conv_bias).to(x.dtype)
            state = torch.zeros_like(ssm_state[slot]) if fresh else ssm_state[slot]
            out = torch.empty(hi - lo, self.config.d_inner, dtype=torch.float32, device=x.device)
            for start in range(0, hi - lo, SCAN_TOKENS):
                part = u[start:start + SCAN_TOKENS]
                out[start:start + part.shape[0]], state = self._scan(part, state)
            ssm_state[slot] = state
            return out

        mix_by_request(meta, y, decode, chunk, (conv_state, ssm_state))
        return self.out_proj((y * F.silu(z.float())).to(x.dtype))

    def _projected(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x_proj's dt bottleneck, B and C for the convolved rows ``u`` (model dtype), normed
        where the family norms them, in the model dtype, as transformers computes them."""
        c = self.config
        dt_r, b, cc = self.x_proj(u).split([c.dt_rank, c.d_state, c.d_state], dim=-1)
        if self.norms is not None:  # Jamba's: Llama's norm, the weight times the rounded row
            assert c.bcdt_norm_eps is not None
            dt_r, b, cc = (w * _rms(t, c.bcdt_norm_eps) for w, t in zip(self.norms, (dt_r, b, cc), strict=True))
        elif c.bcdt_norm_eps is not None:  # FalconMamba's weightless norms, each rounded back
            dt_r, b, cc = (_rms(t, c.bcdt_norm_eps) for t in (dt_r, b, cc))
        return dt_r, b, cc

    def _select(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dt [N, d_inner], B and C [N, d_state] (fp32) for the convolved rows ``u``
        (model dtype): dt_proj in the model dtype, its bias and the softplus in fp32."""
        dt_r, b, cc = self._projected(u)
        dt = F.softplus(self.dt_proj(dt_r).float() + self.dt_bias)
        return dt, b.float(), cc.float()

    def _scan(self, u: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The SSM over ``n`` tokens ``u`` [n, d_inner] from ``state`` [d_inner, d_state]:
        the outputs [n, d_inner] fp32 and the state after them. Every token's decay and
        input at once, then one multiply-add a token."""
        dt, b, c = self._select(u)
        uf = u.float()
        decay = torch.exp(dt[:, :, None] * self.a)  # [n, D, S]
        states = (dt * uf)[:, :, None] * b[:, None, :]  # each token's input, then its state
        for t in range(u.shape[0]):
            state = torch.addcmul(states[t], decay[t], state, out=states[t])
        return (states @ c[:, :, None]).squeeze(-1) + self.d * uf, state


def _rms(t: torch.Tensor, eps: float) -> torch.Tensor:
    """``t`` RMS-normed over its last dimension in fp32, in its own dtype."""
    f = t.float()
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(t.dtype)


__all__ = ["SCAN_TOKENS", "Mamba1Mixer", "mamba1_weight_names"]
