"""The decoder of GPT-2 and OPT: learned absolute positions, LayerNorm with a bias, a plain
two-matmul MLP (GELU or ReLU), biases on every projection, a head tied to the embedding.

It reuses the generic decoder's attention (:meth:`Decoder._attention` with no RoPE table),
its vocabulary-parallel embedding and LM head and its tensor-parallel cuts; what differs
is the layer around the attention::

    pre-norm (GPT-2, most OPTs)            post-norm (OPT-350m: do_layer_norm_before false)
    h = h + o(attn(ln1(h))) + o_bias        h = ln1(h + o(attn(h)) + o_bias)
    h = h + fc2(act(fc1(ln2(h)))) + b2      h = ln2(h + fc2(act(fc1(h))) + b2)

and the ends: ``wte[ids] (@ project_in) + wpe[positions + offset]`` in front (OPT's table
starts 2 rows in), a final LayerNorm (not OPT-350m's) and ``@ project_out`` behind (OPT's
``word_embed_proj_dim``). Positions are the engine's (chunked prefill, prefix caching and
speculative decoding each give a token its place in its request), so a row's position
embedding is the one transformers gives the same token.

The family modules (``engine.models.gpt2``, ``engine.models.opt``) only name the
checkpoint's tensors (:class:`AbsoluteNames`); GPT-2's Conv1D weights, stored ``[in, out]``,
are presented transposed (:class:`~engine.models.checkpoint.Transposed`), so every weight
here is ``[out, in]``.

LayerNorm and the activation run in torch on every op set (``F.layer_norm``, ``F.gelu``,
``F.relu``), attention and the KV cache through the op set. The fused CPU decode step
(``engine/ops/cpu/fused.c``) is the RMSNorm/gated-MLP layer's: these models always take
the unfused path (their ``fused_step`` stays None).

Tensor parallelism: q/k/v and fc1 are split by rows (heads, and a share of the MLP), with
their biases; o and fc2 by input columns, all-reduced, and their biases added once after
the reduce; norms, position table and OPT's projections are replicated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from engine.errors import CorruptModelError, UnsupportedModelError
from engine.models.checkpoint import StoredTensor, Transposed, read_stored
from engine.models.config import ModelConfig
from engine.models.layers.decoder import Decoder, DecoderLayer
from engine.models.layers.linear import embed, is_quantized, make_linear
from engine.models.layers.shard import ShardedWeights, qkv_spans
from engine.ops import AttentionMetadata, Ops
from engine.parallel import SINGLE, TensorParallel

_ACTIVATIONS = {
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


@dataclasses.dataclass(frozen=True, slots=True)
class AbsoluteNames:
    """Where a family keeps each tensor (``{i}`` is the layer index; a norm's or a
    projection's name is without its ``.weight`` / ``.bias``)."""

    embed: str
    positions: str
    layer: str  # the layers' prefix, e.g. "transformer.h.{i}."
    attn_norm: str  # the rest relative to the layer prefix
    qkv: tuple[str, ...]  # one fused projection (GPT-2's c_attn) or q, k, v
    o: str
    mlp_norm: str
    fc1: str
    fc2: str
    final_norm: str
    project_in: str | None = None  # OPT with word_embed_proj_dim != hidden_size
    project_out: str | None = None


def absolute_weight_names(config: ModelConfig, names: AbsoluteNames) -> list[str]:
    """The tensors a model of ``config`` reads under ``names``."""
    spec = config.absolute
    assert spec is not None  # an ABSOLUTE_ARCHITECTURES config
    out = [names.embed + ".weight", names.positions + ".weight"]
    if spec.embed_dim != config.hidden_size:
        if names.project_in is None or names.project_out is None:
            raise UnsupportedModelError(f"{config.architecture}: an embedding narrower than hidden_size")
        out += [names.project_in + ".weight", names.project_out + ".weight"]
    for i in range(config.num_hidden_layers):
        p = names.layer.format(i=i)
        for part in (names.attn_norm, *names.qkv, names.o, names.mlp_norm, names.fc1, names.fc2):
            out += [p + part + ".weight", p + part + ".bias"]
    if spec.final_norm:
        out += [names.final_norm + ".weight", names.final_norm + ".bias"]
    if not config.tie_word_embeddings:
        out.append("lm_head.weight")
    return out


def transposed(w):
    """``w`` as ``[out, in]``: a checkpoint's Conv1D ``[in, out]`` as a tensor's transposed
    view or a stored tensor's :class:`Transposed`. Blocks kept from a GGUF (a
    ``QuantizedWeight``, or a stored tensor read as one) are ``[out, in]`` already, as
    llama.cpp writes GPT-2's projections (its GGUF reader presents the dense ones as
    ``[in, out]``, as a Hugging Face checkpoint has them)."""
    if is_quantized(w) or (isinstance(w, StoredTensor) and w.layout is not None):
        return w
    return Transposed(w) if isinstance(w, StoredTensor) else w.t()


class HeadsRegrouped(Mapping):
    """A checkpoint's tensors with a fused q/k/v projection stored head by head (each
    head's q, k and v rows together: ``[heads, 3, head_dim]``; GPT-NeoX's, multi-head
    GPTBigCode's) regrouped as q's rows, then k's, then v's, the layout the decoder cuts;
    the tensors whose names end in ``names`` (weight and bias), read on demand."""

    def __init__(self, weights: Mapping, heads: int, names: tuple[str, ...]) -> None:
        self._weights, self._heads, self._names = weights, heads, names

    def __getitem__(self, name: str) -> Any:
        w = self._weights[name]
        if name.endswith(self._names):
            w = read_stored(w)
            return w.reshape(self._heads, 3, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape)
        return w

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)


