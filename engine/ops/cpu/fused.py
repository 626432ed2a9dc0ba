"""The fused CPU decode step (``fused.c``): all decoder layers of a model in one C call per
step (one more per mixture-of-experts layer), for steps of up to :data:`MAX_TOKENS` rows whose
requests each bring a few query tokens: decode rows, and speculative verification chunks
(a request's last verified token and its proposal tokens), each row attended as the decode
step of its own position.

:func:`plan` checks once per model and KV pool whether the step applies (see
:func:`unfusable` for what it covers) and builds the C descriptors and the scratch
buffers; :meth:`FusedDecode.run` is then one call per step. Anything it does not take
stays on the unfused path (``LlamaModel.forward`` over the ops object), which is the
reference the fused step is tested against (``tests/test_fused_decode.py``).
"""

from __future__ import annotations

import operator
import os

import torch

from engine.ops import QuantizedKV
from engine.ops.quant import FORMAT_CODES, QuantizedWeight

try:  # built at install time (setup.py); absent in a source tree nobody built
    from engine.ops.cpu._kernels import ffi as _ffi
    from engine.ops.cpu._kernels import lib as _lib
except ImportError:  # pragma: no cover - depends on the install
    _ffi = _lib = None

# Query rows per fused step: a single stream and small batches, where the per-op glue is
# the cost, and speculative verification at k = 4 for up to two requests (2 x (1 + 4)).
# Larger steps keep the unfused path (its matmuls pick AMX-BF16 from 16 rows on CPUs that
# have it, which the fused step's int8 micro-kernels do not follow, and the glue is shared
# by more rows there).
MAX_TOKENS = 10
_MAX_PARTS = 3  # ENG_MAX_PARTS in fused.h
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def available() -> bool:
    return _lib is not None and hasattr(_lib, "eng_fused_decode")


def enabled() -> bool:
    """``ENGINE_FUSED_DECODE=0`` turns the fused step off (the unfused path then runs)."""
    return os.environ.get("ENGINE_FUSED_DECODE", "1") != "0"


def _ptr(t: torch.Tensor | None, ctype: str = "void *"):
    return _ffi.NULL if t is None else _ffi.cast(ctype, t.data_ptr())


def _linear_ok(lin, dtype: torch.dtype, k: int) -> str | None:
    from engine.models.layers.linear import Linear, QuantLinear

    if isinstance(lin, Linear):  # dense: quant.c's dense kernel, which Linear runs at these sizes too
        if not (lin.small_batch and lin.weight.dtype == dtype and lin.weight.shape[1] == k):
            return "a dense projection is not in the activation dtype on CPU"
        return None
    if not isinstance(lin, QuantLinear):
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


