"""The CPU op set: C kernels (``kernels.c``, built with cffi) where torch is slow, the torch
reference for the rest.

At decode sizes torch spends most of an RMSNorm, a RoPE or a paged attention call on
dispatching the 5-10 small ops it is made of; on SmolLM2 those calls were a third of a
batch-1 decode step, and SDPA over gathered K/V a third of a batch-32 one; torch's bf16
SiLU was a tenth of a 2048-token prefill. ``CpuOps`` replaces exactly those with one C
call each and inherits everything else (KV write, prefill attention for multi-token rows,
sampling) from :class:`TorchOps`.

The C path takes fp32 and bf16 tensors in the layouts the model produces (rows with a
uniform stride, heads contiguous); any other input (fp16, an odd view, a shape past the
kernels' buffers) goes to the torch reference, so every call gets an answer. Single-query
attention rows, and every row of a request with at most 65 query tokens in the step (a
speculative verification chunk), take the decode kernel whatever else is in the batch, so
a position's numbers depend neither on its neighbours nor on how many of its request's
positions the step computes.

The extension is compiled when the package is installed (``setup.py``). Where it is
missing, :func:`available` is false and ``get_ops("auto")`` falls back to ``TorchOps``.
"""

from __future__ import annotations

import weakref

import torch

from engine.ops.base import AttentionMetadata, KVCache, LoraSegments, QuantizedKV
from engine.ops.cpu.errors import CpuKernelError
from engine.ops.cpu.recurrent import RecurrentKernels
from engine.ops.moe import ClampedSwiglu, ExpertActivation, SquaredRelu
from engine.ops.reference import _adjacent_heads, _PrefillPlan

try:  # built at install time; absent in a source tree nobody installed
    from engine.ops.cpu._kernels import ffi as _ffi
    from engine.ops.cpu._kernels import lib as _lib
except ImportError:  # pragma: no cover - depends on the install
    _ffi = _lib = None

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # enum in kernels.c
_DT_I8 = 2  # an int8 KV cache with fp32 scales (enum in kernels.c)
# Tokens up to which CpuOps.fused_moe takes the C kernel (MOE_MAX_PAIRS / k in quant.c
# bounds the pairs: 16 tokens at 8 experts a token fit); more take the torch path.
MOE_MAX_TOKENS = 16


def available() -> bool:
    """Whether the compiled kernels could be loaded."""
    return _lib is not None


def _ptr(t: torch.Tensor, ctype: str = "void *"):  # a cffi pointer to the tensor's data
    return _ffi.cast(ctype, t.data_ptr())


def _gemma_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def lora_slice_bounds(slices: tuple[int, ...], rank: int, out_features: int) -> tuple[int, ...]:
    """The output-column bounds of a fused projection's slices, where its B is block
    diagonal and the kernels read only the blocks: ``slices`` when they cut the rank rows
    evenly, else the whole width as one slice."""
    return slices if len(slices) >= 2 and rank % (len(slices) - 1) == 0 else (0, out_features)


class _LoraStep:
    """A step's :class:`LoraSegments` as ``eng_lora_sgmv`` takes them (``order`` None where
    they are not on the CPU), and the thread count of the step."""

    __slots__ = ("segments", "order", "bounds", "slots", "groups", "threads")

    def __init__(self, segments: LoraSegments) -> None:
        self.segments = segments
        self.order = self.bounds = self.slots = None
        self.groups = self.threads = 0
        if segments.order.device.type == "cpu":
            self.order = _ptr(segments.order, "int32_t *")
            self.bounds = _ptr(segments.group_bounds, "int32_t *")
            self.slots = _ptr(segments.group_slots, "int32_t *")
            self.groups = len(segments.groups)
            self.threads = torch.get_num_threads()


