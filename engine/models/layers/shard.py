"""Which slice of each weight a tensor-parallel rank keeps, cut at load time (issue 21).

The decoders take their weights through :class:`ShardedWeights`, which cuts every tensor to
this rank's slice before casting it, so a rank never holds a second full copy:

* column-parallel (q/k/v by heads, gate/up by intermediate rows, each expert's gate/up, the
  shared expert's gate/up, the embedding and LM head by vocabulary rows): the output rows;
* row-parallel (o, down, each expert's down, the shared expert's down): the input columns;
  the partial products are summed by :meth:`TensorParallel.all_reduce`;
* replicated: norms, the MoE router and the shared expert's gate.

Row-parallel o and down kept in the C kernels' panels (a GGUF on CPU) are the exception,
:class:`RowParallel`'s *gathered* form: each rank keeps their output rows instead and
multiplies the gathered whole input, and the outputs are gathered. The C kernels round the
activations to int8 per 32 columns, and a sum that differs from one rank's in its last bit
(what an all-reduce's order of summation gives) moves the next layer's int8 roundings:
measured on SmolLM2 Q4_1, one ulp on every o/down output moves the logits by 0.6 (1.7% of
their range) in one step. Gathered, every value a rank computes is one rank's, bit for bit.

KV heads: with ``num_kv_heads >= N`` rank ``r`` keeps ``num_kv_heads / N`` of them; with
fewer KV heads than ranks, each KV head is copied to the ``N / num_kv_heads`` ranks whose
query heads read it (rank ``r`` keeps KV head ``r * num_kv_heads // N``).

GGUF weights kept in their blocks (:class:`~engine.ops.quant.QuantizedWeight`) are cut
without dequantizing: by rows of the CPU kernels' panels (16 rows; a cut inside a panel
unpacks and repacks the panels it touches, which is lossless) or of GGUF's block rows, and
by columns on the format's block boundaries (32 values, or 256 for the k-quants). A
row-parallel cut that falls inside a block is refused, naming the tensor.

A model larger than one device loads on the host and is built for the device: the weights
(dense, or GGUF's block rows, loaded with the Triton backend's layout) are cut on the host
and only the rank's cut is moved (``build_model(..., device=rank's device, tp=)``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.errors import CorruptModelError, UnsupportedModelError
from engine.models.checkpoint import StoredTensor, read_stored
from engine.models.config import ModelConfig
from engine.models.gguf_quant import cut_inside_blocks
from engine.models.layers.linear import make_linear
from engine.models.vision_config import Gemma3VisionConfig
from engine.ops.quant import PANEL, Decoded, QuantizedWeight, pack_panels, unpack_panels
from engine.parallel import SINGLE, TensorParallel, shard_range, stage_layers


def tensor_parallel_problem(config: ModelConfig, n: int, *, expert_parallel: bool = False) -> str | None:
    """Why ``config``'s model cannot be split over ``n`` ranks (a message naming the counts),
    or ``None`` when it can; with ``expert_parallel`` its routed experts dealt out whole.
    The CLI calls it before starting any worker."""
    if n < 1:
        return f"tensor-parallel size must be at least 1, got {n}"
    if n == 1:
        return None
    if config.is_encoder:
        return "tensor parallelism is not supported for encoder (BERT) models"
    if config.vision is not None and not isinstance(config.vision, Gemma3VisionConfig):
        return "tensor parallelism is not supported for vision-language models (LLaVA, Qwen-VL, SmolVLM, InternVL), Qwen2-Audio and Whisper"
    problems = []
    if config.recurrent is not None and (why := config.recurrent.tensor_parallel_problem(n)):
        problems.append(why)
    h, hkv = config.num_attention_heads, config.num_key_value_heads
    recurrent = config.recurrent
    if recurrent is not None and len(recurrent.layers) + len(recurrent.mlp_layers) == config.num_hidden_layers:
        h = hkv = n  # no attention layer (Mamba, Mamba-2 alone): no heads to split
    if h % n:
        problems.append(f"num_attention_heads ({h}) does not divide by {n}")
    if hkv >= n and hkv % n:
        problems.append(f"num_key_value_heads ({hkv}) does not divide by {n}")
    elif hkv < n and n % hkv:
        problems.append(
            f"num_key_value_heads ({hkv}) is fewer than {n} ranks and {n} is not a multiple "
            f"of it (each rank's query heads must share one KV head)"
        )
    moe = config.moe
    dense_layers = config.num_hidden_layers if moe is None else config.num_hidden_layers - len(moe.sparse_layers)
    # Granite 4's shared MLP sits beside the experts of every layer.
    if (dense_layers or config.architecture == "granite_hybrid") and config.intermediate_size % n:
        problems.append(f"intermediate_size ({config.intermediate_size}) does not divide by {n}")
    if moe is not None and moe.sparse_layers:
        if expert_parallel and moe.num_experts % n:
            problems.append(f"the {moe.num_experts} routed experts do not divide by {n} (expert parallelism)")
        elif not expert_parallel and moe.intermediate_size % n:
            problems.append(f"the experts' intermediate size ({moe.intermediate_size}) does not divide by {n}")
        shared = moe.shared_expert_intermediate_size
        if shared and shared % n:
            problems.append(f"shared_expert_intermediate_size ({shared}) does not divide by {n}")
    if config.vocab_size % n:
        problems.append(f"vocab_size ({config.vocab_size}) does not divide by {n}")
    if not problems:
        return None
    return f"the model cannot be split over tensor-parallel size {n}: " + "; ".join(problems)


def pipeline_parallel_problem(config: ModelConfig, n: int,
                              partition: tuple[int, ...] | None = None) -> str | None:
    """Why ``config``'s model cannot be split into ``n`` pipeline stages (``partition``: each
    stage's layer count), or ``None`` when it can."""
    if n == 1 and partition is None:
        return None
    if config.is_encoder:
        return "pipeline parallelism is not supported for encoder (BERT) models"
    if config.vision is not None:
        return ("pipeline parallelism is not supported for multimodal models (LLaVA, Whisper, "
                "Qwen-VL, Qwen2-Audio, Gemma 3 with images; --limit-mm-per-prompt 0 serves Gemma 3 as text)")
    try:  # (counted in decoder layers: Falcon-H1's are two cache layers each)
        stage_layers(config.num_hidden_layers // config.cache_layers_per_layer, n, partition)
    except ValueError as exc:
        return f"the model cannot be split into {n} pipeline stages: {exc}"
    return None


def check_tensor_parallel(config: ModelConfig, tp: TensorParallel) -> None:
    """Raise :class:`UnsupportedModelError` with :func:`tensor_parallel_problem`'s message
    (or :func:`pipeline_parallel_problem`'s, for the pipeline stage ``tp`` belongs to)."""
    problem = tensor_parallel_problem(config, tp.world_size, expert_parallel=tp.expert_parallel)
    if problem is None and tp.stage.enabled:
        problem = pipeline_parallel_problem(config, tp.stage.count)
    if problem is not None:
        raise UnsupportedModelError(problem)


def local_heads(config: ModelConfig, tp: TensorParallel = SINGLE) -> tuple[int, int]:
    """``(query heads, KV heads)`` rank ``tp.rank`` holds."""
    n = tp.world_size
    return config.num_attention_heads // n, max(config.num_key_value_heads // n, 1)


def kv_head_range(config: ModelConfig, tp: TensorParallel = SINGLE) -> tuple[int, int]:
    """``[first, last)`` of the KV heads rank ``tp.rank`` keeps (see the module docstring)."""
    hkv, n = config.num_key_value_heads, tp.world_size
    if hkv >= n:
        return shard_range(hkv, tp.rank, n)
    head = tp.rank * hkv // n
    return head, head + 1


def vocab_range(config: ModelConfig, tp: TensorParallel = SINGLE) -> tuple[int, int]:
    """``[first, last)`` of the token ids whose embedding and logits rank ``tp.rank`` holds."""
    return shard_range(config.vocab_size, tp.rank, tp.world_size)


# --- cutting one weight ----------------------------------------------------------------------


def _own(t: torch.Tensor) -> torch.Tensor:
    """A slice in its own storage, so the full tensor it came from can be freed."""
    return t.clone(memory_format=torch.contiguous_format)


def take_rows(w, spans: list[tuple[int, int]]):
    """Rows ``spans`` (``[start, stop)`` each, concatenated) of a dense tensor (1-D: a
    bias) or a quantized weight (any rows: a panel cut inside is repacked)."""
    if isinstance(w, QuantizedWeight):
        parts = [_quant_rows(w, a, b) for a, b in spans]
        return parts[0] if len(parts) == 1 else _cat_quant_rows(parts)
    if len(spans) == 1:
        a, b = spans[0]
        return _own(w[a:b])
    return torch.cat([w[a:b] for a, b in spans])


def take_cols(w, start: int, stop: int, name: str):
    """Columns ``[start, stop)`` (input features) of a dense or quantized ``[N, K]`` weight;
    ``name`` is the tensor's, for the refusal of a cut inside a quantized block."""
    if isinstance(w, QuantizedWeight):
        return _quant_cols(w, start, stop, name)
    return _own(w[..., start:stop])


def _quant_rows(w: QuantizedWeight, a: int, b: int) -> QuantizedWeight:
    n, k = w.shape
    if (a, b) == (0, n):
        return w
    if w.layout == "blocks":
        return QuantizedWeight(w.fmt, (b - a, k), "blocks", {"raw": _own(w.data["raw"][a:b])})
    p0, p1 = a // PANEL, -(-b // PANEL)
    if a % PANEL == 0 and (b % PANEL == 0 or b == n):
        return QuantizedWeight(w.fmt, (b - a, k), "panels", {f: _own(t[p0:p1]) for f, t in w.data.items()})
    # A cut inside a panel: the panels it touches, unpacked, cut and packed again (the
    # codes and scales are copied, not recomputed: lossless).
    covering = {f: t[p0:p1] for f, t in w.data.items()}
    rows = min(p1 * PANEL, n) - p0 * PANEL
    dec = unpack_panels(w.fmt, covering, rows, k)
    lo, hi = a - p0 * PANEL, b - p0 * PANEL
    cut = Decoded(w.fmt, dec.codes[lo:hi].contiguous(), {f: t[lo:hi].contiguous() for f, t in dec.fields.items()})
    return QuantizedWeight(w.fmt, (b - a, k), "panels", pack_panels(cut))


def _cat_quant_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    if parts[0].layout == "panels" and any(p.shape[0] % PANEL for p in parts[:-1]):
        # Panels only concatenate whole: repack the rows together.
        decs = [p.decoded() for p in parts]
        fields = {f: torch.cat([d.fields[f] for d in decs]) for f in decs[0].fields}
        dec = Decoded(parts[0].fmt, torch.cat([d.codes for d in decs]), fields)
        n = sum(p.shape[0] for p in parts)
        return QuantizedWeight(parts[0].fmt, (n, parts[0].shape[1]), "panels", pack_panels(dec))
    return QuantizedWeight.cat_rows(parts)


def _quant_cols(w: QuantizedWeight, a: int, b: int, name: str) -> QuantizedWeight:
    n, k = w.shape
    if (a, b) == (0, k):
        return w
    block = w.fmt.block
    if a % block or b % block:
        raise cut_inside_blocks(name, w.fmt, a, b, k)
    if w.layout == "blocks":
        bb = w.fmt.block_bytes
        raw = w.data["raw"][:, a // block * bb : b // block * bb]
        return QuantizedWeight(w.fmt, (n, b - a), "blocks", {"raw": _own(raw)})
    g0, g1 = a // 32, b // 32  # groups of 32 columns
    s0, s1 = a // 256, b // 256  # k-quant super-blocks
    data = {}
    for field, t in w.data.items():
        if field in ("d", "dmin") and block == 256:
            data[field] = _own(t[:, s0:s1])
        elif field == "sc" and w.fmt.group == 16:
            data[field] = _own(t[:, 2 * g0 : 2 * g1])  # one scale per 16 columns (Q6_K, Q3_K, Q2_K)
        else:  # codes, high bits, per-32 scales and mins, and the 32-column formats' d/m
            data[field] = _own(t[:, g0:g1])
    return QuantizedWeight(w.fmt, (n, b - a), "panels", data)


class ShardedWeights:
    """Fetches a weight by Hugging Face name, cut to this rank's slice, then cast to the
    model dtype and device; names a missing one. With ``SINGLE`` every cut is the whole.

    ``weights`` holds tensors (cut here, each cut copied into its own storage) or, loaded
    lazily, :class:`~engine.models.checkpoint.StoredTensor` s, of which only the cut is
    read from the file."""

    def __init__(self, weights: Mapping, dtype: torch.dtype, device: torch.device, tp: TensorParallel = SINGLE):
        self.weights, self.dtype, self.device, self.tp = weights, dtype, device, tp

    def _raw(self, name: str):
        try:
            return self.weights[name]
        except KeyError:
            raise CorruptModelError(f"weight {name!r} is missing from the checkpoint") from None

    def _cast(self, w):
        if isinstance(w, QuantizedWeight) and w.layout == "blocks" and w.device.type != self.device.type:
            # GGUF's block rows loaded on the host (``load_model(device="cpu",
            # ops_backend="triton")``): only the rank's cut travels to its device.
            return QuantizedWeight(w.fmt, w.shape, "blocks", {"raw": w.data["raw"].to(self.device)})
        return w.to(device=self.device, dtype=self.dtype).contiguous()

    def __call__(self, name: str):
        """The whole weight (replicated on every rank: norms, routers)."""
        return self._cast(read_stored(self._raw(name)))

    def rows(self, name: str, sizes: tuple[int, ...] | None = None, spans: list[list[tuple[int, int]]] | None = None):
        """Column-parallel: this rank's rows. The weight is the row-wise concatenation of
        parts of ``sizes`` (one part, its full length, when ``None``); each part is cut to
        an equal share, or to the ``spans`` given per part (KV heads), and the cuts are
        joined in part order."""
        w = self._raw(name)
        if not self.tp.enabled:
            return self(name)
        sizes = sizes or (w.shape[0],)
        cut, start = [], 0
        for i, size in enumerate(sizes):
            part = spans[i] if spans is not None else [shard_range(size, self.tp.rank, self.tp.world_size)]
            cut += [(start + a, start + b) for a, b in part]
            start += size
        if start != w.shape[0]:
            raise CorruptModelError(f"weight {name!r} has {w.shape[0]} rows, expected {start}")
        return self._cast(w.read_rows(cut) if isinstance(w, StoredTensor) else take_rows(w, cut))

    def pick_rows(self, name: str, spans: list[tuple[int, int]]):
        """Rows ``spans`` of the whole weight, joined in order, whatever the rank (read
        alone where the weight is stored; a quantized weight's rows stay in blocks)."""
        w = self._raw(name)
        return self._cast(w.read_rows(spans) if isinstance(w, StoredTensor) else take_rows(w, spans))

    def cols(self, name: str):
        """Row-parallel: this rank's equal share of the input columns."""
        w = self._raw(name)
        if not self.tp.enabled:
            return self(name)
        a, b = shard_range(w.shape[-1], self.tp.rank, self.tp.world_size)
        return self._cast(w.read_cols(a, b) if isinstance(w, StoredTensor) else take_cols(w, a, b, name))

    def cols_or_dense(self, name: str):
        """Row-parallel, as :meth:`cols`, where the cut falls on the weight's block
        boundaries (or it is dense); where it would split its blocks (an expert's down
        projection kept in blocks, over a rank count its blocks do not divide), the whole
        weight dequantized, then cut: dense in the model dtype."""
        w = self._raw(name)
        if not self.tp.enabled:
            return self(name)
        a, b = shard_range(w.shape[-1], self.tp.rank, self.tp.world_size)
        fmt = w.fmt if isinstance(w, QuantizedWeight) else getattr(w, "keep", None)
        if fmt is None or (a % fmt.block == 0 and b % fmt.block == 0):
            return self.cols(name)
        return self._cast(_own(read_stored(w).dequantize()[:, a:b]))

    def row_parallel(self, name: str):
        """A row-parallel projection (o, down) over this rank's share of the input features,
        returning the whole output on every rank: the plain projection on one rank, else a
        :class:`RowParallel` (gathered for weights in the C kernels' panels)."""
        w = self._raw(name)
        if not self.tp.enabled:
            return make_linear([self(name)])
        if not gathers(w):
            return RowParallel(make_linear([self.cols(name)]), self.tp, gathered=False)
        n, world = w.shape[0], self.tp.world_size
        if n % world:
            raise UnsupportedModelError(
                f"{name}: its {n} output rows do not divide by tensor-parallel size {world} (a "
                f"weight kept in GGUF blocks on CPU is split by its output rows)")
        return RowParallel(make_linear([self.rows(name)]), self.tp, gathered=True)


def gathers(w) -> bool:
    """Whether a row-parallel weight is split by output rows over the gathered input (see
    the module docstring): blocks kept in the C kernels' panels, which round activations."""
    layout = w.layout if isinstance(w, QuantizedWeight | StoredTensor) else None
    return layout == "panels"


class RowParallel:
    """One rank's row-parallel projection: called with this rank's share of the input
    features ``[T, K / N]``, it returns the whole output ``[T, out]`` on every rank.

    Reduced (dense weights, GGUF's block rows): the rank holds the input columns of its
    share and the ranks' partial products are summed by one all-reduce; in fp32 the sum
    differs from one rank's in the order of summation only. Gathered (``gathered``: the C
    kernels' panels): the rank holds ``out / N`` output rows and multiplies the whole
    input, gathered from the ranks; the outputs are gathered in rank order. Two gathers
    instead of one all-reduce (the input's ``K`` values a token where the reduce moved
    ``out``), and every output value is computed as on one rank, from the same inputs.
    """

    __slots__ = ("linear", "tp", "gathered")

    def __init__(self, linear, tp: TensorParallel, *, gathered: bool) -> None:
        self.linear, self.tp, self.gathered = linear, tp, gathered

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gathered:
            return self.tp.all_gather_last(self.linear(self.tp.all_gather_last(x)))
        return self.tp.all_reduce(self.linear(x))

    def describe(self):
        """The rank's projection as the fused CPU step reads it (which tensor parallelism
        does not run: its collectives are this class's)."""
        return self.linear.describe()


def qkv_spans(config: ModelConfig, tp: TensorParallel) -> tuple[tuple[int, int, int], list[list[tuple[int, int]]]]:
    """The row sizes of q, k, v and this rank's row span of each (by head)."""
    d = config.head_dim
    h, hkv = config.num_attention_heads, config.num_key_value_heads
    q0, q1 = shard_range(h, tp.rank, tp.world_size)
    k0, k1 = kv_head_range(config, tp)
    kv = [(k0 * d, k1 * d)]
    return (h * d, hkv * d, hkv * d), [[(q0 * d, q1 * d)], kv, kv]


__all__ = [
    "RowParallel",
    "ShardedWeights",
    "gathers",
    "check_tensor_parallel",
    "kv_head_range",
    "local_heads",
    "qkv_spans",
    "take_cols",
    "take_rows",
    "tensor_parallel_problem",
    "vocab_range",
]