def unfusable(model, kv_caches) -> str | None:
    """Why the fused step cannot run this model over these caches, or None if it can.

    Covered: ``LlamaModel`` (Llama, Mistral, Qwen2 with its q/k/v biases, Qwen3 with its
    q/k norms, Phi-3, SmolLM2; Mixtral and Qwen-MoE, whose sparse MLPs run in torch between
    C calls), ``GemmaModel`` (Gemma 2 with its attention soft-cap, Gemma 3 with its q/k
    norms and local RoPE), ``LlavaModel`` and ``QwenVLModel`` (M-RoPE: each step's own
    table); every projection a :class:`QuantLinear` over CPU panels (GGUF blocks kept) or
    a dense ``Linear`` in the activation dtype; fp32 or bf16 activations, a KV cache in the
    activation dtype or int8, sliding windows. Not covered: tensor parallelism, fp16, fp8
    KV, partial rotary tables.
    """
    from engine.models.gemma import GemmaModel
    from engine.models.llama import LlamaModel
    from engine.models.llava import LlavaModel
    from engine.models.qwen_vl import QwenVLModel
    from engine.ops.cpu import qmatmul as cq

    if not (available() and enabled()):
        return "the fused kernels are not built or are turned off"
    if not cq.available():  # QuantLinear then takes the reference matmul: so does the model
        return "the quantized matmul kernels are not available"
    gemma = type(model) is GemmaModel
    # The VLMs' decoders: LLaVA's is Llama's; Qwen-VL's turns each step by its own M-RoPE
    # table (FusedDecode.run passes it). Their image embeddings come in prefill steps,
    # which the fused step never runs (LlamaModel.forward).
    if type(model) not in (LlamaModel, LlavaModel, QwenVLModel) and not gemma:
        return f"{type(model).__name__} is not a decoder the fused step runs"
    if model.tp.enabled:
        return "tensor parallelism (the layers' all-reduces are the unfused path's)"
    if getattr(model.ops, "name", None) != "cpu":
        return "the ops are not the CPU kernels"
    dtype = model.dtype
    if dtype not in _DTYPES or model.device.type != "cpu":
        return "activations are not fp32 or bf16 on CPU"
    h, hkv, d = model.num_heads, model.num_kv_heads, model.head_dim
    if h % hkv or h // hkv > 16 or d > 256 or d % 2:
        return "attention shape past the decode kernel's buffers"
    hidden = model.config.hidden_size
    inter = _inter(model)
    for layer in model.layers:
        if layer.moe is not None and gemma:
            return "a mixture-of-experts layer in a Gemma decoder"
        projections = [(layer.qkv, hidden), (layer.o_proj, h * d)]
        if layer.moe is None:  # a sparse layer's MLP runs in torch between two C calls
            projections += [(layer.gate_up, hidden), (layer.down, inter)]
        for lin, k in projections:
            why = _linear_ok(lin, dtype, k)
            if why:
                return why
        if _out_features(layer.qkv) != (h + 2 * hkv) * d or _out_features(layer.o_proj) != hidden:
            return "unexpected q/k/v or o_proj width"
        if layer.moe is None and (_in_features(layer.down) != inter or _out_features(layer.gate_up) != 2 * inter
                                  or _out_features(layer.down) != hidden):
            return "unexpected MLP width"
        norms = [layer.input_norm, layer.post_norm]
        if gemma:
            norms += [layer.pre_ffn_norm, layer.post_ffn_norm]
        if layer.q_norm is not None:
            norms += [layer.q_norm, layer.k_norm]
        # Gemma keeps its norms as 1 + w in fp32 (GemmaModel._norm_weight), Llama in the dtype.
        norm_dtype = torch.float32 if gemma else dtype
        if any(t is None or t.dtype != norm_dtype or not t.is_contiguous() for t in [*norms, model.norm]):
            return "a norm weight is not in the dtype the decoder keeps it in"
        if layer.rope.dtype != dtype or not layer.rope.is_contiguous():
            return "a RoPE table is not in the activation dtype"
        if layer.rope.shape[-1] != d:
            return "partial rotary embedding"
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


def _inter(model) -> int:
    """The dense MLP's width (one for every dense layer), or 0 where every layer is sparse."""
    dense = [layer.down for layer in model.layers if layer.moe is None]
    return _in_features(dense[0]) if dense else 0


def _in_features(lin) -> int:
    return lin.parts[0].shape[1] if hasattr(lin, "parts") else lin.weight.shape[1]


def _out_features(lin) -> int:
    return lin.out_features if hasattr(lin, "parts") else lin.weight.shape[0]


