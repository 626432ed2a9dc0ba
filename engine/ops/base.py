"""What every op backend shares: the :class:`Ops` protocol and the data types its ops take.

The backends (``engine.ops.reference``, ``engine.ops.cpu``, ``engine.ops.triton_ops``) and
their kernels import these from here; ``engine.ops`` re-exports them for the models and
the runner.

KV-cache layout (one pair of tensors per layer)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

       block 0            block 1                  slot = block_id * block_size + offset
    +--+--+--+--+     +--+--+--+--+
    |t0|t1|t2|t3|     |t4|t5|  |  |   <- a request whose block table is [0, 1]
    +--+--+--+--+     +--+--+--+--+      holds 6 tokens; each cell is [num_kv_heads, head_dim]

A request's block table lists its blocks in token order; token ``i`` of the request lives
in block ``block_table[i // block_size]`` at offset ``i % block_size``.

Quantized KV cache (``kv_cache_dtype`` int8 or fp8): each layer's K and V are a
:class:`QuantizedKV`, 8-bit codes in the same layout plus one fp32 scale per token and KV
head, so a cell costs ``head_dim + 4`` bytes instead of ``2 * head_dim`` in bf16::

    data:  [num_blocks, block_size, num_kv_heads, head_dim]  int8 or float8_e4m3fn
    scale: [num_blocks, block_size, num_kv_heads]            fp32
    value = data.float() * scale[..., None]     scale = max|x| / 127 (int8) or / 448 (fp8)

The write quantizes each token's head row on its own (a group of ``head_dim`` values, as
GGUF's Q8_0 groups 32): a later token never changes an earlier one's codes, so a block
fills one write at a time with no requantization.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from engine.ops.moe import ExpertActivation
from engine.ops.recurrent_reference import MambaDecodeSpec


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
    # A hybrid model's recurrent layers (engine.models.layers.recurrent): each request's recurrent
    # state slot ([B] int64 on the device, and on the host); None for other models.
    state_slots: torch.Tensor | None = None
    state_slots_host: tuple[int, ...] = ()
    # The prefix cache's state checkpoints (slots past the running requests'): request b
    # first copies slot src into its own ``(b, src)``; after its first ``offset`` tokens it
    # copies its own into slot dst ``(b, offset, dst)``.
    state_loads: tuple[tuple[int, int], ...] = ()
    state_saves: tuple[tuple[int, int, int], ...] = ()

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


# Largest code of each 8-bit KV format: int8 is symmetric (-127..127, -128 unused);
# float8_e4m3fn's largest finite value is 448.
KV_CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


@dataclasses.dataclass(frozen=True, slots=True)
class QuantizedKV:
    """One layer's K (or V) cache as 8-bit codes and a scale per token and KV head.

    Passed to the ops wherever a cache tensor goes; ``shape`` is the codes' shape, so
    layout reads (``k_cache.shape[1]`` is the block size) need no special case.
    """

    data: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim] int8 / fp8
    scale: torch.Tensor  # [num_blocks, block_size, num_kv_heads] fp32

    def __post_init__(self) -> None:
        if self.data.dtype not in KV_CODE_MAX:
            raise ValueError(f"QuantizedKV codes must be int8 or float8_e4m3fn, got {self.data.dtype}")
        if self.scale.dtype != torch.float32 or self.scale.shape != self.data.shape[:-1]:
            raise ValueError(
                f"QuantizedKV scale must be fp32 of shape {tuple(self.data.shape[:-1])}, got "
                f"{self.scale.dtype} {tuple(self.scale.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device


KVCache = torch.Tensor | QuantizedKV


@dataclasses.dataclass(frozen=True, slots=True)
class LoraSegments:
    """Which LoRA adapter slot each token of a step's flat batch runs with.

    The runner lays a step out request by request, so a slot's tokens come in runs:
    ``host`` lists them as ``(start, end, slot)`` (base-model tokens are in no run), and
    ``token_slots`` [T] int32 gives each token's slot, -1 for the base model. A pool of
    ``S`` slots holds, for each projection, ``a`` [S, R, in] and ``b`` [S, R, out] (B
    transposed, so the expand reads rows of ``out`` contiguously; the scale folded into
    ``b``).

    The grouped form the SGMV kernels read is derived once here, when the runner builds a
    step's segments, and reused by every projection of every layer: ``order`` [M] int32
    lists the adapter tokens sorted by slot (stable: a slot's tokens keep their order),
    ``group_bounds`` [G + 1] int32 cuts ``order`` into one group per slot in use and
    ``group_slots`` [G] int32 names each group's slot (``groups`` is the same on the host:
    ``(start, end, slot)`` over ``order``). A group reads its slot's A and B once for all
    its tokens, where a run (a request) would read them once per request.
    """

    host: tuple[tuple[int, int, int], ...]
    token_slots: torch.Tensor  # [T] int32 on the model's device
    groups: tuple[tuple[int, int, int], ...] = dataclasses.field(init=False)
    order: torch.Tensor = dataclasses.field(init=False)  # [M] int32, token_slots' device
    group_bounds: torch.Tensor = dataclasses.field(init=False)  # [G + 1] int32
    group_slots: torch.Tensor = dataclasses.field(init=False)  # [G] int32

    def __post_init__(self) -> None:
        runs_of: dict[int, list[tuple[int, int]]] = {}
        for start, end, slot in self.host:
            runs_of.setdefault(slot, []).append((start, end))
        order: list[int] = []
        groups = []
        for slot in sorted(runs_of):
            first = len(order)
            for start, end in runs_of[slot]:
                order.extend(range(start, end))
            groups.append((first, len(order), slot))
        device = self.token_slots.device
        # One host tensor, then one copy (a GPU step pays a single transfer), split in views.
        packed = torch.tensor([*order, 0, *(g[1] for g in groups), *(g[2] for g in groups)], dtype=torch.int32)
        packed = packed if device.type == "cpu" else packed.to(device)
        m, g = len(order), len(groups)
        object.__setattr__(self, "groups", tuple(groups))
        object.__setattr__(self, "order", packed[:m])
        object.__setattr__(self, "group_bounds", packed[m : m + g + 1])
        object.__setattr__(self, "group_slots", packed[m + g + 1 :])

    @property
    def active(self) -> bool:
        return bool(self.host)


def lora_rows_paired(b: torch.Tensor) -> torch.Tensor:
    """B [..., R, out] as row pairs [..., R / 2, out, 2] (a view: copy it into the pairs'
    storage): B[r][n] at [r // 2, n, r % 2], the layout :meth:`Ops.lora_pairs` asks for."""
    return b.unflatten(-2, (b.shape[-2] // 2, 2)).transpose(-1, -2)


def lora_rows_unpaired(b: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`lora_rows_paired`: row pairs [..., R / 2, out, 2] back to
    [..., R, out] (a copy)."""
    return b.transpose(-1, -2).flatten(-3, -2)


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
        cos_sin_cache: torch.Tensor,  # [max_pos, R]: cos in [:, :R/2], sin in [:, R/2:]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Neox-style (rotate-half) RoPE as in HF Llama on the first ``R`` values of each
        head (``R`` = head_dim, or less for a partial rotary: the rest pass unchanged, as
        HF Phi-3 does); may work in place."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of last dim ``2d``."""
        ...

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``gelu(x[..., :d], approximate="tanh") * x[..., d:]`` (GeGLU: Gemma's MLP)."""
        ...

    def write_kv_cache(
        self,
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: KVCache,
        v_cache: KVCache,
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        """Scatter each new token's K/V into its slot. ``v_cache is k_cache`` where one
        tensor serves as both (latent attention: ``value`` is ``key``): it is written once."""
        ...

    def paged_attention_decode(
        self,
        query: torch.Tensor,  # [B, num_heads, head_dim], one token per request
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
        """Attention of each request's one new token to its context (GQA aware).

        ``window`` > 0 is a sliding window: the token at position ``i`` sees only keys
        ``j`` with ``i - j < window`` (transformers' convention). ``softcap`` > 0 caps the
        scaled scores as ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2).
        ``sinks`` [num_heads] fp32 (gpt-oss's attention sinks): each head's softmax takes
        one more logit, ``sinks[h]``, with no value, so its weights over the keys sum to
        ``1 - exp(sink) / (exp(sink) + sum(exp(scores)))``.
        """
        ...

    def paged_attention_prefill(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: KVCache,
        v_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        *,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Varlen attention: causal within each request's new tokens, full to its cached past
        (or to its last ``window`` positions); ``window``, ``softcap`` and ``sinks`` as in
        decode."""
        ...

    def encoder_attention(self, qkv: torch.Tensor, lens: tuple[int, ...], num_heads: int,
                          head_dim: int) -> torch.Tensor:
        """An encoder layer's attention over a packed batch of whole sequences: ``qkv``
        ``[T, 3 * num_heads * head_dim]`` (one fused projection's rows, each row's q, k
        and v heads back to back), sequences of ``lens`` rows back to back; each row
        attends to every row of its own sequence, both ways, at scale
        ``head_dim ** -0.5``. Returns ``[T, num_heads * head_dim]``."""
        ...

    def delta_rule_decode(self, state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          g: torch.Tensor, beta: torch.Tensor, tiled: bool) -> torch.Tensor:
        """One decode token of Gated DeltaNet's delta rule for N requests, fp32: ``state``
        ``[N, Hv, Dk, Dv]`` (updated in place), ``q`` and ``k`` ``[N, Hk, Dk]`` (value head
        ``h`` reads key head ``h // (Hv / Hk)``, or ``h % Hk`` when ``tiled``), ``v``
        ``[N, Hv, Dv]``, ``g`` (the log decay) and ``beta`` ``[N, Hv]``. Per value head
        ``S = exp(g) S; S += k (beta (v - S^T k))^T``; returns ``S^T q`` ``[N, Hv, Dv]``."""
        ...

    def conv_decode(self, conv: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
        """One decode token a row through a recurrent layer's depthwise causal convolution:
        ``conv`` ``[N, C, W]`` (each channel's last W inputs, updated in place: the window
        moves on by ``x``), ``x`` ``[N, C]`` (the same dtype), ``weight`` ``[C, W + 1]`` and
        ``bias`` ``[C]`` (or None) fp32. Returns ``silu([conv | x] . weight + bias)`` ``[N,
        C]`` fp32."""
        ...

    def ssd_decode(self, state: torch.Tensor, x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor,
                   a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """One decode token of Mamba-2's state-space model for N requests, fp32: ``state``
        ``[N, H, P, Ds]`` (updated in place), ``x`` ``[N, H, P]``, ``b`` and ``c`` ``[N, G,
        Ds]`` (head ``h`` reads group ``h // (H / G)``), ``dt`` ``[N, H]`` (after softplus and
        clamp), ``a`` (the decay rates, ``-exp(A_log)``) and ``d`` ``[H]``. Per head ``S =
        exp(dt a) S + dt x B^T``; returns ``S C + d x`` ``[N, H, P]``."""
        ...

    def mamba2_decode(self, zx: torch.Tensor, conv: torch.Tensor, state: torch.Tensor, conv_weight: torch.Tensor,
                      conv_bias: torch.Tensor | None, dt_bias: torch.Tensor, a: torch.Tensor, d: torch.Tensor,
                      norm: torch.Tensor | None, spec: MambaDecodeSpec) -> torch.Tensor:
        """One decode token of a Mamba-2 mixer for N requests, between its two projections:
        from in_proj's rows ``zx`` [N, d_inner + conv_dim + H] (z, then x B C, then dt; rows
        may be strided) to out_proj's input [N, d_inner] in ``zx``'s dtype: dt's softplus
        and clamp, :meth:`conv_decode` on ``conv`` [N, conv_dim, d_conv - 1], :meth:`ssd_decode`
        on ``state`` [N, H, P, d_state] (both updated in place), then the gated RMS norm
        (``norm``, the weight; ``spec``'s form)."""
        ...

    def mamba1_decode(self, state: torch.Tensor, u: torch.Tensor, dt_raw: torch.Tensor, dt_bias: torch.Tensor,
                      a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor,
                      z: torch.Tensor) -> torch.Tensor:
        """A Mamba-1 mixer's decode token for N requests after its dt projection: ``dt =
        softplus(dt_raw + dt_bias)`` in fp32, :meth:`selective_decode` on ``state`` [N, D,
        S] (in place) with the convolved ``u`` [N, D], B and C [N, S], then ``y *
        silu(z)`` [N, D] in ``z``'s dtype (``u``, ``dt_raw``, B, C and ``z`` in the model
        dtype; B, C and z may be strided rows)."""
        ...

    def selective_decode(self, state: torch.Tensor, u: torch.Tensor, dt: torch.Tensor, a: torch.Tensor,
                         b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """One decode token of Mamba-1's selective scan for N requests, fp32: ``state``
        ``[N, D, S]`` (updated in place), ``u`` and ``dt`` ``[N, D]`` (the convolved input;
        dt after softplus), ``a`` ``[D, S]`` (the decay rates, ``-exp(A_log)``: a rate per
        channel and state value), ``b`` and ``c`` ``[N, S]`` (shared by the channels), ``d``
        ``[D]``. Per channel ``s = exp(dt a) s + dt u B``; returns ``s . C + d u`` ``[N, D]``."""
        ...

    def fused_moe(
        self,
        x: torch.Tensor,  # [T, hidden]
        w13: torch.Tensor,  # [E, 2 * inter, hidden]: each expert's gate rows then up rows
        w2: torch.Tensor,  # [E, hidden, inter]
        topk_weights: torch.Tensor,  # [T, k] fp32 routing weights
        topk_ids: torch.Tensor,  # [T, k] int64 expert of each slot
        activation: ExpertActivation | None = None,  # gpt-oss's clamped gate, Nemotron 3's squared ReLU
    ) -> torch.Tensor:
        """The routed experts' MLPs (SiLU-gated, or ``activation``'s), weighted and summed per token: [T, hidden].

        Reads only the weights of experts that received a token (see ``engine.ops.moe``).
        """
        ...

    def lora_add(
        self,
        out: torch.Tensor,  # [T, out]: the base projection's output, updated in place
        x: torch.Tensor,  # [T, in]: the projection's input
        a: torch.Tensor,  # [S, R, in]: each slot's A (shrink), rank padded to R with zeros
        b: torch.Tensor,  # [S, R, out]: each slot's B transposed (expand), times the adapter's scale
        segments: LoraSegments,
        slices: tuple[int, ...] = (),
    ) -> None:
        """``out[t] += (a[s] @ x[t]) @ b[s]`` for each token ``t`` of slot ``s >= 0``
        (SGMV: shrink then expand, a segment per adapter), accumulated in fp32 and rounded
        once into ``out``'s dtype; base-model rows are left as they are. ``b`` may come as
        row pairs ([S, R / 2, out, 2], :func:`lora_rows_paired`) where :meth:`lora_pairs`
        asks for them.

        ``slices`` (a fused projection's ``n + 1`` column bounds): ``b``'s rows come in
        ``n`` equal groups, group ``j`` zero outside columns ``slices[j]:slices[j + 1]``
        (block diagonal); a kernel may skip the zeros. Empty: no such promise."""
        ...

    def lora_pairs(self, dtype: torch.dtype) -> bool:
        """Whether :meth:`lora_add` runs fastest with B held as row pairs in ``dtype`` (the
        CPU kernel's bf16 dot products take two of B's rows a product); the adapter slots
        then hold B so."""
        ...

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Structured output: set ``logits[rows[i], t]`` to -inf, in place, for every token
        ``t`` that row ``i`` of ``bitmask`` (int32 [len(rows), ceil(V / 32)], bit ``t % 32``
        of word ``t // 32`` set = allowed) forbids. ``logits`` is fp32 [B, V]."""
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
