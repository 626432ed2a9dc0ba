"""The fused CPU decode step (``fused.c``): all decoder layers of a model in one C call per
step (one more per mixture-of-experts layer), for steps of up to :data:`MAX_TOKENS` rows whose
requests each bring a few query tokens: decode rows, and speculative verification chunks
(a request's last verified token and its proposal tokens), each row attended as the decode
step of its own position.

:class:`Planner` checks once per model and KV pool whether the step applies (see
:func:`unfusable` for what it covers) and builds the C descriptors and the scratch
buffers; :meth:`FusedDecode.run` is then one call per step. It knows the model only by the
description the model hands it (:mod:`engine.ops.cpu.fused_spec`). Anything it does not
take stays on the unfused path (the decoder's layers over the ops object), which is the
reference the fused step is tested against (``tests/test_fused_decode.py``).
"""

from __future__ import annotations

import operator
import os

import torch

from engine.ops import LoraSegments, QuantizedKV
from engine.ops.cpu import CpuKernelError, lora_slice_bounds
from engine.ops.cpu import qmatmul as cq
from engine.ops.cpu.fused_spec import DenseProjection, FusedModel, LoraProjection, QuantProjection
from engine.ops.cpu.qpack import pointers
from engine.ops.quant import FORMAT_CODES, QuantizedWeight

try:  # built at install time (setup.py); absent in a source tree nobody built
    from engine.ops.cpu._kernels import ffi as _ffi
    from engine.ops.cpu._kernels import lib as _lib
except ImportError:  # pragma: no cover - depends on the install
    _ffi = _lib = None

# Query rows per fused step: decode rows and speculative verification chunks up to 48.
# Measured (engine throughput at concurrency c, SmolLM2 Q4_1, 2 cores with AMX; the
# unfused path then took AMX-BF16 matmuls from 16 rows): c=12 530 -> 830 tok/s fused,
# c=24 736 -> 953, c=32 867 -> 991, c=40 920 -> 1,056, c=48 even, c=64 the unfused path
# 6% ahead. quant.c's AMX_BF16_MIN_TOKENS (49) keeps the unfused path on the same int8
# kernels up to here, so a step gives the same bits either way.
MAX_TOKENS = 48
_MAX_PARTS = 3  # ENG_MAX_PARTS in fused.h
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_NO_ROPE_MAX_POS = 1 << 62  # a NoPE layer's bound on positions: none


def available() -> bool:
    return _lib is not None and hasattr(_lib, "eng_fused_decode")


def enabled() -> bool:
    """``ENGINE_FUSED_DECODE=0`` turns the fused step off (the unfused path then runs)."""
    return os.environ.get("ENGINE_FUSED_DECODE", "1") != "0"


def _ptr(t: torch.Tensor | None, ctype: str = "void *"):
    return _ffi.NULL if t is None else _ffi.cast(ctype, t.data_ptr())


def _linear_ok(lin, dtype: torch.dtype, k: int) -> str | None:
    if isinstance(lin, DenseProjection):  # quant.c's dense kernel, which Linear runs at these sizes too
        if not (lin.small_batch and lin.weight.dtype == dtype and lin.weight.shape[1] == k):
            return "a dense projection is not in the activation dtype on CPU"
        return None
    if not isinstance(lin, QuantProjection):
        return "a projection is neither dense nor quantized"
    if len(lin.parts) > _MAX_PARTS:
        return "a projection has more than 3 parts"
    for p in lin.parts:
        if not (isinstance(p, QuantizedWeight) and p.layout == "panels" and p.device.type == "cpu"):
            return "a quantized weight is not in CPU panels"
        if p.shape[1] != k or k % 32:
            return "a projection's input width is not the layer's"
    if lin.bias is not None and not (lin.bias.dtype == dtype and lin.bias.is_contiguous()
                                     and lin.bias.numel() == lin.out_features):
        return "a bias is not in the activation dtype"
    return None


