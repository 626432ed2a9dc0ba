"""Plain-torch reference of every op: the CPU path and the oracle for the Triton kernels.

Attention gathers each request's K/V through its block table into a padded batch and runs
one masked ``scaled_dot_product_attention`` per layer, so the cost per layer does not grow
with Python work per request. The index tensors of that gather depend only on the step's
metadata, so they are built once per step (memoised on the metadata object's identity)
and reused by every layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from engine.ops.base import (
    KV_CODE_MAX,
    AttentionMetadata,
    KVCache,
    LoraSegments,
    QuantizedKV,
    lora_rows_unpaired,
)
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
from engine.ops.sampling_ref import sample as sample_reference
from engine.structured.bitmask import apply_bitmask


@contextlib.contextmanager
def one_intra_op_thread(x: torch.Tensor) -> Iterator[None]:
    """torch's CPU ops on this thread with one intra-op thread, for small ops called many
    times a step (an encoder's per-sequence attention, its layer norms). On two cores
    shared with the HTTP front end and its clients, every OpenMP parallel region stalls
    until the other thread gets a core back, and an encoder step has several such calls
    per sequence per layer. 512 sentences at 32 a step, 2 threads, on a busy 2-core host
    (docs/benchmarks.md, issue 42): 8-19 s with every op parallel, 2.9-5.7 s with these
    on one thread; only the matmuls, most of the work, gain from a second thread. Nothing
    changes on another device."""
    threads = torch.get_num_threads()
    if x.device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def encoder_attention_reference(qkv: torch.Tensor, lens: tuple[int, ...], num_heads: int,
                                head_dim: int) -> torch.Tensor:
    """An encoder layer's attention (see :meth:`engine.ops.Ops.encoder_attention`): one
    unmasked ``scaled_dot_product_attention`` per sequence on its own rows, unpadded."""
    t = qkv.shape[0]
    h, d = num_heads, head_dim
    if len(lens) == 1:
        q, k, v = qkv.view(1, t, 3, h, d).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).permute(0, 2, 1, 3).reshape(t, h * d)
    out = torch.empty(t, h * d, dtype=qkv.dtype, device=qkv.device)
    start = 0
    with one_intra_op_thread(qkv):
        for n, rows in zip(lens, qkv.split(lens), strict=True):
            q, k, v = rows.view(1, n, 3, h, d).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(q, k, v)  # [1, h, n, d]
            out[start:start + n].view(n, h, d).copy_(o[0].transpose(0, 1))
            start += n
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class _Gather:
    """Where a padded batch of requests reads its context from the flat cache."""

    blocks: torch.Tensor  # [B * L / block_size] int64: cache block of each padded block
    mask: torch.Tensor  # [B, 1, Q, L] bool: True where the query may attend the key
    batch: int
    length: int  # L: padded context length, a multiple of the block size
    # [B, 1, Q, L] int: query position minus key position, for sliding-window masks.
    distance: torch.Tensor
    # Window size -> its mask (``mask`` and distance < window); layers of a step share it.
    windowed: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    def mask_for(self, window: int) -> torch.Tensor:
        """The mask of a layer that attends to the last ``window`` positions (0: all)."""
        if not window:
            return self.mask
        mask = self.windowed.get(window)
        if mask is None:
            # transformers' sliding window: key j is visible from query i iff i - j < window.
            mask = self.windowed[window] = self.mask & (self.distance < window)
        return mask


@dataclasses.dataclass(frozen=True, slots=True)
class _PrefillPlan:
    """How one varlen step splits into rows attended one by one, as decode rows, and
    padded multi-token rows."""

    single_rows: torch.Tensor  # [Bs] int64: token rows attended as decode rows
    single_requests: torch.Tensor  # [Bs] int64: each one's request index in the batch
    single_seq_lens: torch.Tensor  # [Bs] int32: the context each one sees (itself included)
    single: _Gather | None
    multi_src: torch.Tensor  # [Bm * Qmax] int64: token row feeding each padded query slot
    multi_dst: torch.Tensor  # [Tm] int64: token rows of the multi-token requests
    multi_keep: torch.Tensor  # [Tm] int64: padded query slots that hold real tokens
    multi: _Gather | None
    max_query_len: int


class TorchOps:
    """The reference op set. Stateless apart from a one-entry memo of the step's indices."""

    name = "torch"
    # Requests of a mixed step with at most this many query tokens are attended row by row
    # as decode rows (``_attend_single_rows``). The reference pads a decode batch to its
    # longest context, so its rows depend on their neighbours anyway: only one-token rows.
    rowwise_max_query_len = 1

    def __init__(self) -> None:
        self._decode_key: tuple[object, ...] | None = None
        self._decode_plan: _Gather | None = None
        self._prefill_meta: AttentionMetadata | None = None
        self._prefill_plan: _PrefillPlan | None = None

    # --- pointwise -------------------------------------------------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # torch's fused kernel accumulates in fp32 for bf16/fp16 inputs; in fp32 it equals
        # HF's x * rsqrt(mean(x^2) + eps) * w exactly, and is one dispatch instead of six.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x.add_(residual)
        return self.rms_norm(summed, weight, eps), summed

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        rd = cos_sin_cache.shape[-1]  # the rotated share of each head (partial rotary: < D)
        both = _adjacent_heads(query, key)
        if both is not None:
            # q and k are neighbouring slices of one fused qkv row: rotate them together.
            _rotate_(both[..., :rd], cos, sin)
            return query, key
        query, key = query.clone(), key.clone()
        _rotate_(query[..., :rd], cos, sin)
        _rotate_(key[..., :rd], cos, sin)
        return query, key

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]).mul_(x[..., d:])

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate="tanh").mul_(x[..., d:])

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: KVCache,
        v_cache: KVCache,
        slot_mapping: torch.Tensor,
    ) -> None:
        # v_cache is k_cache: one latent tensor holds both (its value is its key), once.
        for x, cache in ((key, k_cache),) if v_cache is k_cache else ((key, k_cache), (value, v_cache)):
            heads, dim = cache.shape[-2:]
            if isinstance(cache, QuantizedKV):
                codes, scale = quantize_kv(x, cache.dtype)
                # As raw bytes: torch's CPU index_copy_ has no fp8 kernel.
                cache.data.view(torch.uint8).view(-1, heads, dim).index_copy_(
                    0, slot_mapping, codes.view(torch.uint8)
                )
                cache.scale.view(-1, heads).index_copy_(0, slot_mapping, scale)
            else:
                cache.view(-1, heads, dim).index_copy_(0, slot_mapping, x.to(cache.dtype))

    def fused_moe(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: ExpertActivation | None = None,
    ) -> torch.Tensor:
        return fused_moe_reference(x, w13, w2, topk_weights, topk_ids, activation)

    # --- attention -------------------------------------------------------------------------

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
        block_size = k_cache.shape[1]
        # Every layer of a step passes the same objects; a new step builds new ones. The
        # key holds them, so their ids cannot be recycled while it is alive.
        key = (block_tables, seq_lens_host, block_size)
        old = self._decode_key
        if (
            old is None
            or old[0] is not block_tables
            or old[1] is not seq_lens_host
            or old[2] != block_size
            or self._decode_plan is None
        ):
            self._decode_plan = _decode_gather(block_tables, seq_lens_host, block_size)
            self._decode_key = key
        return _attend_decode(query, k_cache, v_cache, self._decode_plan, scale, window, softcap, sinks)

    def encoder_attention(self, qkv: torch.Tensor, lens: tuple[int, ...], num_heads: int,
                          head_dim: int) -> torch.Tensor:
        return encoder_attention_reference(qkv, lens, num_heads, head_dim)

    def delta_rule_decode(self, state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          g: torch.Tensor, beta: torch.Tensor, tiled: bool) -> torch.Tensor:
        return delta_rule_decode_reference(state, q, k, v, g, beta, tiled)

    def ssd_decode(self, state: torch.Tensor, x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor,
                   a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
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
        return selective_decode_reference(state, u, dt, a, b, c, d)

    def conv_decode(self, conv: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
        return conv_decode_reference(conv, x, weight, bias)

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
        # Same metadata object for every layer of a step: plan once, hold it so the id
        # cannot be reused by a later step's object.
        if meta is not self._prefill_meta or self._prefill_plan is None:
            self._prefill_plan = _prefill_plan(meta, k_cache.shape[1], self.rowwise_max_query_len)
            self._prefill_meta = meta
        plan = self._prefill_plan
        out = torch.empty_like(query)
        if plan.single is not None:
            q = query.index_select(0, plan.single_rows)
            out.index_copy_(
                0,
                plan.single_rows,
                self._attend_single_rows(q, k_cache, v_cache, meta, plan, scale, window, softcap, sinks),
            )
        if plan.multi is not None:
            g = plan.multi
            heads, dim = query.shape[1:]
            q = query.index_select(0, plan.multi_src).view(g.batch, plan.max_query_len, heads, dim)
            o = _attend(q.transpose(1, 2), k_cache, v_cache, g, scale, window, softcap, sinks)  # [Bm, H, Q, D]
            o = o.transpose(1, 2).reshape(-1, heads, dim).index_select(0, plan.multi_keep)
            out.index_copy_(0, plan.multi_dst, o)
        return out

    def _attend_single_rows(
        self,
        query: torch.Tensor,
        k_cache: KVCache,
        v_cache: KVCache,
        meta: AttentionMetadata,
        plan: _PrefillPlan,
        scale: float,
        window: int,
        softcap: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the one-token requests of a mixed step (a subclass's decode path)."""
        assert plan.single is not None
        return _attend_decode(query, k_cache, v_cache, plan.single, scale, window, softcap, sinks)

    def lora_add(
        self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segments: LoraSegments,
        slices: tuple[int, ...] = (),
    ) -> None:
        """Each run of a slot's tokens as two fp32 matmuls (the oracle of the kernels)."""
        lora_add_reference(out, x, a, b, segments)

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
        return sample_reference(logits, temperature, top_k, top_p, min_p, seeds)


def lora_add_reference(
    out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segments: LoraSegments
) -> None:
    """:meth:`Ops.lora_add` in plain torch: shrink and expand in fp32 per run of a slot."""
    if b.dim() == 4:  # row pairs
        b = lora_rows_unpaired(b)
    for start, end, slot in segments.host:
        shrunk = x[start:end].float() @ a[slot].float().T
        out[start:end] = (out[start:end].float() + shrunk @ b[slot].float()).to(out.dtype)


def _rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """In place: x * cos + rotate_half(x) * sin on x [T, heads, D]; cos/sin [T, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    x2_sin = x2 * sin
    x2.mul_(cos).addcmul_(x1, sin)  # x1 is still the original here
    x1.mul_(cos).sub_(x2_sin)
    return x


def _adjacent_heads(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """A [T, H + Hkv, D] view over q and k when k's heads follow q's in the same rows."""
    t, heads, dim = query.shape
    if (
        key.shape[0] != t
        or key.shape[2] != dim
        or key.dtype != query.dtype
        or query.stride()[1:] != (dim, 1)
        or key.stride() != query.stride()
        or key.data_ptr() != query.data_ptr() + heads * dim * query.element_size()
    ):
        return None
    return query.as_strided((t, heads + key.shape[1], dim), query.stride())


def _gather_blocks(block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """The first ``num_blocks`` blocks of each row, flat: [B * num_blocks] int64.

    Gathering whole blocks (block_size * heads * dim contiguous elements each) copies
    ~30% faster on CPU than gathering the same data slot by slot.
    """
    return block_tables[:, :num_blocks].to(torch.int64).reshape(-1)


def _decode_gather(
    block_tables: torch.Tensor, seq_lens_host: tuple[int, ...], block_size: int
) -> _Gather:
    batch = len(seq_lens_host)
    num_blocks = -(-max(seq_lens_host) // block_size)
    length = num_blocks * block_size
    device = block_tables.device
    lens = torch.tensor(seq_lens_host, device=device)
    kpos = torch.arange(length, device=device)
    mask = kpos < lens.unsqueeze(1)  # [B, L]
    distance = (lens.unsqueeze(1) - 1 - kpos).view(batch, 1, 1, length)
    blocks = _gather_blocks(block_tables, num_blocks)
    return _Gather(blocks, mask.view(batch, 1, 1, length), batch, length, distance)


def _prefill_plan(meta: AttentionMetadata, block_size: int, rowwise: int = 1) -> _PrefillPlan:
    """Requests with at most ``rowwise`` query tokens have each one attended as a decode
    row; the others go in the padded multi-token batch."""
    device = meta.block_tables.device
    qlens, slens = meta.query_lens_host, meta.seq_lens_host
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    single_idx = [b for b, n in enumerate(qlens) if 0 < n <= rowwise]
    multi_idx = [b for b, n in enumerate(qlens) if n > rowwise]
    empty = torch.empty(0, dtype=torch.int64, device=device)

    single = None
    single_rows = sel = empty
    single_lens = torch.empty(0, dtype=torch.int32, device=device)
    if single_idx:
        # Query i of request b sits at position seq_len - qlen + i: it sees i + 1 fewer
        # keys than the end of its request's context, as the decode step of that token.
        rows = [(starts[b] + i, b, slens[b] - qlens[b] + i + 1) for b in single_idx for i in range(qlens[b])]
        single_rows = torch.tensor([r for r, _, _ in rows], device=device)
        sel = torch.tensor([b for _, b, _ in rows], device=device)
        lens = tuple(n for _, _, n in rows)
        single_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        single = _decode_gather(meta.block_tables.index_select(0, sel), lens, block_size)

    multi = None
    src = dst = keep = empty
    max_q = max((qlens[b] for b in multi_idx), default=0)
    if multi_idx:
        src_l: list[int] = []
        dst_l: list[int] = []
        keep_l: list[int] = []
        for i, b in enumerate(multi_idx):
            s, n = starts[b], qlens[b]
            # Padding query slots repeat the request's last token; their output is dropped.
            src_l.extend(range(s, s + n))
            src_l.extend([s + n - 1] * (max_q - n))
            dst_l.extend(range(s, s + n))
            keep_l.extend(range(i * max_q, i * max_q + n))
        src, dst, keep = (torch.tensor(v, device=device) for v in (src_l, dst_l, keep_l))
        multi = _multi_gather(meta, multi_idx, max_q, block_size)
    return _PrefillPlan(single_rows, sel, single_lens, single, src, dst, keep, multi, max_q)


def _multi_gather(
    meta: AttentionMetadata, rows: list[int], max_q: int, block_size: int
) -> _Gather:
    device = meta.block_tables.device
    slens = [meta.seq_lens_host[b] for b in rows]
    qlens = [meta.query_lens_host[b] for b in rows]
    num_blocks = -(-max(slens) // block_size)
    length = num_blocks * block_size
    seq = torch.tensor(slens, device=device).view(-1, 1, 1)
    past = seq - torch.tensor(qlens, device=device).view(-1, 1, 1)
    qpos = torch.arange(max_q, device=device).view(1, -1, 1)
    kpos = torch.arange(length, device=device).view(1, 1, -1)
    # Query i of a request sits at absolute position past + i: it sees its cached past and
    # the new tokens up to itself. Padding rows (i >= qlen) see the whole context, so no
    # row is fully masked (which would give NaN).
    mask = (kpos <= past + qpos) & (kpos < seq)
    # Padding rows keep seeing their whole context under any window: their distance is 0.
    distance = torch.where(qpos < seq - past, past + qpos - kpos, 0)
    sel = torch.tensor(rows, device=device)
    blocks = _gather_blocks(meta.block_tables.index_select(0, sel), num_blocks)
    return _Gather(blocks, mask.unsqueeze(1), len(rows), length, distance.unsqueeze(1))


def paged_attention_block(
    query: torch.Tensor,
    k_cache: KVCache,
    v_cache: KVCache,
    block_table: torch.Tensor,
    start: int,
    end: int,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
    symmetric: bool = False,
) -> torch.Tensor:
    """Attention of one request's queries at positions ``start..end-1`` [end - start, H, D]
    over its keys at positions ``0..end-1`` in the paged cache (``block_table``, its row of
    the step's tables): every query of the block sees every key of it, those after it
    included (Gemma 3's image tokens), and the keys before the block; with ``window``,
    none ``window`` or more positions before it (``symmetric``: nor after it, as
    EmbeddingGemma's bidirectional sliding layers). The keys are written already. Any
    backend's caches (a quantized one dequantized), SDPA as the torch reference's."""
    block_size = k_cache.shape[1]
    num_blocks = -(-end // block_size)
    length = num_blocks * block_size
    device = query.device
    kpos = torch.arange(length, device=device).view(1, 1, 1, -1)
    qpos = torch.arange(start, end, device=device).view(1, 1, -1, 1)
    mask = (kpos < end) & (qpos >= 0)  # [1, 1, Q, L]
    blocks = block_table[:num_blocks].to(torch.int64)
    if symmetric and window:
        mask = mask & (kpos - qpos < window)
    g = _Gather(blocks, mask, 1, length, qpos - kpos)
    out = _attend(query.unsqueeze(0).transpose(1, 2), k_cache, v_cache, g, scale, window, softcap)
    return out.transpose(1, 2)[0]


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., D] as 8-bit codes of ``dtype`` and one fp32 scale per row of D values.

    scale = max|row| / code_max; code = x / scale (int8: rounded half to even, as C's
    nearbyintf); an all-zero row gets scale 0 and zero codes. fp32 throughout, so the C
    and Triton writes, which spell the same operations, give the same codes.
    """
    xf = x.float()
    code_max = KV_CODE_MAX[dtype]
    # Divided by a tensor, not a Python number: on CUDA torch turns division by a host
    # scalar into a product with its reciprocal, which can differ from the IEEE quotient
    # (what the C and Triton writes compute) in the last bit.
    scale = xf.abs().amax(-1) / torch.full((), code_max, device=xf.device)
    y = torch.where(scale.unsqueeze(-1) > 0, xf / scale.unsqueeze(-1), 0.0)
    if dtype == torch.int8:
        return y.round_().clamp_(-code_max, code_max).to(torch.int8), scale
    return y.to(dtype), scale


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of codes [..., D] with their scales [...]."""
    return codes.float() * scale.unsqueeze(-1)


def _gathered_kv(cache: KVCache, g: _Gather) -> torch.Tensor:
    """The padded context of each request as [B, kv_heads, L, D] (a strided view); a
    quantized cache comes back dequantized to fp32."""
    heads, dim = cache.shape[-2:]
    if isinstance(cache, QuantizedKV):
        # Only the gathered blocks are dequantized, never the pool; codes move as raw bytes
        # (torch's CPU index_select has no fp8 kernel).
        codes = cache.data.view(torch.uint8).index_select(0, g.blocks).view(cache.dtype)
        gathered = dequantize_kv(codes, cache.scale.index_select(0, g.blocks))
    else:
        gathered = cache.index_select(0, g.blocks)  # [B * nb, block_size, heads, dim]
    return gathered.view(g.batch, g.length, heads, dim).transpose(1, 2)


def _attend(
    q: torch.Tensor,
    k_cache: KVCache,
    v_cache: KVCache,
    g: _Gather,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA of q [B, H, Q, D] over the gathered context, GQA by head grouping."""
    k = _gathered_kv(k_cache, g).to(q.dtype)
    v = k if v_cache is k_cache else _gathered_kv(v_cache, g).to(q.dtype)
    mask = g.mask_for(window)
    if softcap or sinks is not None:
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        sink = None if sinks is None else sinks.view(1, -1, 1, 1)
        return _explicit_attention(q, k, v, mask, scale, softcap, sink)
    # The CPU and CUDA SDPA kernels accumulate the softmax in fp32 for bf16/fp16 inputs.
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def _explicit_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention SDPA has no hook for, scores and softmax in fp32: Gemma 2's logit
    soft-capping (``cap * tanh(s / cap)`` on the scaled scores, before the mask), and
    gpt-oss's attention sinks (``sink`` broadcast to [B, H, Q, 1]: one more logit a head
    in the softmax's denominator, with no value: the weights of the real keys sum to less
    than 1)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sink is not None:
        column = sink.float().expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


def _attend_decode(
    query: torch.Tensor,
    k_cache: KVCache,
    v_cache: KVCache,
    g: _Gather,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    batch, heads, dim = query.shape
    kv_heads = k_cache.shape[2]
    # One query token per request: fold each KV head's group of query heads into the query
    # length, so plain (non-GQA) SDPA serves every group with one K/V read.
    q = query.view(batch, kv_heads, heads // kv_heads, dim)
    k = _gathered_kv(k_cache, g).to(query.dtype)
    v = k if v_cache is k_cache else _gathered_kv(v_cache, g).to(query.dtype)
    mask = g.mask_for(window)
    if softcap or sinks is not None:
        sink = None if sinks is None else sinks.view(1, kv_heads, heads // kv_heads, 1)
        o = _explicit_attention(q, k, v, mask, scale, softcap, sink)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return o.reshape(batch, heads, dim)


__all__ = ["AttentionMetadata", "TorchOps", "dequantize_kv", "quantize_kv"]