@dataclasses.dataclass(slots=True)
class AbsoluteLayer(DecoderLayer):
    """A GPT-2 / OPT layer: the generic layer's projections (``gate_up`` is fc1, ``down``
    fc2; no RoPE, no q/k norms) with LayerNorm biases and the row-parallel biases."""

    input_norm_bias: torch.Tensor
    post_norm_bias: torch.Tensor
    o_bias: torch.Tensor  # added after o's all-reduce (once, not once per rank)
    down_bias: torch.Tensor


def biased_layer(get: ShardedWeights, config: ModelConfig, tp: TensorParallel, p: str, *,
                 norms: tuple[str, str], qkv: tuple[str, ...], o: str, fc1: str, fc2: str, window: int = 0,
                 rope: torch.Tensor | None = None) -> AbsoluteLayer:
    """Layer ``p``'s LayerNorms (before attention, before the MLP: the same name twice for
    one norm read by both) and biased projections under the names given (relative to
    ``p``; without ``.weight`` / ``.bias``): q/k/v as one fused projection (each part cut
    to this rank's heads) or three, o and fc2 row-parallel with their biases kept apart
    (added once, after the all-reduce)."""
    sizes, spans = qkv_spans(config, tp)
    if len(qkv) == 1:  # fused q/k/v: each part cut to this rank's heads, fused again
        fused = p + qkv[0]
        attn = make_linear([get.rows(fused + ".weight", sizes, spans)], get.rows(fused + ".bias", sizes, spans))
    else:
        parts = list(zip(qkv, spans, strict=True))
        attn = make_linear([get.rows(p + n + ".weight", spans=[s]) for n, s in parts],
                           torch.cat([get.rows(p + n + ".bias", spans=[s]) for n, s in parts]))
    (w1, b1), (w2, b2) = ((get(p + n + ".weight"), get(p + n + ".bias")) for n in norms)
    if norms[0] == norms[1]:
        w2, b2 = w1, b1  # one norm: the same tensors, so a block can tell
    return AbsoluteLayer(
        input_norm=w1, input_norm_bias=b1, post_norm=w2, post_norm_bias=b2, qkv=attn,
        o_proj=get.row_parallel(p + o + ".weight"), o_bias=get(p + o + ".bias"), q_norm=None, k_norm=None,
        gate_up=make_linear([get.rows(p + fc1 + ".weight")], get.rows(p + fc1 + ".bias")),
        down=get.row_parallel(p + fc2 + ".weight"), down_bias=get(p + fc2 + ".bias"), window=window, rope=rope,
    )


