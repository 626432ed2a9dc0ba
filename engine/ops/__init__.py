"""Kernels behind one signature per op, with a backend chosen by the caller.

``get_ops("torch")`` gives the plain-torch reference (the oracle for every kernel);
``get_ops("cpu")`` the CPU path: C kernels for the ops torch dispatches slowly at decode
sizes, the reference for the rest; ``get_ops("triton")`` the Triton kernels (CUDA, or CPU
under ``TRITON_INTERPRET=1`` for tests). ``get_ops("auto")`` picks Triton on CUDA, and on
CPU the C kernels when they are built, else the reference. Models receive the ``Ops``
object explicitly; nothing here is global.

KV-cache layout (one pair of tensors per layer)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

       block 0            block 1                  slot = block_id * block_size + offset
    +--+--+--+--+     +--+--+--+--+
    |t0|t1|t2|t3|     |t4|t5|  |  |   <- a request whose block table is [0, 1]
    +--+--+--+--+     +--+--+--+--+      holds 6 tokens; each cell is [num_kv_heads, head_dim]

A request's block table lists its blocks in token order; token ``i`` of the request lives
in block ``block_table[i // block_size]`` at offset ``i % block_size``.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where each token of a flat varlen batch reads and writes the paged KV cache.

    The batch holds ``B`` requests and ``T`` new tokens; request ``b`` owns tokens
    ``query_start_loc[b]:query_start_loc[b + 1]``, which sit at the last positions of its
    ``seq_lens[b]`` tokens of context.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32: context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host-side copies so the CPU path never syncs a device tensor to read them.
    query_lens_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


class Ops(Protocol):
    """The op set a model and the sampler use; every backend provides all of it."""

    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x / rms(x) * weight`` over the last dim, computed in fp32, returned in x.dtype."""
        ...

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(rms_norm(x + residual), x + residual)``; may reuse the inputs' storage."""
        ...

    def rotary_embedding(
        self,
        positions: torch.Tensor,  # [T] int64
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        cos_sin_cache: torch.Tensor,  # [max_pos, head_dim]: cos in [:, :d/2], sin in [:, d/2:]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Neox-style (rotate-half) RoPE as in HF Llama; may work in place."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of last dim ``2d``."""
        ...

    def write_kv_cache(
        self,
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        """Scatter each new token's K/V into its slot."""
        ...

    def paged_attention_decode(
        self,
        query: torch.Tensor,  # [B, num_heads, head_dim], one token per request
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        seq_lens_host: tuple[int, ...],
    ) -> torch.Tensor:
        """Attention of each request's one new token to its whole context (GQA aware)."""
        ...

    def paged_attention_prefill(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Varlen attention: causal within each request's new tokens, full to its cached past."""
        ...

    def sample(
        self,
        logits: torch.Tensor,  # [B, V] fp32, penalties and biases already applied
        temperature: torch.Tensor,  # [B] fp32; 0 means greedy
        top_k: torch.Tensor,  # [B] int32; 0 means off
        top_p: torch.Tensor,  # [B] fp32; 1 means off
        min_p: torch.Tensor,  # [B] fp32; 0 means off
        seeds: torch.Tensor,  # [B] int64: the random stream of each row for this step
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(token_ids [B] int64, logprobs [B] fp32)``.

        The logprob is the sampled token's under ``log_softmax(logits)`` (before temperature
        and truncation, as vLLM reports it). A row's draw depends only on its own logits,
        parameters and seed, never on the rest of the batch.
        """
        ...


def get_ops(backend: str = "auto", device: torch.device | str = "cpu") -> Ops:
    """Return the op set for ``backend`` in {"auto", "torch", "cpu", "triton"}."""
    device = torch.device(device)
    if backend == "auto":
        from engine.ops import cpu

        backend = "triton" if device.type == "cuda" else "cpu" if cpu.available() else "torch"
    if backend == "torch":
        from engine.ops.reference import TorchOps

        return TorchOps()
    if backend == "cpu":
        from engine.ops.cpu import CpuOps

        return CpuOps()
    if backend == "triton":
        from engine.ops.triton_ops import TritonOps

        return TritonOps()
    raise ValueError(f"unknown ops backend {backend!r}; expected auto, torch, cpu or triton")