class _LoraPool:
    """One projection's adapter slots (``a`` [S, R, in]; ``b`` [S, R, out] or as row pairs
    [S, R / 2, out, 2]) as the C calls take them: ``a`` None where they do not (a dtype or
    layout the kernel has no path for). ``b`` is held weakly, to tell a new one apart."""

    __slots__ = ("b_ref", "slices", "a", "b", "k", "n", "wcode", "r", "s", "cols", "nslices", "pairs")

    def __init__(self, a: torch.Tensor, b: torch.Tensor, slices: tuple[int, ...]) -> None:
        self.b_ref, self.slices, self.a = weakref.ref(b), slices, None
        wcode = _DTYPE_CODES.get(a.dtype)
        pairs = b.dim() == 4  # B as row pairs (lora_pairs): the bf16 dot-product expand's layout
        if (wcode is None or b.dtype != a.dtype or a.dim() != 3 or b.dim() != (4 if pairs else 3)
                or not (a.is_contiguous() and b.is_contiguous()) or a.device.type != "cpu"):
            return
        self.a, self.b = _ptr(a), _ptr(b)
        self.k, self.n, self.r, self.s = a.shape[2], b.shape[2], a.shape[1], a.shape[0]
        self.wcode, self.pairs = wcode, int(pairs)
        # A fused projection's slices: B is block diagonal and the kernels read only its blocks.
        bounds = lora_slice_bounds(slices, self.r, self.n)
        self.cols, self.nslices = _ffi.new("int64_t[]", bounds), len(bounds) - 1