class FusedDecode:
    """The C descriptors of one model over one KV pool, and the step's scratch buffers."""

    def __init__(self, model, kv_caches) -> None:
        dtype = model.dtype
        self.dtype = dtype
        self.hidden = model.config.hidden_size
        h, hkv, d = model.num_heads, model.num_kv_heads, model.head_dim
        self.head_dim = d
        inter = _inter(model)
        self._keep: list = []  # every buffer a C pointer points into
        self.quantized = False  # some projection has quantized parts
        self.dense = False  # some projection is dense (steps up to cq.DENSE_MAX_ROWS rows)
        n = len(model.layers)
        self.layers = _ffi.new("EngFusedLayer[]", n)
        int8 = isinstance(kv_caches[0][0], QuantizedKV)
        gemma = hasattr(model.layers[0], "pre_ffn_norm")
        for i, (layer, (kc, vc)) in enumerate(zip(model.layers, kv_caches, strict=True)):
            L = self.layers[i]
            L.input_norm, L.post_norm = _ptr(layer.input_norm), _ptr(layer.post_norm)
            L.q_norm, L.k_norm = _ptr(layer.q_norm), _ptr(layer.k_norm)
            if gemma:
                L.pre_ffn_norm, L.post_ffn_norm = _ptr(layer.pre_ffn_norm), _ptr(layer.post_ffn_norm)
            for field, lin in (("qkv", layer.qkv), ("o", layer.o_proj), ("gate_up", layer.gate_up),
                               ("down", layer.down)):
                if lin is not None:
                    self._linear(getattr(L, field), lin)
            L.external_mlp = int(layer.moe is not None)
            if int8:
                L.k_cache, L.v_cache = _ptr(kc.data), _ptr(vc.data)
                L.k_scale, L.v_scale = _ptr(kc.scale, "float *"), _ptr(vc.scale, "float *")
            else:
                L.k_cache, L.v_cache = _ptr(kc), _ptr(vc)
            L.rope, L.max_pos, L.window = _ptr(layer.rope), layer.rope.shape[0], layer.window
            self._keep += [layer.rope, kc, vc]
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
        self._keep += list(bufs.values()) + [model.norm]
        self._x, self._delta = bufs["x"], bufs["delta"]
        # The sparse layers' MLPs, by layer index (run in torch between C calls).
        self._moe = {i: layer.moe for i, layer in enumerate(model.layers) if layer.moe is not None}
        self._state = _ffi.new("EngFusedState *")
        # Qwen-VL sets every layer's table to the step's M-RoPE rows before each forward:
        # a layer-0 table other than the planned one is passed to the step as its table.
        self._layer0, self._rope0 = model.layers[0], model.layers[0].rope
        self.model = m = _ffi.new("EngFusedModel *")
        m.dtype, m.kv_int8, m.gemma, m.softcap = _DTYPES[dtype], int(int8), int(gemma), model.attn_softcap
        m.quantized = int(self.quantized)
        m.n_layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.inter = n, self.hidden, h, hkv, d, inter
        m.num_blocks, m.block_size, m.max_tokens = num_blocks, block_size, T
        m.eps, m.scale = model.eps, model.scale
        m.layers, m.final_norm = self.layers, _ptr(model.norm)
        for name in ("delta", "x", "qkv", "attn", "gate_up", "act"):
            setattr(m, name, _ptr(bufs[name]))
        m.xq, m.dx, m.xs = _ptr(bufs["xq"], "int8_t *"), _ptr(bufs["dx"], "float *"), _ptr(bufs["xs"], "float *")
        # The unfused path attends a request's query rows one by one with the decode kernel
        # only up to the op set's rowwise_max_query_len (read each step: tests change it);
        # past it they take the padded prefill attention, which the fused step does not run.
        self._ops = model.ops
        self.steps = 0  # fused steps run (tests check the fused path was taken)
        self.chunk_steps = 0  # of which steps with a request of several query rows

    def _linear(self, dst, lin) -> None:
        from engine.ops.cpu.qmatmul import _pointers

        if not hasattr(lin, "parts"):  # a dense Linear
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
            part.codes, part.hi, part.d, part.m, part.sc, part.mn = _pointers(p.data)
            col += p.shape[0]
            self._keep.append(p)
        dst.bias = _ptr(lin.bias)
        if lin.bias is not None:
            self._keep.append(lin.bias)

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor | None:
        """The final normed hidden states [T, hidden] of one step (writes its K/V), or None
        where the step's inputs are not the fused step's (the caller runs the unfused path).

        A decode-only step passes the batch's block tables and sequence lengths as they are.
        A step of short chunks (speculative verification: a request's last verified token
        and its proposals, beside decode rows) is given one table row and one sequence
        length per query row, as ``CpuOps`` attends such rows: query ``i`` of a request
        with ``q`` query tokens and ``s`` tokens of context sees its request's table and
        ``s - q + i + 1`` keys. The C step writes every row's K/V before any row attends,
        so each row sees the rows before it in its chunk, and is the decode step of its
        position bit for bit."""
        t = hidden.shape[0]
        bt, lens, slots = meta.block_tables, meta.seq_lens, meta.slot_mapping
        if t > MAX_TOKENS:
            return None
        if self.dense:  # past these rows Linear takes oneDNN: so does the step (unfused)
            from engine.ops.cpu.qmatmul import DENSE_MAX_ROWS

            if t > DENSE_MAX_ROWS.get(self.dtype, 0):
                return None
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
        rope = self._layer0.rope
        if rope is self._rope0:
            self.model.rope_step = _ffi.NULL
        elif rope.dtype == self.dtype and rope.is_contiguous() and rope.dim() == 2 and rope.shape[1] == self.head_dim:
            self.model.rope_step, self.model.rope_step_rows = _ptr(rope), rope.shape[0]
            self._rope_step = rope  # alive for the call
        else:
            return None
        out = torch.empty_like(hidden)
        st = self._state
        st.R, st.D, st.layer = _ptr(hidden), _ptr(self._delta), 0
        args = (_ptr(out), _ptr(positions, "int64_t *"), _ptr(slots, "int64_t *"), _ptr(bt, "int32_t *"),
                bt.stride(0), _ptr(lens, "int32_t *"), torch.get_num_threads())
        status = _lib.eng_fused_decode(self.model, st, t, *args)
        while status == 1:  # stopped before a sparse layer's MLP: run it in torch, go on after it
            y = self._moe[st.layer](self._x[:t], self._ops)
            target = hidden if int(_ffi.cast("uintptr_t", st.D)) == hidden.data_ptr() else self._delta
            target[:t].copy_(y)
            st.layer += 1
            status = _lib.eng_fused_decode(self.model, st, t, *args)
        if status == -1:
            return None
        if status:
            from engine.ops.cpu import CpuKernelError

            raise CpuKernelError("fused decode: a position, slot, sequence length or block id is out of range")
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


