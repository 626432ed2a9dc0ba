"""The ``Ops`` protocol on Triton kernels (CUDA; CPU only under ``TRITON_INTERPRET=1``).

Every op has the signature and the numerics of the torch reference
(``engine.ops.reference.TorchOps``); the kernels live in ``engine.ops.triton``, one module
per family. No op falls back to torch: each one is a single pass that replaces several torch
kernels and their temporaries (see each module's docstring for the layout and the reason).

Importing this module decorates the kernels; set ``TRITON_INTERPRET=1`` before that if the
kernels are to run on CPU tensors (tests do; see ``engine/ops/triton/__init__.py``).
"""

from __future__ import annotations

import torch

from engine.ops.base import AttentionMetadata, KVCache, LoraSegments
from engine.ops.moe import ExpertActivation, fused_moe_reference
from engine.ops.recurrent_reference import (
    MambaDecodeSpec,
    conv_decode_reference,
    delta_rule_decode_reference,
    mamba1_decode_reference,
    mamba2_decode_reference,
    selective_decode_reference,
    ssd_decode_reference,
)
from engine.ops.reference import encoder_attention_reference
from engine.ops.triton import (
    attention_decode,
    attention_prefill,
    fused_moe,
    kv_cache,
    lora,
    norm_rope,
    sampling,
)
from engine.structured.bitmask import apply_bitmask


class TritonOps:
    """Triton implementation of :class:`engine.ops.Ops`; stateless, safe to share."""

    name = "triton"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return norm_rope.rms_norm(x, weight, eps)

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass: ``x += residual`` (into ``x``'s storage, as the reference), then RMSNorm."""
        return norm_rope.fused_add_rms_norm(x, residual, weight, eps)

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """In place on ``query`` and ``key`` (which may be views of a fused QKV output)."""
        return norm_rope.rotary_embedding(positions, query, key, cos_sin_cache)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return norm_rope.silu_and_mul(x)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return norm_rope.gelu_tanh_and_mul(x)

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: KVCache,
        v_cache: KVCache,
        slot_mapping: torch.Tensor,
    ) -> None:
        kv_cache.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

    def paged_attention_decode(
        self,
        query: torch.Tensor,
        k_cache: KVCache,
        v_cache: KVCache,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        seq_lens_host: tuple[int, ...],
        *,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Flash-decoding: the context is split across programs when the batch is small."""
        return attention_decode.paged_attention_decode(
            query, k_cache, v_cache, block_tables, seq_lens, scale, seq_lens_host,
            window=window, softcap=softcap, sinks=sinks,
        )

    def encoder_attention(self, qkv: torch.Tensor, lens: tuple[int, ...], num_heads: int,
                          head_dim: int) -> torch.Tensor:
        """torch's SDPA per sequence (its flash kernel on CUDA): no Triton kernel of its own."""
        return encoder_attention_reference(qkv, lens, num_heads, head_dim)

    def delta_rule_decode(self, state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          g: torch.Tensor, beta: torch.Tensor, tiled: bool) -> torch.Tensor:
        """torch's batched ops: no Triton kernel of its own."""
        return delta_rule_decode_reference(state, q, k, v, g, beta, tiled)

    def conv_decode(self, conv: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
        """torch's ops: no Triton kernel of its own."""
        return conv_decode_reference(conv, x, weight, bias)

    def ssd_decode(self, state: torch.Tensor, x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor,
                   a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """torch's batched ops: no Triton kernel of its own."""
        return ssd_decode_reference(state, x, b, c, dt, a, d)

    def mamba2_decode(self, zx: torch.Tensor, conv: torch.Tensor, state: torch.Tensor, conv_weight: torch.Tensor,
                      conv_bias: torch.Tensor | None, dt_bias: torch.Tensor, a: torch.Tensor, d: torch.Tensor,
                      norm: torch.Tensor | None, spec: MambaDecodeSpec) -> torch.Tensor:
        return mamba2_decode_reference(self, zx, conv, state, conv_weight, conv_bias, dt_bias, a, d, norm, spec)

    def mamba1_decode(self, state: torch.Tensor, u: torch.Tensor, dt_raw: torch.Tensor, dt_bias: torch.Tensor,
                      a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor,
                      z: torch.Tensor) -> torch.Tensor:
        return mamba1_decode_reference(self, state, u, dt_raw, dt_bias, a, b, c, d, z)

    def selective_decode(self, state: torch.Tensor, u: torch.Tensor, dt: torch.Tensor, a: torch.Tensor,
                         b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """torch's batched ops: no Triton kernel of its own."""
        return selective_decode_reference(state, u, dt, a, b, c, d)

    def paged_attention_prefill(
        self,
        query: torch.Tensor,
        k_cache: KVCache,
        v_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        *,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return attention_prefill.paged_attention_prefill(
            query, k_cache, v_cache, meta, scale, window=window, softcap=softcap, sinks=sinks
        )

    def fused_moe(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: ExpertActivation | None = None,
    ) -> torch.Tensor:
        """Two grouped GEMMs over expert-sorted (token, slot) tiles (see ``fused_moe``);
        gpt-oss's clamped activation and Nemotron 3's squared ReLU: the torch grouped path (engine.ops.moe)."""
        if activation is not None:
            return fused_moe_reference(x, w13, w2, topk_weights, topk_ids, activation)
        return fused_moe.fused_moe(x, w13, w2, topk_weights, topk_ids)

    def lora_add(
        self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segments: LoraSegments,
        slices: tuple[int, ...] = (),
    ) -> None:
        if segments.active:
            lora.lora_add(out, x, a, b, segments.groups, segments.order, segments.group_bounds, segments.group_slots)

    def lora_pairs(self, dtype: torch.dtype) -> bool:
        return False

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """xgrammar's kernel (C++ on the CPU, CUDA on a GPU)."""
        apply_bitmask(logits, bitmask, rows)

    def sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        seeds: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sort-free: radix-searched thresholds and a Philox Gumbel race (see ``sampling``).

        The masks equal the reference's; the draws use Philox instead of torch's generator,
        so a seeded row gives the same token in any batch, but not the reference's token.
        """
        return sampling.sample(logits, temperature, top_k, top_p, min_p, seeds)