class CpuOps(RecurrentKernels):
    """C kernels for RMSNorm, RoPE, SiLU-and-mul, single-query paged attention, an
    encoder's attention, MoE experts and LoRA; the torch reference for the rest. Raises
    ``RuntimeError`` at construction if the kernels are not built."""

    _lib, _ffi = _lib, _ffi  # (for the recurrent kernels: engine.ops.cpu.recurrent)

    name = "cpu"
    # Each query row of a request with at most this many query tokens in a step goes
    # through the decode kernel, with the context up to itself: a speculative verification
    # chunk (1 + up to 64 proposed tokens, the most ``num_speculative_tokens`` allows)
    # then computes every position bit for bit as the one-token decode step of it would,
    # so greedy speculation gives the plain decode's tokens. Longer chunks (prefill) take
    # the padded SDPA path.
    rowwise_max_query_len = 65

    def __init__(self) -> None:
        if _lib is None:
            raise RuntimeError(
                "the CPU kernels (engine.ops.cpu._kernels) are not built; reinstall the "
                "package (pip install -e .) with a C compiler present, or use the torch ops"
            )
        super().__init__()
        # The LoRA calls' step (the segments their pointers point into kept alive with
        # them), and each slot pool's checked arguments by id(a) (an entry leaves with a).
        self._lora_step: _LoraStep | None = None
        self._lora_pools: dict[int, _LoraPool] = {}

    # --- pointwise -------------------------------------------------------------------------
    # The checks below run ~5 times per layer per step: each is a cheap attribute read, in
    # the order most likely to fail first, so the C path pays ~2 us of Python per call.

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        code = _DTYPE_CODES.get(x.dtype)
        if code is None or not _plain(x, weight) or weight.dtype != x.dtype:
            return super().rms_norm(x, weight, eps)
        out = torch.empty_like(x)
        n = x.shape[-1]
        _lib.eng_rms_norm(
            code, _ptr(out), _ptr(x), n, _ffi.NULL, 0, _ptr(weight), x.numel() // n, n, eps,
            torch.get_num_threads(),
        )
        return out

    def lora_add(
        self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segments: LoraSegments,
        slices: tuple[int, ...] = (),
    ) -> None:
        """One C call for the step's tokens, grouped by slot (SGMV: each group's A and B read
        once for all its tokens, in fp32); the reference for another dtype or a strided view.
        torch would run two small matmuls per adapter plus the gathers around them: tens of
        microseconds each at decode sizes, for every targeted projection of every layer.

        A step makes this call for every targeted projection of every layer (~120 a step
        for SmolLM2) with one ``segments``: its group pointers are made once (the last
        step's kept), and each fused projection's column bounds once per engine."""
        # Each torch attribute read costs microseconds once the base matmul before it has
        # streamed its weights through the caches, and a step makes ~120 of these calls:
        # what holds for the whole step (the segments' device, their pointers, the thread
        # count) is read once a step, what holds for a pool once, and the call reads only
        # x's and out's shapes, dtypes, layout and pointers.
        step = self._lora_segments(segments)
        pool = self._lora_pool(a, b, slices)
        shape, dtype = x.shape, x.dtype
        if (step.order is None or pool.a is None or len(shape) != 2 or shape[1] != pool.k
                or dtype not in _DTYPE_CODES or out.dtype != dtype or out.shape != (shape[0], pool.n)
                or not (x.is_contiguous() and out.is_contiguous())):
            return super().lora_add(out, x, a, b, segments)
        if not step.groups:
            return None
        rc = _lib.eng_lora_sgmv(_DTYPE_CODES[dtype], pool.wcode, _ptr(out), _ptr(x), shape[0], pool.k, pool.n,
                                pool.r, pool.s, pool.a, pool.b, step.order, step.bounds, step.slots, step.groups,
                                pool.nslices, pool.cols, pool.pairs, step.threads)
        if rc == -2:
            raise CpuKernelError(f"lora_add: a slot outside the pool of {a.shape[0]} or a token outside the "
                                 f"{x.shape[0]} of the step")
        if rc != 0:
            return super().lora_add(out, x, a, b, segments, slices)
        return None

    def _lora_segments(self, segments: LoraSegments) -> _LoraStep:
        """What every LoRA call of a step shares, made at its first call."""
        step = self._lora_step
        if step is None or step.segments is not segments:
            step = self._lora_step = _LoraStep(segments)
        return step

    def _lora_pool(self, a: torch.Tensor, b: torch.Tensor, slices: tuple[int, ...]) -> _LoraPool:
        """One projection's slot pool ``a`` [S, R, in] and ``b`` as the C calls take them,
        checked once and kept under id(a) until ``a`` is freed."""
        pool = self._lora_pools.get(id(a))
        if pool is not None and pool.b_ref() is b and pool.slices == slices:
            return pool
        if pool is None:
            weakref.finalize(a, self._lora_pools.pop, id(a), None)
        pool = self._lora_pools[id(a)] = _LoraPool(a, b, slices)
        return pool

    def lora_pairs(self, dtype: torch.dtype) -> bool:
        """bf16 where the CPU has AVX512-BF16: the expand's dot products take two of B's rows
        at once, and loading them as pairs saves interleaving them at every step."""
        return dtype == torch.bfloat16 and bool(_lib.eng_lora_pairs())

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """One C pass over the masked rows: xgrammar's CPU kernel spends ~150 us on a row of
        SmolLM2's 49k-token vocabulary (~5 ms a step at 32 constrained requests), this ~10."""
        if (logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1
                or bitmask.dtype != torch.int32 or not bitmask.is_contiguous()
                or bitmask.dim() != 2 or bitmask.shape[0] != len(rows)):
            return super().apply_token_bitmask(logits, bitmask, rows)
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.int64)
        rc = _lib.eng_apply_bitmask(
            _ptr(logits, "float *"), logits.stride(0), logits.shape[0], logits.shape[1],
            _ptr(bitmask, "int32_t *"), bitmask.shape[1], _ptr(index, "int64_t *"), len(rows),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise CpuKernelError(f"apply_token_bitmask: a row index of {rows} is outside the "
                                 f"batch of {logits.shape[0]}")

    def greedy(self, logits: torch.Tensor) -> tuple[list[int], list[float]] | None:
        """Every row's arg-max (the first on a tie, as ``torch.argmax``) and its log-softmax,
        as lists, in one C pass per row; None where the logits are not fp32 rows or a row
        holds NaN or no finite value (the general path then samples and reports them).

        The torch reference spends ~0.2 ms on one row of SmolLM2's 49k-token vocabulary in
        argmax, log_softmax and the indexing around them. The results come back through
        cffi arrays rather than tensors: after a step has streamed the model's weights
        through the caches, each torch op the sampler adds costs tens of microseconds."""
        if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1 or not logits.shape[0]:
            return None
        n = logits.shape[0]
        ids, logprobs = _ffi.new("int64_t[]", n), _ffi.new("float[]", n)
        status = _lib.eng_greedy(_ptr(logits, "float *"), logits.stride(0), n, logits.shape[1], ids, logprobs,
                                 torch.get_num_threads())
        return (list(ids), list(logprobs)) if status == 0 else None

    def sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        seeds: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """All-greedy batches through :meth:`greedy`; the rest through the reference."""
        if bool((temperature <= 0).all()):
            fast = self.greedy(logits)
            if fast is not None:
                return torch.tensor(fast[0], dtype=torch.int64), torch.tensor(fast[1], dtype=torch.float32)
        return super().sample(logits, temperature, top_k, top_p, min_p, seeds)

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        code = _DTYPE_CODES.get(x.dtype)
        if (
            code is None
            or not _plain(x, weight)
            or not (residual.is_contiguous() and residual.shape == x.shape)
            or not (residual.dtype == weight.dtype == x.dtype)
        ):
            return super().fused_add_rms_norm(x, residual, weight, eps)
        out = torch.empty_like(x)
        n = x.shape[-1]
        _lib.eng_rms_norm(
            code, _ptr(out), _ptr(x), n, _ptr(residual), n, _ptr(weight), x.numel() // n, n,
            eps, torch.get_num_threads(),
        )
        return out, x  # x now holds x + residual, as the reference's add_ leaves it

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        code = _DTYPE_CODES.get(query.dtype)
        if (
            code is None
            or not (_heads_contiguous(query) and _heads_contiguous(key))
            or not _plain(positions, cos_sin_cache)
            or not (key.dtype == cos_sin_cache.dtype == query.dtype)
            or positions.dtype != torch.int64
            or cos_sin_cache.shape[-1] > query.shape[-1]
        ):
            return super().rotary_embedding(positions, query, key, cos_sin_cache)
        both = _adjacent_heads(query, key)
        for x in (query, key) if both is None else (both,):
            tokens, heads, dim = x.shape
            status = _lib.eng_rope(
                code, _ptr(x), x.stride(0), heads, dim, cos_sin_cache.shape[-1], _ptr(positions, "int64_t *"), tokens,
                _ptr(cos_sin_cache), cos_sin_cache.shape[0], torch.get_num_threads(),
            )
            if status:
                raise CpuKernelError(
                    f"rope: a position is outside the cos/sin cache of {cos_sin_cache.shape[0]}"
                )
        return query, key

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        code = _DTYPE_CODES.get(x.dtype)
        if code is None or not _plain(x) or x.dim() < 1 or x.shape[-1] % 2:
            return super().silu_and_mul(x)
        n = x.shape[-1] // 2
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype)
        if n:
            _lib.eng_silu_mul(code, _ptr(out), _ptr(x), x.numel() // (2 * n), n, torch.get_num_threads())
        return out

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        code = _DTYPE_CODES.get(x.dtype)
        if code is None or not _plain(x) or x.dim() < 1 or x.shape[-1] % 2:
            return super().gelu_tanh_and_mul(x)
        n = x.shape[-1] // 2
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype)
        if n:
            _lib.eng_gelu_tanh_mul(code, _ptr(out), _ptr(x), x.numel() // (2 * n), n, torch.get_num_threads())
        return out

    def encoder_attention(self, qkv: torch.Tensor, lens: tuple[int, ...], num_heads: int,
                          head_dim: int) -> torch.Tensor:
        """One C call for the whole batch, (sequence, head) pairs shared between the
        threads, in place of an SDPA call per sequence (60 us each, most of it dispatch, at
        the ~25 tokens of a sentence)."""
        code = _DTYPE_CODES.get(qkv.dtype)
        width = num_heads * head_dim
        if code is None or not _plain(qkv) or qkv.dim() != 2 or qkv.shape[1] != 3 * width:
            return super().encoder_attention(qkv, lens, num_heads, head_dim)
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        if starts[-1] != qkv.shape[0]:
            raise ValueError(f"encoder_attention: lens {lens} do not cover the {qkv.shape[0]} rows")
        out = torch.empty(qkv.shape[0], width, dtype=qkv.dtype)
        rc = _lib.eng_encoder_attention(code, _ptr(out), _ptr(qkv), _ffi.new("int64_t[]", starts), len(lens),
                                        num_heads, head_dim, head_dim ** -0.5, torch.get_num_threads())
        if rc == -2:
            raise ValueError(f"encoder_attention: every sequence needs a row (lens {lens})")
        if rc:
            raise CpuKernelError(f"encoder_attention: the kernel failed ({rc})")
        return out

    def delta_rule_decode(self, state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          g: torch.Tensor, beta: torch.Tensor, tiled: bool) -> torch.Tensor:
        """One C call for every (request, value head): two passes over each state where the
        reference's batched ops make four, and no copy of q and k per value head."""
        n, hv, dk, dv = state.shape
        hk = k.shape[1] if k.dim() == 3 else 0
        tensors = (state, q, k, v, g, beta)
        if (any(t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() for t in tensors)
                or not hk or hv % hk or q.shape != (n, hk, dk) or k.shape != q.shape or v.shape != (n, hv, dv)
                or g.shape != (n, hv) or beta.shape != g.shape):
            return super().delta_rule_decode(state, q, k, v, g, beta, tiled)
        out = torch.empty(n, hv, dv, dtype=torch.float32)
        rc = _lib.eng_delta_rule_decode(*(_ptr(t, "float *") for t in (state, q, k, v, g, beta, out)), n, hv, hk, dk,
                                        dv, int(tiled), torch.get_num_threads())
        if rc == -1:
            return super().delta_rule_decode(state, q, k, v, g, beta, tiled)  # a head wider than the kernel's
        if rc:
            raise CpuKernelError(f"delta_rule_decode: the kernel failed ({rc})")
        return out

    def gemma_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Gemma's RMSNorm: ``x / rms(x) * weight`` in fp32 with ``weight`` (1 + w) in fp32,
        rounded to ``x.dtype`` once, as transformers computes it. Rows may be strided (the
        per-head q/k norm takes column slices of the fused q/k/v output)."""
        code = _DTYPE_CODES.get(x.dtype)
        n = x.shape[-1]
        if (code is None or weight.dtype != torch.float32 or not weight.is_contiguous() or weight.numel() != n
                or not x.is_cpu or x.stride(-1) != 1 or x.dim() < 1 or not n):
            return _gemma_norm_reference(x, weight, eps)
        rows = x.reshape(-1, n) if not x.is_contiguous() else x.view(-1, n)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype)
        _lib.eng_gemma_norm(code, _ptr(out), _ptr(rows), rows.stride(0), _ptr(weight, "float *"), rows.shape[0], n,
                            eps, torch.get_num_threads())
        return out

    def fused_moe(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: ExpertActivation | None = None,
    ) -> torch.Tensor:
        """Up to ``MOE_MAX_TOKENS`` tokens (decode steps, verification chunks): one C call
        over the routed experts (quant.c's ``eng_moe_small``: the reference's sorted pairs,
        its roundings, the dense small-batch kernel for the expert matmuls; gpt-oss's
        biased, clamped experts and Nemotron 3's ungated squared-ReLU ones too); more
        tokens, or other inputs, the torch reference."""
        if not isinstance(w13, torch.Tensor):  # experts kept in blocks, run here by the reference
            return super().fused_moe(x, w13, w2, topk_weights, topk_ids, activation)
        code = _DTYPE_CODES.get(x.dtype)
        t, k = topk_ids.shape
        swiglu = activation if isinstance(activation, ClampedSwiglu) else None
        gated = not isinstance(activation, SquaredRelu)
        b13 = None if swiglu is None else swiglu.b13
        if swiglu is not None and not (swiglu.limit > 0 and b13.dtype == x.dtype and b13.is_contiguous()
                                       and b13.shape == w13.shape[:2]):
            return super().fused_moe(x, w13, w2, topk_weights, topk_ids, activation)
        if (code is None or t > MOE_MAX_TOKENS or not t or x.dim() != 2 or not _plain(x, w13, w2)
                or not (w13.dtype == w2.dtype == x.dtype) or w13.dim() != 3 or w2.dim() != 3
                or w13.shape[2] != x.shape[1] or w2.shape[1] != x.shape[1]
                or w13.shape[1] != (2 if gated else 1) * w2.shape[2]
                or topk_ids.dtype != torch.int64 or topk_weights.dtype != torch.float32
                or not (topk_ids.is_contiguous() and topk_weights.is_contiguous())):
            return super().fused_moe(x, w13, w2, topk_weights, topk_ids, activation)
        hidden, inter = x.shape[1], w2.shape[2]
        out = torch.empty_like(x)
        pairs = t * k
        scratch = torch.empty(pairs * (2 * hidden + 3 * inter), dtype=x.dtype)
        xg, h, a, y = scratch.split([pairs * hidden, pairs * 2 * inter, pairs * inter, pairs * hidden])
        status = _lib.eng_moe_small(
            code, _ptr(out), _ptr(x), t, hidden, inter, k, w13.shape[0], _ptr(w13), _ptr(w2),
            _ffi.NULL if b13 is None else _ptr(b13), 0.0 if swiglu is None else swiglu.alpha,
            0.0 if swiglu is None else swiglu.limit, int(gated), _ptr(topk_weights, "float *"),
            _ptr(topk_ids, "int64_t *"), _ptr(xg), _ptr(h), _ptr(a), _ptr(y), torch.get_num_threads(),
        )
        if status == -2:
            raise CpuKernelError(f"fused_moe: an expert id is outside the {w13.shape[0]} experts")
        if status:
            return super().fused_moe(x, w13, w2, topk_weights, topk_ids, activation)
        return out

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: KVCache,
        v_cache: KVCache,
        slot_mapping: torch.Tensor,
    ) -> None:
        # Quantizing in torch is ~8 dispatches per tensor per layer; one C call instead.
        # A plain cache's index_copy_ is a single dispatch already.
        code = _DTYPE_CODES.get(key.dtype)
        if (
            code is None
            or not (_int8_cache(k_cache) and _int8_cache(v_cache))
            or not (_heads_contiguous(key) and _heads_contiguous(value))
            or value.dtype != key.dtype
            or not _plain(slot_mapping)
            or slot_mapping.dtype != torch.int64
        ):
            return super().write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
        tokens, heads, dim = key.shape
        assert isinstance(k_cache, QuantizedKV) and isinstance(v_cache, QuantizedKV)
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        for x, cache in ((key, k_cache),) if v_cache is k_cache else ((key, k_cache), (value, v_cache)):
            status = _lib.eng_kv_write_i8(
                code, _ptr(x), x.stride(0), tokens, heads, dim, _ptr(cache.data, "int8_t *"),
                _ptr(cache.scale, "float *"), _ptr(slot_mapping, "int64_t *"), num_slots,
                torch.get_num_threads(),
            )
            if status:
                raise CpuKernelError(f"kv write: a slot is outside the cache's {num_slots} slots")

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
        out = self._decode(query, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, sinks)
        if out is None:
            return super().paged_attention_decode(
                query, k_cache, v_cache, block_tables, seq_lens, scale, seq_lens_host,
                window=window, softcap=softcap, sinks=sinks,
            )
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
        out = self._decode(
            query, k_cache, v_cache, meta.block_tables.index_select(0, plan.single_requests),
            plan.single_seq_lens, scale, window, softcap, sinks,
        )
        if out is None:
            return super()._attend_single_rows(query, k_cache, v_cache, meta, plan, scale, window, softcap, sinks)
        return out

    def _decode(
        self,
        query: torch.Tensor,  # [B, H, D], heads contiguous, rows any stride
        k_cache: KVCache,
        v_cache: KVCache,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,  # [heads] fp32
    ) -> torch.Tensor | None:
        """The C kernel's answer, or None where it does not take these inputs."""
        code = _DTYPE_CODES.get(query.dtype)
        quantized = isinstance(k_cache, QuantizedKV)
        if quantized:
            # Only int8 has a C path; an fp8 cache on CPU is the reference's.
            if not (_int8_cache(k_cache) and _int8_cache(v_cache)):
                return None
            kv_code, k_data, v_data = _DT_I8, k_cache.data, v_cache.data
            k_scale, v_scale = _ptr(k_cache.scale, "float *"), _ptr(v_cache.scale, "float *")
        else:
            kv_code, k_data, v_data, k_scale, v_scale = code, k_cache, v_cache, _ffi.NULL, _ffi.NULL
        if (
            code is None
            or not _heads_contiguous(query)
            or not _plain(k_data, v_data, seq_lens)
            or not (quantized or k_cache.dtype == v_cache.dtype == query.dtype)
            or block_tables.dtype != torch.int32
            or seq_lens.dtype != torch.int32
            or not block_tables.is_cpu
            or block_tables.stride(-1) != 1
            or not (sinks is None or (sinks.dtype == torch.float32 and sinks.is_contiguous()
                                      and sinks.numel() == query.shape[1]))
        ):
            return None
        batch, heads, dim = query.shape
        num_blocks, block_size, kv_heads, _ = k_cache.shape
        out = torch.empty((batch, heads, dim), dtype=query.dtype)
        status = _lib.eng_paged_decode(
            code, _ptr(out), _ptr(query), query.stride(0), _ptr(k_data), _ptr(v_data), kv_code,
            k_scale, v_scale, num_blocks, _ptr(block_tables, "int32_t *"), block_tables.stride(0),
            _ptr(seq_lens, "int32_t *"), batch, heads, kv_heads, dim, block_size, scale,
            window, softcap, _ffi.NULL if sinks is None else _ptr(sinks, "float *"), torch.get_num_threads(),
        )
        if status == -1:
            return None  # a shape past the kernel's buffers: the reference handles it
        if status:
            raise CpuKernelError("paged attention: a sequence length or block id is out of range")
        return out


def _plain(*tensors: torch.Tensor) -> bool:
    """All in CPU memory and contiguous, so one pointer and the shape describe each."""
    return all(t.is_cpu and t.is_contiguous() for t in tensors)


def _int8_cache(cache: KVCache) -> bool:
    """An int8 :class:`QuantizedKV` whose codes and scales the C kernels can address."""
    return (
        isinstance(cache, QuantizedKV)
        and cache.data.dtype == torch.int8
        and _plain(cache.data, cache.scale)
    )


def _heads_contiguous(x: torch.Tensor) -> bool:
    """[T, heads, D] in CPU memory, D contiguous and heads back to back (tokens any stride)."""
    return x.is_cpu and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


__all__ = ["CpuKernelError", "CpuOps", "available"]
