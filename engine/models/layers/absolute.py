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
        p = names.layer.format(i=i)
        sizes, spans = qkv_spans(self.config, self.tp)
        if len(names.qkv) == 1:  # fused q/k/v: each part cut to this rank's heads, fused again
            fused = p + names.qkv[0]
            qkv = make_linear([get.rows(fused + ".weight", sizes, spans)], get.rows(fused + ".bias", sizes, spans))
        else:
            parts = list(zip(names.qkv, spans, strict=True))
            qkv = make_linear([get.rows(p + n + ".weight", spans=[s]) for n, s in parts],
                              torch.cat([get.rows(p + n + ".bias", spans=[s]) for n, s in parts]))
        return AbsoluteLayer(
            input_norm=get(p + names.attn_norm + ".weight"),
            input_norm_bias=get(p + names.attn_norm + ".bias"),
            post_norm=get(p + names.mlp_norm + ".weight"),
            post_norm_bias=get(p + names.mlp_norm + ".bias"),
            qkv=qkv,
            o_proj=get.row_parallel(p + names.o + ".weight"),
            o_bias=get(p + names.o + ".bias"),
            q_norm=None,
            k_norm=None,
            gate_up=make_linear([get.rows(p + names.fc1 + ".weight")], get.rows(p + names.fc1 + ".bias")),
            down=get.row_parallel(p + names.fc2 + ".weight"),
            down_bias=get(p + names.fc2 + ".bias"),
            window=0,
            rope=None,
        )

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


__all__ = ["AbsoluteDecoder", "AbsoluteLayer", "AbsoluteNames", "HeadsRegrouped", "absolute_weight_names",
           "transposed"]