def unfusable(model: FusedModel, kv_caches) -> str | None:
    """Why the fused step cannot run the described model over these caches, or None if it can.

    Covered: the generic decoder (Llama, Mistral, Qwen2 with its q/k/v biases, Qwen3 with
    its q/k norms, Phi-3 and Phi-4-mini's partial rotary, SmolLM2 and SmolLM3's layers
    without RoPE; Mixtral and Qwen-MoE, whose sparse MLPs run in torch
    between C calls, and the decoders of LLaVA and Qwen-VL, whose M-RoPE turns each step by
    its own table: :meth:`FusedDecode.run`'s ``rope``), Gemma's layer (Gemma 2 with its
    attention soft-cap, Gemma 3 with its q/k norms and local RoPE, Gemma 1 without the
    post-norms); every projection
    quantized over CPU panels (GGUF blocks kept) or dense in the activation dtype; fp32 or
    bf16 activations, a KV cache in the activation dtype or int8, sliding windows, LoRA
    adapter slots beside the projections (the step's segments given to each run). Not
    covered: tensor parallelism, fp16, fp8 KV. A vision model's
    image embeddings come in prefill steps, which the fused step never runs.
    """
    if not (available() and enabled()):
        return "the fused kernels are not built or are turned off"
    if not cq.available():  # QuantLinear then takes the reference matmul: so does the model
        return "the quantized matmul kernels are not available"
    gemma = model.gemma
    if model.tensor_parallel:
        return "tensor parallelism (the layers' all-reduces are the unfused path's)"
    if getattr(model.ops, "name", None) != "cpu":
        return "the ops are not the CPU kernels"
    dtype = model.dtype
    if dtype not in _DTYPES or model.device.type != "cpu":
        return "activations are not fp32 or bf16 on CPU"
    h, hkv, d = model.heads, model.kv_heads, model.head_dim
    if h % hkv or h // hkv > 16 or d > 256 or d % 2:
        return "attention shape past the decode kernel's buffers"
    hidden = model.hidden
    inter = _inter(model)
    for layer in model.layers:
        projections = [(layer.qkv, hidden), (layer.o, h * d)]
        if layer.external_mlp is None:  # a sparse layer's MLP runs in torch between two C calls
            projections += [(layer.gate_up, hidden), (layer.down, inter)]
        for lin, k in projections:
            why = _linear_ok(lin, dtype, k)
            if why:
                return why
        if layer.qkv.out_features != (h + 2 * hkv) * d or layer.o.out_features != hidden:
            return "unexpected q/k/v or o_proj width"
        if layer.external_mlp is None and (layer.down.in_features != inter or layer.gate_up.out_features != 2 * inter
                                           or layer.down.out_features != hidden):
            return "unexpected MLP width"
        norms = [layer.input_norm, layer.post_norm]
        if gemma:
            # Gemma 2/3 norm before and after each block, Gemma 1 before only, OLMo after only.
            pre, post = (layer.input_norm, layer.pre_ffn_norm), (layer.post_norm, layer.post_ffn_norm)
            norms = [*(pre if pre[0] is not None else ()), *(post if post[0] is not None else ())]
            if not norms or (pre[0] is None) != (pre[1] is None) or (post[0] is None) != (post[1] is None):
                return "a Gemma-style layer's norms are not in pairs around its blocks"
        if layer.q_norm is not None:
            norms += [layer.q_norm, layer.k_norm]
        # Gemma keeps its norms as 1 + w in fp32, Llama in the dtype.
        norm_dtype = torch.float32 if gemma else dtype
        if any(t is None or t.dtype != norm_dtype or not t.is_contiguous() for t in [*norms, model.final_norm]):
            return "a norm weight is not in the dtype the decoder keeps it in"
        for lora in _loras(layer):
            if lora is not None and (
                lora.a.dtype not in _DTYPES or lora.b.dtype != lora.a.dtype or lora.a.dim() != 3
                or lora.b.dim() not in (3, 4) or not (lora.a.is_contiguous() and lora.b.is_contiguous())
                or lora.a.device.type != "cpu"
            ):
                return "LoRA slots the C kernel does not take"
        if layer.rope is None:  # a NoPE layer (SmolLM3): the step skips its rotation
            pass
        elif layer.rope.dtype != dtype or not layer.rope.is_contiguous():
            return "a RoPE table is not in the activation dtype"
        elif layer.rope.shape[-1] > d or layer.rope.shape[-1] % 2:
            return "a RoPE table wider than a head"
    int8 = isinstance(kv_caches[0][0], QuantizedKV)
    for k, v in kv_caches:
        for c in (k, v):
            if int8:
                if not (isinstance(c, QuantizedKV) and c.data.dtype == torch.int8 and c.data.is_contiguous()
                        and c.scale.is_contiguous() and c.scale.dtype == torch.float32):
                    return "a KV cache is neither the activation dtype nor int8"
            elif isinstance(c, QuantizedKV) or c.dtype != dtype or not c.is_contiguous() or not c.is_cpu:
                return "a KV cache is neither the activation dtype nor int8"
    return None