def plan(model, kv_caches) -> FusedDecode | None:
    """The model's fused step over ``kv_caches`` (cached on the model), or None where it
    does not apply."""
    if not enabled():
        return None
    cached = getattr(model, "_fused", None)
    # The plan holds the cache objects it points into, so while the same objects come
    # back (the runner passes the same list every step) its pointers are valid: an
    # identity check of ~60 objects, microseconds.
    if cached is not None and cached[2] is kv_caches and all(map(operator.is_, cached[3], kv_caches)):
        # The same list holding the same (K, V) pairs as last step: the common case, checked
        # without unpacking the pairs (a pair is a tuple, so its members cannot change).
        return cached[1]
    caches = [c for pair in kv_caches for c in pair]
    if cached is not None and len(cached[0]) == len(caches) and all(
        a is b for a, b in zip(cached[0], caches, strict=True)
    ):
        model._fused = (cached[0], cached[1], *_list_key(kv_caches))
        return cached[1]
    fused = FusedDecode(model, kv_caches) if unfusable(model, kv_caches) is None else None
    model._fused = (caches, fused, *_list_key(kv_caches))
    return fused


def _list_key(kv_caches) -> tuple:
    """The list and its pairs, for plan's quick check; only where every pair is a tuple."""
    if all(type(pair) is tuple for pair in kv_caches):
        return kv_caches, tuple(kv_caches)
    return None, ()


__all__ = ["MAX_TOKENS", "FusedDecode", "available", "enabled", "plan", "unfusable"]