class RotaryLayerNormDecoder(Decoder):
    """The RoPE families on GPT-2's layer (:class:`AbsoluteLayer`: LayerNorms with biases,
    biased projections, a plain GELU MLP, exact or tanh as ``config.activation`` says):
    StarCoder2, GPT-NeoX, Phi. A family builds its layers (:func:`biased_layer`) and sets
    ``parallel`` (attention and the MLP side by side: ``attn(ln1(x)) + mlp(ln2(x)) + x``,
    else one after the other); the step is this class's. The fused CPU step does not run
    it."""

    parallel: bool = False
    FINAL_NORM = "model.norm"  # the final LayerNorm's name (without .weight / .bias)

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping,
        ops: Ops,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        tp: TensorParallel = SINGLE,
    ) -> None:
        self._init_common(config, ops, dtype, device, tp, scale=config.head_dim**-0.5)
        self._init_rope_tables()
        weights = self._stored(weights)
        get = ShardedWeights(weights, dtype, self.device, tp)
        self._build_ends(get, weights, lambda: (get(self.FINAL_NORM + ".weight"), get(self.FINAL_NORM + ".bias")))
        self.layers = [self._layer(get, i) for i in tp.stage.layer_range(config.num_hidden_layers)]

    def _stored(self, weights: Mapping) -> Mapping:
        """The checkpoint's tensors as the layers read them (a family may rename or regroup)."""
        return weights

    def act(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh" if self.config.activation == "gelu_tanh" else "none")

    def _ln(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, self.eps)

    def plan_fused_step(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """None: the fused CPU step computes the RMSNorm/gated-MLP layer, not this one."""
        return None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm (``self.norm``: weight, bias);
        writes this step's K/V."""

        def mlp(layer: AbsoluteLayer, x: torch.Tensor) -> torch.Tensor:
            return layer.down(self.act(layer.gate_up(x))) + layer.down_bias  # down: row-parallel, whole

        def block(layer: AbsoluteLayer, hidden: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
            x = self._ln(hidden, layer.input_norm, layer.input_norm_bias)
            attn = self._attention(layer, x, positions, meta, k_cache, v_cache) + layer.o_bias
            if not self.parallel:
                hidden = hidden + attn
                return hidden + mlp(layer, self._ln(hidden, layer.post_norm, layer.post_norm_bias))
            if layer.post_norm is not layer.input_norm:  # GPT-NeoX's second norm; Phi's one serves both
                x = self._ln(hidden, layer.post_norm, layer.post_norm_bias)
            return attn + mlp(layer, x) + hidden

        return self._run_stream(input_ids, positions, kv_caches, block,  # type: ignore[return-value]
                                lambda h: self._ln(h, *self.norm), mm_embeds=mm_embeds)


class AbsoluteDecoder(Decoder):
    """GPT-2 / OPT over the tensors :attr:`NAMES` names (see the module docstring)."""

    NAMES: AbsoluteNames  # the family's

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        return absolute_weight_names(config, cls.NAMES)

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping,
        ops: Ops,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        tp: TensorParallel = SINGLE,
    ) -> None:
        spec = config.absolute
        assert spec is not None  # the registry files only ABSOLUTE_ARCHITECTURES here
        # eps: the LayerNorms'
        self._init_common(config, ops, dtype, device, tp, scale=config.head_dim**-0.5 if spec.scale_attention else 1.0)
        self.pre_norm = spec.pre_norm
        self.position_offset = spec.position_offset
        self.act = _ACTIVATIONS[config.activation]
        names = self.NAMES
        get = ShardedWeights(self._stored(weights), dtype, self.device, tp)
        # A pipeline stage holds its layers; the first also the token and position tables
        # (and OPT's project_in), the last the final norm, project_out and the head.
        first, last = tp.stage.first, tp.stage.last
        tied = config.tie_word_embeddings
        self.embed = get.rows(names.embed + ".weight") if first or (last and tied) else None
        self.positions = get(names.positions + ".weight") if first else None
        rows = config.max_position_embeddings + self.position_offset  # the last position the engine gives, + 1
        if self.positions is not None and self.positions.shape[0] < rows:
            raise CorruptModelError(
                f"{names.positions}.weight has {self.positions.shape[0]} rows; max_position_embeddings "
                f"{config.max_position_embeddings} (+ offset {self.position_offset}) needs {rows}")
        projected = spec.embed_dim != config.hidden_size
        self.project_in = make_linear([get(names.project_in + ".weight")]) if projected and first else None  # type: ignore[operator]
        self.project_out = make_linear([get(names.project_out + ".weight")]) if projected and last else None  # type: ignore[operator]
        self.layers = [self._layer(get, i) for i in tp.stage.layer_range(config.num_hidden_layers)]
        self.norm = (get(names.final_norm + ".weight"), get(names.final_norm + ".bias")) if spec.final_norm and last else None
        self.lm_head = None
        if last:
            self.lm_head = make_linear([self.embed] if tied else [get.rows("lm_head.weight")])

    def _stored(self, weights: Mapping) -> Mapping:
        """The checkpoint's tensors as ``[out, in]`` weights (GPT-2 transposes its Conv1Ds)."""
        return weights

    def _layer(self, get: ShardedWeights, i: int) -> AbsoluteLayer:  # type: ignore[override]
        names = self.NAMES
        return biased_layer(get, self.config, self.tp, names.layer.format(i=i), norms=(names.attn_norm, names.mlp_norm),
                            qkv=names.qkv, o=names.o, fc1=names.fc1, fc2=names.fc2)

    def _ln(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, self.eps)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64: each token's place in its request
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] (after the final norm and OPT's project_out); writes
        this step's K/V."""
        stage = self.tp.stage
        if stage.first:
            hidden = self._embed(input_ids)
            if mm_embeds is not None:  # prompt_embeds: in place of the token embeddings
                rows, values = mm_embeds
                hidden = hidden.index_copy(0, rows, values.to(hidden.dtype))
            if self.project_in is not None:
                hidden = self.project_in(hidden)
            # embed(): the table may be a GGUF's kept blocks, read row by row as the token table.
            hidden = hidden + embed(self.positions, positions + self.position_offset, self.dtype)
        else:  # a later pipeline stage: the stream is the hidden states alone
            (hidden,) = stage.recv(1, (positions.shape[-1], self.config.hidden_size), self.dtype,
                                   self.device)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            assert isinstance(layer, AbsoluteLayer)
            x = self._ln(hidden, layer.input_norm, layer.input_norm_bias) if self.pre_norm else hidden
            hidden = hidden + (self._attention(layer, x, positions, meta, k_cache, v_cache) + layer.o_bias)
            if not self.pre_norm:
                hidden = self._ln(hidden, layer.input_norm, layer.input_norm_bias)
            x = self._ln(hidden, layer.post_norm, layer.post_norm_bias) if self.pre_norm else hidden
            hidden = hidden + (layer.down(self.act(layer.gate_up(x))) + layer.down_bias)  # down: row-parallel, whole
            if not self.pre_norm:
                hidden = self._ln(hidden, layer.post_norm, layer.post_norm_bias)
        if not stage.last:
            stage.send([hidden])
            return None  # type: ignore[return-value]
        if self.norm is not None:
            hidden = self._ln(hidden, *self.norm)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden

    def plan_fused_step(self, kv_caches):
        """None: the fused CPU step computes the RMSNorm/gated-MLP layer, not this one."""
        return None


__all__ = ["AbsoluteDecoder", "AbsoluteLayer", "AbsoluteNames", "HeadsRegrouped", "RotaryLayerNormDecoder",
           "absolute_weight_names", "biased_layer", "transposed"]
