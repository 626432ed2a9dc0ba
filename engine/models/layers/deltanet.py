"""The Gated DeltaNet mixer of Qwen3.5's "linear_attention" layers, over the per-request
states the runner keeps (engine.models.deltanet_config; the request split, slots and
convolution of ``layers/recurrent.py``).

Per value head ``h``, with ``q`` and ``k`` the convolved, SiLU'd, L2-normed query and key
of its key head (``q`` also scaled by ``key_head_dim ** -0.5``) and ``S`` the
``key_head_dim x value_head_dim`` state::

    g = -exp(A_log) softplus(a + dt_bias)         beta = sigmoid(b)
    S = exp(g) S                                   (decay)
    S = S + k (beta (v - S^T k))^T                 (the delta rule: write what S misses)
    o = S^T q
    out = out_proj(rms_norm(o) * norm_weight * silu(z))    (each head's norm, then the gate)

Decode rows take that step one token each, batched. A prompt chunk takes it in blocks of
:data:`CHUNK` tokens, as the chunked (WY) form does: within a block, the delta rule's
updates are folded into one triangular solve (``(I + A)^-1`` with ``A`` the strictly lower
``beta_i k_i . k_j`` decayed from ``j`` to ``i``) giving the block's values and decayed keys
before the incoming state's correction, every block at once; a loop over the blocks then
reads and carries the state.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from engine.models.deltanet_config import DeltaNetConfig
from engine.models.layers.linear import is_quantized
from engine.models.layers.recurrent import (
    conv_prompt,
    mix_by_request,
    slot_views,
    write_back,
)
from engine.models.layers.shard import shard_range
from engine.ops import AttentionMetadata

# Tokens of a prompt chunk's block (the triangular solve is block by block).
CHUNK = 64


def deltanet_weight_names(config: DeltaNetConfig, prefix: str) -> list[str]:
    """The checkpoint tensors of one Gated DeltaNet layer under ``prefix`` ("model.layers.N.")."""
    p = prefix + "linear_attn."
    projections = (("in_proj_qkvz.weight", "in_proj_ba.weight") if config.grouped else
                   ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"))
    return [p + n for n in (*projections, "conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")]


def _grouped_projection(config: DeltaNetConfig, get: Any, p: str) -> list[torch.Tensor]:
    """Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba``, whose rows go by key head (each
    head's q, k, then its value heads' v and z; its value heads' b, then a), as this rank's
    ``[q; k; v; z; b; a]`` rows, each part in head order."""
    tp = get.tp
    heads = range(*shard_range(config.num_k_heads, tp.rank, tp.world_size))
    dk, per = config.k_head_dim, config.num_v_heads // config.num_k_heads
    dv = per * config.v_head_dim  # a key head's value rows
    block = 2 * dk + 2 * dv
    qkvz = [(0, dk), (dk, 2 * dk), (2 * dk, 2 * dk + dv), (2 * dk + dv, block)]
    ba = [(0, per), (per, 2 * per)]

    def rows(name: str, width: int, start: int, stop: int) -> torch.Tensor:
        return get.pick_rows(name, [(h * width + start, h * width + stop) for h in heads])

    return ([rows(p + "in_proj_qkvz.weight", block, a, b) for a, b in qkvz]
            + [rows(p + "in_proj_ba.weight", 2 * per, a, b) for a, b in ba])


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


@dataclasses.dataclass(slots=True)
class DeltaNetMixer:
    """One Gated DeltaNet layer's weights (the module docstring's mixer)."""

    config: DeltaNetConfig
    in_proj: Any  # Linear: [qkv; z; b; a] rows, one matmul ([qkv; z] when ba_proj is set)
    conv_weight: torch.Tensor  # [conv_dim, d_conv] fp32
    dt_bias: torch.Tensor  # [num_v_heads] fp32
    a: torch.Tensor  # [num_v_heads] fp32: -exp(A_log)
    norm: torch.Tensor  # [v_head_dim], model dtype
    out_proj: Any
    eps: float
    ops: Any  # the delta rule's decode step (engine.ops.Ops.delta_rule_decode)
    # [b; a] apart, where a GGUF keeps [qkv; z] in blocks and b, a dense (or the other way):
    # one matmul over both would dequantize the blocks.
    ba_proj: Any = None

    @classmethod
    def build(cls, config: DeltaNetConfig, get: Any, prefix: str, eps: float, make_linear: Any,
              ops: Any) -> DeltaNetMixer:
        """Layer ``prefix``'s mixer from ``get`` (a ShardedWeights): over tensor-parallel
        ranks, this rank's key heads of q and k, value heads of v, z, b and a (the
        convolution, dt_bias and A_log alike), and out_proj's matching columns."""
        p = prefix + "linear_attn."
        qkv = dict(sizes=(config.key_dim, config.key_dim, config.value_dim))
        local = config.local(get.tp.world_size)
        parts = (_grouped_projection(config, get, p) if config.grouped else
                 [get.rows(p + "in_proj_qkv.weight", **qkv)] + [get.rows(p + f"in_proj_{n}.weight") for n in "zba"])
        apart = len({is_quantized(w) for w in parts[:2]} | {is_quantized(w) for w in parts[2:]}) > 1
        return cls(
            config=local,
            in_proj=make_linear(parts[:2] if apart else parts),
            ba_proj=make_linear(parts[2:]) if apart else None,
            conv_weight=get.rows(p + "conv1d.weight", **qkv).float().reshape(local.conv_dim, config.d_conv),
            dt_bias=get.rows(p + "dt_bias").float(),
            a=-torch.exp(get.rows(p + "A_log").float()),
            norm=get(p + "norm.weight"),
            out_proj=get.row_parallel(p + "out_proj.weight"),
            eps=eps,
            ops=ops,
        )

    def __call__(self, x: torch.Tensor, meta: AttentionMetadata, conv_state: torch.Tensor,
                 state: torch.Tensor) -> torch.Tensor:
        """The mixer's output [T, hidden] for the step's normed hidden states ``x``;
        advances each request's states in its slot."""
        c = self.config
        if self.ba_proj is None:
            qkv, z, b, a = self.in_proj(x).split([c.conv_dim, c.value_dim, c.num_v_heads, c.num_v_heads], dim=-1)
        else:
            qkv, z = self.in_proj(x).split([c.conv_dim, c.value_dim], dim=-1)
            b, a = self.ba_proj(x).split([c.num_v_heads, c.num_v_heads], dim=-1)
        beta = torch.sigmoid(b).float()  # [T, Hv]
        g = self.a * F.softplus(a.float() + self.dt_bias)  # [T, Hv]: the log decay
        o = torch.empty(x.shape[0], c.num_v_heads, c.v_head_dim, dtype=torch.float32, device=x.device)

        def decode(pick, slots: torch.Tensor, host: tuple[int, ...]) -> torch.Tensor:
            return self._decode(pick(qkv), pick(g), pick(beta), slots, host, conv_state, state)

        def chunk(lo: int, hi: int, slot: int, fresh: bool) -> torch.Tensor:
            return self._chunk(qkv[lo:hi], g[lo:hi], beta[lo:hi], slot, fresh, conv_state, state)

        mix_by_request(meta, o, decode, chunk, (conv_state, state))
        return self.out_proj(self._gated_norm(o.to(x.dtype), z))

    def _split(self, mixed: torch.Tensor, repeat: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q and k [N, Hv, Dk] (L2-normed, q scaled; a key head's repeated for its value
        heads, or [N, Hk, Dk] without ``repeat``) and v [N, Hv, Dv], fp32, from the
        convolved channels."""
        c = self.config
        q, k, v = mixed.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
        per = c.num_v_heads // c.num_k_heads if repeat else 1
        q = _l2norm(q.reshape(-1, c.num_k_heads, c.k_head_dim)) * c.k_head_dim**-0.5
        k = _l2norm(k.reshape(-1, c.num_k_heads, c.k_head_dim))
        if per > 1 and c.tiled:  # value head j reads key head j % num_k_heads
            q, k = q.repeat(1, per, 1), k.repeat(1, per, 1)
        elif per > 1:  # value head j reads key head j // per
            q, k = q.repeat_interleave(per, dim=1), k.repeat_interleave(per, dim=1)
        return q, k, v.reshape(-1, c.num_v_heads, c.v_head_dim)

    def _decode(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor,
                host: tuple[int, ...], conv_state: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """One token for each of N requests: [N, Hv, Dv]."""
        conv, s, in_place = slot_views(conv_state, state, slots, host)  # s [N, Hv, Dk, Dv]
        q, k, v = self._split(self.ops.conv_decode(conv, qkv, self.conv_weight, None), repeat=False)
        out = self.ops.delta_rule_decode(s, q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
                                         beta.contiguous(), self.config.tiled)
        write_back(conv_state, state, slots, conv, s, in_place)
        return out

    def _chunk(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slot: int, fresh: bool,
               conv_state: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """A chunk of ``n`` tokens of one request: [n, Hv, Dv]."""
        q, k, v = self._split(conv_prompt(conv_state, slot, fresh, qkv, self.conv_weight, None))
        start = torch.zeros_like(state[slot]) if fresh else state[slot]
        out, state[slot] = self._scan(q, k, v, g, beta, start)
        return out

    def _scan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The delta rule over ``n`` tokens (q, k [n, H, Dk], v [n, H, Dv], g and beta [n,
        H]) from the state ``s`` [H, Dk, Dv]: the outputs [n, H, Dv] and the state after.
        The tokens go in blocks of :data:`CHUNK`, the last padded with tokens of zero key,
        value, beta and log decay, which change nothing."""
        n, size = q.shape[0], CHUNK
        pad = -n % size
        if pad:
            q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
            g, beta = F.pad(g, (0, 0, 0, pad)), F.pad(beta, (0, 0, 0, pad))
        blocks = (n + pad) // size

        def by_block(t: torch.Tensor) -> torch.Tensor:  # [n, H, ...] -> [blocks, H, size, ...]
            return t.reshape(blocks, size, *t.shape[1:]).transpose(1, 2)

        q, k, v, g, beta = map(by_block, (q, k, v, g, beta))
        log_decay = g.cumsum(-1)  # [blocks, H, size]: from the block start
        causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
        decay = torch.exp((log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(~causal, float("-inf")))
        k_beta = k * beta[..., None]
        # (I + A) with A the strictly lower, decayed beta_i k_i . k_j; the solve reads the
        # lower triangle with a unit diagonal.
        system = (k_beta @ k.transpose(-1, -2)) * decay
        values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
        keys = torch.linalg.solve_triangular(system, k_beta * torch.exp(log_decay)[..., None], upper=False,
                                             unitriangular=True)
        scores = (q @ k.transpose(-1, -2)) * decay  # [blocks, H, size, size]
        q = q * torch.exp(log_decay)[..., None]
        k = k * torch.exp(log_decay[..., -1:] - log_decay)[..., None]
        through = torch.exp(log_decay[..., -1])[..., None, None]  # [blocks, H, 1, 1]
        out = torch.empty_like(values)
        for i in range(blocks):
            fresh = values[i] - keys[i] @ s  # what the incoming state leaves for the block to write
            out[i] = q[i] @ s + scores[i] @ fresh
            s = s * through[i] + k[i].transpose(-1, -2) @ fresh
        return out.transpose(1, 2).reshape(blocks * size, *out.shape[1:2], out.shape[-1])[:n], s

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Each head's RMS norm (fp32), times the weight in the model dtype, times SiLU of
        the gate z (fp32), rounded once to the dtype: transformers' order."""
        c = self.config
        heads = o.reshape(o.shape[0], c.num_v_heads, c.v_head_dim).float()
        normed = (heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + self.eps)).to(o.dtype)
        gated = (self.norm * normed) * F.silu(z.reshape(heads.shape).float())
        return gated.to(o.dtype).reshape(o.shape[0], c.value_dim)


__all__ = ["CHUNK", "DeltaNetMixer", "deltanet_weight_names"]
