"""The Mamba-2 mixer of a hybrid decoder's Mamba layers (Granite 4.0's "h" models), over
the per-request recurrent states the runner keeps (engine.models.mamba_config).

A step's tokens arrive as the flat varlen batch every layer takes. Each request owns a
state slot (``AttentionMetadata.state_slots``): row ``slot`` of this layer's two state
tensors::

    conv_state [slots, conv_dim, d_conv - 1]   the convolution's last inputs (model dtype)
    ssm_state  [slots, n_heads, head_dim, d_state]   fp32

A request whose chunk starts at position 0 starts from zero states (a new request, or one
preempted and recomputed); any later chunk continues from its slot. Decode rows (one token
on a context) are updated together, one batched op each, in place where their slots run
in order. A prompt chunk runs the convolution over its tokens and the SSM as the
state-space dual does it: in blocks of :data:`SCAN_BLOCK` tokens, all blocks at once,
within a block as a masked, decayed ``C B^T`` product (an attention-like matrix, one a
group of heads), across blocks through the state carried from one to the next.

The mixer, with ``x``, ``B``, ``C`` the convolved and SiLU'd channels, per head ``h``::

    dt = clamp(softplus(dt_raw + dt_bias))            A = -exp(A_log)
    state = exp(dt A) state + dt x B^T                 y = state C + D x
    out = out_proj(rms_norm_grouped(y * silu(z)) * norm_weight)

Falcon-H1's mixers scale in_proj's output by a factor for each of its parts
(``MambaConfig.in_multipliers``) and gate ``y`` without a norm, or norm it before the
gate (``MambaConfig.gated_norm``, ``norm_before_gate``).
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
from engine.models.layers.shard import shard_range
from engine.models.mamba_config import MambaConfig
from engine.ops import AttentionMetadata
from engine.ops.recurrent_reference import MambaDecodeSpec, gated_rms_norm_reference
from engine.parallel import SINGLE

# Tokens of a prompt chunk's scan block: its [heads, block, block] decay matrix is the
# quadratic part of the work (smaller blocks cost less of it and more of the state's
# carry from block to block).
SCAN_BLOCK = 64


def mamba_weight_names(config: MambaConfig, prefix: str, module: str = "mamba") -> list[str]:
    """The checkpoint tensors of one Mamba layer's mixer under ``prefix`` ("model.layers.N.")
    and ``module`` (Granite's "mamba", Nemotron-H's "mixer")."""
    p = prefix + module + "."
    names = [p + "in_proj.weight"]
    if config.proj_bias:
        names.append(p + "in_proj.bias")
    names.append(p + "conv1d.weight")
    if config.conv_bias:
        names.append(p + "conv1d.bias")
    names += [p + "dt_bias", p + "A_log", p + "D", *([p + "norm.weight"] if config.gated_norm else []),
              p + "out_proj.weight"]
    if config.proj_bias:
        names.append(p + "out_proj.bias")
    return names


@dataclasses.dataclass(slots=True)
class MambaMixer:
    """One Mamba-2 layer's weights (the module docstring's mixer)."""

    config: MambaConfig
    in_proj: Any  # Linear: [in_proj_size, hidden]
    conv_weight: torch.Tensor  # [conv_dim, d_conv] fp32
    conv_bias: torch.Tensor | None  # [conv_dim] fp32
    dt_bias: torch.Tensor  # [n_heads] fp32
    a: torch.Tensor  # [n_heads] fp32: -exp(A_log)
    d: torch.Tensor  # [n_heads] fp32
    norm: torch.Tensor | None  # [d_inner], model dtype; None without a gated norm
    out_proj: Any  # Linear (a RowParallel over tensor-parallel ranks): [hidden, d_inner]
    eps: float
    ops: Any  # the state-space model's decode step (engine.ops.Ops.ssd_decode)
    tp: Any = SINGLE  # the rank's group: a norm group spanning ranks sums its squares over them
    # in_proj's output scale, a value per row (Falcon-H1's ssm_multipliers), model dtype; or None.
    scale: torch.Tensor | None = None
    # The gated norm's form and widths (this rank's), and its weight as fp32: made once.
    spec: MambaDecodeSpec = dataclasses.field(init=False)
    norm_fp32: torch.Tensor | None = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        c = self.config
        self.spec = MambaDecodeSpec(
            d_inner=c.d_inner, n_groups=c.n_groups, d_state=c.d_state, dt_min=c.dt_min, dt_max=c.dt_max,
            eps=self.eps, gated_norm=c.gated_norm, norm_before_gate=c.norm_before_gate,
            weight_fp32=c.norm_weight_fp32, norm_dtype=torch.float32 if self.norm is None else self.norm.dtype)
        self.norm_fp32 = None if self.norm is None else self.norm.float().contiguous()

    @classmethod
    def build(cls, config: MambaConfig, get: Any, prefix: str, eps: float, make_linear: Any, ops: Any,
              module: str = "mamba") -> MambaMixer:
        """Layer ``prefix``'s mixer (under ``module``) from ``get`` (a ShardedWeights): over
        tensor-parallel ranks, this rank's heads of z, x and dt, of the convolution, dt_bias,
        A_log, D and the norm, its groups of B and C (or, with one group, all of it), and
        out_proj's matching columns."""
        p = prefix + module + "."
        tp = get.tp
        world, rank = tp.world_size, tp.rank
        local = config.local(world)
        d_in, bc, heads = config.d_inner, config.n_groups * config.d_state, config.n_heads

        def part(size: int, split: bool = True) -> list[tuple[int, int]]:
            return [shard_range(size, rank, world)] if split else [(0, size)]

        groups = part(bc, config.n_groups % world == 0)
        x_b_c = dict(sizes=(d_in, bc, bc), spans=[part(d_in), groups, groups])

        def fp32(name: str, **cut: Any) -> torch.Tensor:
            return get.rows(name, **cut).float()

        def bias(name: str, on: bool) -> torch.Tensor | None:
            return get.rows(name, sizes=(d_in, d_in, bc, bc, heads),
                            spans=[part(d_in), part(d_in), groups, groups, part(heads)]) if on else None

        scale = None
        if config.in_multipliers:  # the rank's rows of in_proj, as its weight is cut
            sizes, spans = (d_in, d_in, bc, bc, heads), [part(d_in), part(d_in), groups, groups, part(heads)]
            scale = torch.cat([torch.full((b - a,), m) for m, cut in zip(config.in_multipliers, spans, strict=True)
                               for a, b in cut]).to(device=get.device, dtype=get.dtype)
            assert scale.shape[0] == local.in_proj_size and len(sizes) == 5

        return cls(
            config=local,
            in_proj=make_linear([get.rows(p + "in_proj.weight", sizes=(d_in, d_in, bc, bc, heads),
                                          spans=[part(d_in), part(d_in), groups, groups, part(heads)])],
                                bias(p + "in_proj.bias", config.proj_bias)),
            conv_weight=fp32(p + "conv1d.weight", **x_b_c).reshape(local.conv_dim, config.d_conv),
            conv_bias=fp32(p + "conv1d.bias", **x_b_c) if config.conv_bias else None,
            dt_bias=fp32(p + "dt_bias"),
            a=-torch.exp(fp32(p + "A_log")),
            d=fp32(p + "D"),
            norm=get.rows(p + "norm.weight") if config.gated_norm else None,
            out_proj=get.row_parallel(p + "out_proj.weight") if tp.enabled else make_linear(
                [get(p + "out_proj.weight")], get(p + "out_proj.bias") if config.proj_bias else None),
            eps=eps,
            ops=ops,
            tp=tp,
            scale=scale,
        )

    def __call__(self, x: torch.Tensor, meta: AttentionMetadata, conv_state: torch.Tensor,
                 ssm_state: torch.Tensor) -> torch.Tensor:
        """The mixer's output [T, hidden] for the step's normed hidden states ``x`` [T,
        hidden]; advances each request's states in its slot."""
        c = self.config
        zxbcdt = self.in_proj(x)
        if self.scale is not None:
            zxbcdt = zxbcdt * self.scale
        if c.norm_world == 1 and decode_only(meta):  # one op from in_proj's rows to out_proj's input
            conv, state, in_place = slot_views(conv_state, ssm_state, meta.state_slots, meta.state_slots_host)
            mixed = self.ops.mamba2_decode(zxbcdt, conv, state, self.conv_weight, self.conv_bias, self.dt_bias,
                                           self.a, self.d, self.norm_fp32, self.spec)
            write_back(conv_state, ssm_state, meta.state_slots, conv, state, in_place)
            save_after_decode(meta, (conv_state, ssm_state))
            return self.out_proj(mixed.to(x.dtype))
        z, xbc, dt = zxbcdt.split([c.d_inner, c.conv_dim, c.n_heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias).clamp(c.dt_min, c.dt_max)  # [T, H]
        y = torch.empty(x.shape[0], c.n_heads, c.head_dim, dtype=torch.float32, device=x.device)

        def decode(pick, slots: torch.Tensor, host: tuple[int, ...]) -> torch.Tensor:
            return self._decode(pick(xbc), pick(dt), slots, host, conv_state, ssm_state)

        def chunk(lo: int, hi: int, slot: int, fresh: bool) -> torch.Tensor:
            return self._chunk(xbc[lo:hi], dt[lo:hi], slot, fresh, conv_state, ssm_state)

        mix_by_request(meta, y, decode, chunk, (conv_state, ssm_state))
        return self.out_proj(self._gated_norm(y.reshape(x.shape[0], c.d_inner), z).to(x.dtype))

    def _split(self, xbc: torch.Tensor, per_head: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, H, P] and B and C, fp32: [N, H, d_state] (each group's repeated for its
        heads), or with ``per_head`` false [N, groups, d_state]."""
        c = self.config
        xs, b, cc = xbc.float().split([c.d_inner, c.n_groups * c.d_state, c.n_groups * c.d_state], dim=-1)
        b = b.reshape(-1, c.n_groups, c.d_state)
        cc = cc.reshape(-1, c.n_groups, c.d_state)
        if per_head:
            per = c.n_heads // c.n_groups
            b, cc = b.repeat_interleave(per, dim=1), cc.repeat_interleave(per, dim=1)
        return xs.reshape(-1, c.n_heads, c.head_dim), b, cc

    def _decode(self, xbc: torch.Tensor, dt: torch.Tensor, slots: torch.Tensor, host: tuple[int, ...],
                conv_state: torch.Tensor, ssm_state: torch.Tensor) -> torch.Tensor:
        """One token for each of N requests (slots ``host``, on the device ``slots``): [N, H, P]."""
        conv, state, in_place = slot_views(conv_state, ssm_state, slots, host)  # state [N, H, P, d_state]
        xs, b, cc = self._split(self.ops.conv_decode(conv, xbc, self.conv_weight, self.conv_bias), per_head=False)
        y = self.ops.ssd_decode(state, xs.contiguous(), b.contiguous(), cc.contiguous(), dt.contiguous(), self.a,
                                self.d)
        write_back(conv_state, ssm_state, slots, conv, state, in_place)
        return y

    def _chunk(self, xbc: torch.Tensor, dt: torch.Tensor, slot: int, fresh: bool, conv_state: torch.Tensor,
               ssm_state: torch.Tensor) -> torch.Tensor:
        """A chunk of ``n`` tokens of one request: [n, H, P]."""
        mixed = conv_prompt(conv_state, slot, fresh, xbc, self.conv_weight, self.conv_bias)
        xs, b, cc = self._split(mixed, per_head=False)
        state = torch.zeros_like(ssm_state[slot]) if fresh else ssm_state[slot]  # [H, P, d_state]
        out, ssm_state[slot] = self._scan(xs, dt, b, cc, state)
        return out + self.d[:, None] * xs

    def _scan(self, xs: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, cc: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The SSM over ``n`` tokens (x [n, H, P], dt [n, H], B and C [n, groups, d_state])
        from ``state`` [H, P, d_state]: the outputs [n, H, P] without the D term, and the
        state after them. The tokens go in blocks of ``SCAN_BLOCK`` (the last one padded
        with tokens of dt 0, which change nothing), every block at once: within a block
        the masked, decayed ``C B^T`` scores (a group's, shared by its heads) weigh the
        inputs; each block's own contribution to the state is summed from zero, and a loop
        over the blocks carries the state through them, which each block's outputs then
        read."""
        c = self.config
        n, size, groups, per = xs.shape[0], SCAN_BLOCK, c.n_groups, c.n_heads // c.n_groups
        pad = -n % size
        if pad:
            xs, dt = F.pad(xs, (0, 0, 0, 0, 0, pad)), F.pad(dt, (0, 0, 0, pad))
            b, cc = F.pad(b, (0, 0, 0, 0, 0, pad)), F.pad(cc, (0, 0, 0, 0, 0, pad))
        k = (n + pad) // size
        h, p, d = c.n_heads, c.head_dim, c.d_state
        log_decay = (dt * self.a).view(k, size, h).cumsum(1).transpose(1, 2)  # [k, H, l]: from the block start
        inputs = (xs * dt[:, :, None]).view(k, size, h, p).transpose(1, 2)  # [k, H, l, P]
        bg = b.view(k, size, groups, d).transpose(1, 2)  # [k, G, l, d]
        cg = cc.view(k, size, groups, d).transpose(1, 2)
        causal = torch.ones(size, size, dtype=torch.bool, device=xs.device).tril()
        decay = torch.exp((log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(~causal, float("-inf")))
        weights = decay.view(k, groups, per, size, size) * (cg @ bg.transpose(-1, -2)).unsqueeze(2)
        out = weights.view(k, h, size, size) @ inputs  # [k, H, l, P]
        # Each block's own share of the state, as if it started from zero.
        to_end = torch.exp(log_decay[..., -1:] - log_decay)  # [k, H, l]
        own = (inputs * to_end[..., None]).transpose(-1, -2).reshape(k, groups, per, p, size) @ bg.unsqueeze(2)
        own = own.view(k, h, p, d)
        through = torch.exp(log_decay[..., -1])  # [k, H]: a whole block's decay
        starts = []
        for i in range(k):
            starts.append(state)
            state = state * through[i][:, None, None] + own[i]
        start = torch.stack(starts).view(k, groups, per, p, d)  # each block's incoming state
        carried = (start @ cg.transpose(-1, -2).unsqueeze(2)).view(k, h, p, size)  # [k, H, P, l]
        out = out + carried.transpose(-1, -2) * torch.exp(log_decay)[..., None]
        return out.transpose(1, 2).reshape(k * size, h, p)[:n], state

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMS norm over each group's channels of ``y * silu(z)`` (fp32), times the weight
        in the model dtype (as transformers rounds it); or as ``MambaConfig`` says, of
        ``y`` before the gate, the weight times the fp32 values, or no norm at all
        (engine.ops.recurrent_reference.gated_rms_norm_reference); a group spanning
        tensor-parallel ranks sums its squares over them."""
        c = self.config
        if c.norm_world == 1 or not c.gated_norm:
            return gated_rms_norm_reference(y, z, self.norm_fp32, self.spec)
        gate = F.silu(z.float())
        gated = (y if c.norm_before_gate else y * gate).reshape(y.shape[0], c.n_groups, -1)
        squares = self.tp.all_reduce(gated.pow(2).sum(-1, keepdim=True))  # one group over every rank's heads
        normed = (gated * torch.rsqrt(squares / (gated.shape[-1] * c.norm_world) + self.eps)).reshape(y.shape[0], c.d_inner)
        assert self.norm is not None
        out = self.norm.float() * normed if c.norm_weight_fp32 else self.norm * normed.to(self.norm.dtype)
        return out * gate if c.norm_before_gate else out


__all__ = ["SCAN_BLOCK", "MambaMixer", "mamba_weight_names"]