def _loras(layer) -> tuple[LoraProjection | None, ...]:
    return (layer.lora_qkv, layer.lora_o, layer.lora_gate_up, layer.lora_down)


def _inter(model: FusedModel) -> int:
    """The dense MLP's width (one for every dense layer), or 0 where every layer is sparse."""
    dense = [layer.down for layer in model.layers if layer.external_mlp is None]
    return dense[0].in_features if dense else 0


class FusedDecode:
    """The C descriptors of one model over one KV pool, and the step's scratch buffers."""

    def __init__(self, model: FusedModel, kv_caches) -> None:
        dtype = model.dtype
        self.dtype = dtype
        self.hidden = model.hidden
        h, hkv, d = model.heads, model.kv_heads, model.head_dim
        self.head_dim = d
        inter = _inter(model)
        self._keep: list = []  # every buffer a C pointer points into
        self._max_rank = 0  # the widest LoRA projection's R (0: no LoRA slots)
        self.quantized = False  # some projection has quantized parts
        self.dense = False  # some projection is dense (steps up to cq.DENSE_MAX_ROWS rows)
        n = len(model.layers)
        self.layers = _ffi.new("EngFusedLayer[]", n)
        int8 = isinstance(kv_caches[0][0], QuantizedKV)
        gemma = model.gemma
        for i, (layer, (kc, vc)) in enumerate(zip(model.layers, kv_caches, strict=True)):
            L = self.layers[i]
            L.input_norm, L.post_norm = _ptr(layer.input_norm), _ptr(layer.post_norm)
            L.q_norm, L.k_norm = _ptr(layer.q_norm), _ptr(layer.k_norm)
            if gemma:
                L.pre_ffn_norm, L.post_ffn_norm = _ptr(layer.pre_ffn_norm), _ptr(layer.post_ffn_norm)
            for field in ("qkv", "o", "gate_up", "down"):
                lin = getattr(layer, field)
                if lin is not None:
                    self._linear(getattr(L, field), lin)
            L.external_mlp = int(layer.external_mlp is not None)
            for field, lora in zip(("lora_qkv", "lora_o", "lora_gate_up", "lora_down"), _loras(layer), strict=True):
                if lora is not None:
                    self._lora(getattr(L, field), lora)
            if int8:
                L.k_cache, L.v_cache = _ptr(kc.data), _ptr(vc.data)
                L.k_scale, L.v_scale = _ptr(kc.scale, "float *"), _ptr(vc.scale, "float *")
            else:
                L.k_cache, L.v_cache = _ptr(kc), _ptr(vc)
            # A NoPE layer: no table (the step skips the rotation) and no bound on positions.
            L.rope, L.window = _ptr(layer.rope), layer.window
            L.sinks = _ptr(layer.sinks, "float *")  # gpt-oss's attention sinks, else NULL
            L.rope_dim = d if layer.rope is None else layer.rope.shape[-1]  # < d: a partial rotary
            L.max_pos = _NO_ROPE_MAX_POS if layer.rope is None else layer.rope.shape[0]
            self._keep += [layer.rope, layer.sinks, kc, vc]
        kc0 = kv_caches[0][0]
        num_blocks, block_size = kc0.shape[0], kc0.shape[1]
        T = MAX_TOKENS
        qkv_n = (h + 2 * hkv) * d
        max_k = max(self.hidden, h * d, inter)
        inter = max(inter, 32)  # all-sparse models: the dense MLP's buffers go unused
        bufs = {
            "delta": torch.empty(T, self.hidden, dtype=dtype), "x": torch.empty(T, self.hidden, dtype=dtype),
            "qkv": torch.empty(T, qkv_n, dtype=dtype), "attn": torch.empty(T, h * d, dtype=dtype),
            "gate_up": torch.empty(T, 2 * inter, dtype=dtype), "act": torch.empty(T, inter, dtype=dtype),
            "xq": torch.empty(T, max_k, dtype=torch.int8), "dx": torch.empty(T, max_k // 32),
            "xs": torch.empty(T, max_k // 16),
        }
        # The shrunk rows of a LoRA projection (fp32, and as bf16 pairs), for the widest one.
        rank = max(self._max_rank, 2)
        bufs["lora_tmp"] = torch.empty(T * rank, dtype=torch.float32)
        bufs["lora_tp"] = torch.empty(T * rank // 2 + 1, dtype=torch.int32)
        self._keep += list(bufs.values()) + [model.final_norm]
        self._x, self._delta = bufs["x"], bufs["delta"]
        # The sparse layers' MLPs, by layer index (run in torch between C calls).
        self._moe = {i: layer.external_mlp for i, layer in enumerate(model.layers) if layer.external_mlp is not None}
        self._state = _ffi.new("EngFusedState *")
        self.model = m = _ffi.new("EngFusedModel *")
        m.dtype, m.kv_int8, m.gemma, m.softcap = _DTYPES[dtype], int(int8), int(gemma), model.softcap
        m.residual_scale = model.residual_scale
        m.gelu, m.qk_norm_full = int(model.activation == "gelu_tanh"), int(model.qk_norm_full)
        m.quantized = int(self.quantized)
        m.n_layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.inter = n, self.hidden, h, hkv, d, inter
        m.num_blocks, m.block_size, m.max_tokens = num_blocks, block_size, T
        m.eps, m.scale = model.eps, model.scale
        m.layers, m.final_norm = self.layers, _ptr(model.final_norm)
        for name in ("delta", "x", "qkv", "attn", "gate_up", "act"):
            setattr(m, name, _ptr(bufs[name]))
        m.xq, m.dx, m.xs = _ptr(bufs["xq"], "int8_t *"), _ptr(bufs["dx"], "float *"), _ptr(bufs["xs"], "float *")
        m.lora_tmp, m.lora_tp = _ptr(bufs["lora_tmp"], "float *"), _ptr(bufs["lora_tp"], "uint32_t *")
        m.lora_max_rank, m.lora_groups = rank, 0
        self._segments = None  # the last step's LoRA segments (their tensors, which m points into)
        # The unfused path attends a request's query rows one by one with the decode kernel
        # only up to the op set's rowwise_max_query_len (read each step: tests change it);
        # past it they take the padded prefill attention, which the fused step does not run.
        self._ops = model.ops
        self.steps = 0  # fused steps run (tests check the fused path was taken)
        self.chunk_steps = 0  # of which steps with a request of several query rows

    def _lora(self, dst, lora: LoraProjection) -> None:
        a, b = lora.a, lora.b
        r, n = a.shape[1], b.shape[2]
        bounds = lora_slice_bounds(lora.bounds, r, n)
        cols = _ffi.new("int64_t[]", bounds)
        dst.a, dst.b, dst.cols = _ptr(a), _ptr(b), cols
        dst.R, dst.S, dst.nslices = r, a.shape[0], len(bounds) - 1
        dst.wdtype, dst.pairs = _DTYPES[a.dtype], int(b.dim() == 4)
        self._keep += [a, b, cols]
        self._max_rank = max(self._max_rank, r)

    def _linear(self, dst, lin: DenseProjection | QuantProjection) -> None:
        if isinstance(lin, DenseProjection):
            dst.nparts, dst.K, dst.N = 0, lin.weight.shape[1], lin.weight.shape[0]
            dst.dense, dst.bias = _ptr(lin.weight), _ptr(lin.bias)
            self.dense = True
            self._keep += [lin.weight, lin.bias]
            return
        self.quantized = True

        dst.nparts, dst.K, dst.N = len(lin.parts), lin.parts[0].shape[1], lin.out_features
        col = 0
        for j, p in enumerate(lin.parts):
            part = dst.parts[j]
            part.fmt, part.N, part.col = FORMAT_CODES[p.fmt.name], p.shape[0], col
            part.codes, part.hi, part.d, part.m, part.sc, part.mn = pointers(p.data)
            col += p.shape[0]
            self._keep.append(p)
        dst.bias = _ptr(lin.bias)
        if lin.bias is not None:
            self._keep.append(lin.bias)

    def run(
        self, hidden: torch.Tensor, positions: torch.Tensor, meta, *, rope: torch.Tensor | None = None,
        lora: LoraSegments | None = None,
    ) -> torch.Tensor | None:
        """The final normed hidden states [T, hidden] of one step (writes its K/V), or None
        where the step's inputs are not the fused step's (the caller runs the unfused path).
        ``rope``: a cos | sin table every layer rotates by this step instead of its own
        (Qwen-VL's M-RoPE rows, one per token; ``positions`` index it).

        A decode-only step passes the batch's block tables and sequence lengths as they are.
        A step of short chunks (speculative verification: a request's last verified token
        and its proposals, beside decode rows) is given one table row and one sequence
        length per query row, as ``CpuOps`` attends such rows: query ``i`` of a request
        with ``q`` query tokens and ``s`` tokens of context sees its request's table and
        ``s - q + i + 1`` keys. The C step writes every row's K/V before any row attends,
        so each row sees the rows before it in its chunk, and is the decode step of its
        position bit for bit.

        ``lora``: the step's adapter segments (None or inactive: no adapter token); each
        targeted projection's delta is added after it, as the unfused path's LoraLinear
        does, bit for bit."""
        t = hidden.shape[0]
        bt, lens, slots = meta.block_tables, meta.seq_lens, meta.slot_mapping
        if t > MAX_TOKENS:
            return None
        if self.dense and t > cq.DENSE_MAX_ROWS.get(self.dtype, 0):
            return None  # past these rows Linear takes oneDNN: so does the step (unfused)
        chunked = not meta.decode_only
        if chunked:
            rows = self._chunk_rows(meta, t)
            if rows is None:
                return None
            bt, lens = rows
        if (hidden.dtype != self.dtype or not hidden.is_contiguous()
                or positions.dtype != torch.int64 or not positions.is_contiguous()
                or slots.dtype != torch.int64 or not slots.is_contiguous() or slots.shape[0] != t
                or bt.dtype != torch.int32 or bt.stride(-1) != 1 or not bt.is_cpu or bt.shape[0] != t
                or lens.dtype != torch.int32 or not lens.is_contiguous() or lens.shape[0] != t):
            return None
        if rope is None:
            self.model.rope_step = _ffi.NULL
        elif rope.dtype == self.dtype and rope.is_contiguous() and rope.dim() == 2 and rope.shape[1] == self.head_dim:
            self.model.rope_step, self.model.rope_step_rows = _ptr(rope), rope.shape[0]
            self._rope_step = rope  # alive for the call
        else:
            return None
        m = self.model
        if lora is not None and lora.active:
            if not self._max_rank or lora.order.device.type != "cpu":
                return None  # no slots described (planned before --enable-lora), or not on the CPU
            m.lora_order, m.lora_bounds = _ptr(lora.order, "int32_t *"), _ptr(lora.group_bounds, "int32_t *")
            m.lora_slots, m.lora_groups = _ptr(lora.group_slots, "int32_t *"), len(lora.groups)
            self._segments = lora  # alive for the call
        else:
            m.lora_groups = 0
        out = torch.empty_like(hidden)
        st = self._state
        st.R, st.D, st.layer = _ptr(hidden), _ptr(self._delta), 0
        args = (_ptr(out), _ptr(positions, "int64_t *"), _ptr(slots, "int64_t *"), _ptr(bt, "int32_t *"),
                bt.stride(0), _ptr(lens, "int32_t *"), torch.get_num_threads())
        status = _lib.eng_fused_decode(self.model, st, t, *args)
        while status == 1:  # stopped before a sparse layer's MLP: run it in torch, go on after it
            y = self._moe[st.layer](self._x[:t])
            target = hidden if int(_ffi.cast("uintptr_t", st.D)) == hidden.data_ptr() else self._delta
            target[:t].copy_(y)
            st.layer += 1
            status = _lib.eng_fused_decode(self.model, st, t, *args)
        if status == -1:
            return None
        if status:
            raise CpuKernelError("fused decode: a position, slot, sequence length, block id or LoRA group is out "
                                 "of range")
        self.steps += 1
        self.chunk_steps += chunked
        return out

    def _chunk_rows(self, meta, t: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per query row: its request's block table row and the keys it sees (itself
        included), or None where the unfused path would not attend every row as a decode
        row (a chunk past the op set's ``rowwise_max_query_len``)."""
        qlens, slens = meta.query_lens_host, meta.seq_lens_host
        if (meta.max_query_len > getattr(self._ops, "rowwise_max_query_len", 1) or sum(qlens) != t
                or meta.block_tables.dtype != torch.int32 or not meta.block_tables.is_cpu):
            return None
        requests: list[int] = []
        lens: list[int] = []
        for b, (q, s) in enumerate(zip(qlens, slens, strict=True)):
            requests += [b] * q
            lens += range(s - q + 1, s + 1)
        bt = meta.block_tables.index_select(0, torch.tensor(requests))
        return bt, torch.tensor(lens, dtype=torch.int32)


class Planner:
    """One model's fused step: planned over a KV pool on first use, and kept while the same
    cache objects come back (the plan points into them)."""

    __slots__ = ("description", "step", "_caches", "_list", "_pairs")

    def __init__(self, description: FusedModel) -> None:
        self.description = description
        self.step: FusedDecode | None = None  # the last plan (None: the step does not apply)
        self._caches: list | None = None  # the caches it was planned over (None: not yet)
        self._list, self._pairs = None, ()

    def plan(self, kv_caches) -> FusedDecode | None:
        """The fused step over ``kv_caches``, or None where it does not apply."""
        if not enabled():
            return None
        # While the same cache objects come back (the runner passes the same list every
        # step) the plan's pointers are valid: an identity check of ~60 objects,
        # microseconds.
        if self._caches is not None and self._list is kv_caches and all(map(operator.is_, self._pairs, kv_caches)):
            # The same list holding the same (K, V) pairs as last step: the common case,
            # checked without unpacking the pairs (a pair is a tuple, so its members
            # cannot change).
            return self.step
        caches = [c for pair in kv_caches for c in pair]
        if self._caches is not None and len(self._caches) == len(caches) and all(
            a is b for a, b in zip(self._caches, caches, strict=True)
        ):
            self._list, self._pairs = _list_key(kv_caches)
            return self.step
        ok = unfusable(self.description, kv_caches) is None
        self.step = FusedDecode(self.description, kv_caches) if ok else None
        self._caches = caches
        self._list, self._pairs = _list_key(kv_caches)
        return self.step


def _list_key(kv_caches) -> tuple:
    """The list and its pairs, for plan's quick check; only where every pair is a tuple."""
    if all(type(pair) is tuple for pair in kv_caches):
        return kv_caches, tuple(kv_caches)
    return None, ()


__all__ = ["MAX_TOKENS", "FusedDecode", "Planner", "available", "enabled", "unfusable"]
