"""What the fused CPU decode step (:mod:`engine.ops.cpu.fused`) knows of a model.

The kernels know no model class: a decoder, a floor above, describes itself in these
frozen dataclasses (its ``fused_description()``) and hands the description down;
:func:`engine.ops.cpu.fused.unfusable` checks it and :class:`~engine.ops.cpu.fused.FusedDecode`
builds the C descriptors (``fused.h``) from it. The tensors are the model's own (no
copies): the step points into them.

::

    FusedModel                      shapes, dtype, eps/scale/soft-cap, final norm, op set
      layers: FusedLayer, ...       one per decoder layer
        norms                       input/post (+ Gemma's pre/post-FFN), q/k head norms
        qkv, o, gate_up, down       DenseProjection | QuantProjection (None: no dense MLP)
        rope, window                the layer's cos|sin table (None: no RoPE), its sliding window (0: none)
        sinks                       gpt-oss's attention sinks, one logit a head (None: none)
        external_mlp                a sparse (MoE) MLP the step stops before and calls
        lora_qkv, lora_o, ...       LoraProjection | None: adapter slots beside a projection
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from engine.ops.quant import QuantizedWeight


@dataclasses.dataclass(frozen=True, slots=True)
class DenseProjection:
    """``y = x @ weight.T (+ bias)`` over one dense weight ``[N, K]``."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    # quant.c's small-batch dense kernel takes this weight (the model's Linear runs it up
    # to qmatmul.DENSE_MAX_ROWS rows, so the fused step does too: the same bits).
    small_batch: bool

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]


@dataclasses.dataclass(frozen=True, slots=True)
class QuantProjection:
    """``y = x @ W.T (+ bias)`` with ``W`` the rows of ``parts`` stacked, each part in its
    block format, writing side by side into one output of ``out_features`` columns."""

    parts: tuple[QuantizedWeight, ...]
    bias: torch.Tensor | None
    out_features: int

    @property
    def in_features(self) -> int:
        return self.parts[0].shape[1]


Projection = DenseProjection | QuantProjection


@dataclasses.dataclass(frozen=True, slots=True)
class LoraProjection:
    """A projection's LoRA adapter slots (engine/models/layers/lora.py's pools): ``a``
    [S, R, in] and ``b`` [S, R, out] (B transposed) or as row pairs [S, R / 2, out, 2];
    ``bounds`` the fused slices' output columns, where ``b`` is block diagonal."""

    a: torch.Tensor
    b: torch.Tensor
    bounds: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FusedLayer:
    """One decoder layer's weights, as the fused step reads them."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor  # after attention (Llama: before the MLP too)
    q_norm: torch.Tensor | None  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None
    pre_ffn_norm: torch.Tensor | None = None  # Gemma: before the MLP, and (2/3, not 1) after it
    post_ffn_norm: torch.Tensor | None = None
    qkv: Projection | None  # [(H + 2 * Hkv) * D, hidden], q/k/v biases included
    o: Projection | None
    gate_up: Projection | None  # [2 * intermediate, hidden]; None in a sparse layer
    down: Projection | None
    rope: torch.Tensor | None  # [max_pos, head_dim]: cos | sin of every position; None: a NoPE layer
    window: int  # sliding window (the last N positions), 0 for full attention
    sinks: torch.Tensor | None = None  # [heads] fp32 attention sinks (gpt-oss); None: none
    # A sparse (mixture-of-experts) layer's MLP: ``x [T, hidden] -> out [T, hidden]``, run
    # between two C calls; None: the dense gate_up/down MLP runs inside the step.
    external_mlp: Callable[[torch.Tensor], torch.Tensor] | None = None
    # With --enable-lora, each targeted projection's adapter slots (None: not targeted),
    # whose deltas the step adds after the projection for the tokens of an adapter.
    lora_qkv: LoraProjection | None = None
    lora_o: LoraProjection | None = None
    lora_gate_up: LoraProjection | None = None
    lora_down: LoraProjection | None = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FusedModel:
    """A decoder stack as the fused step runs it; the step's output is the final norm's."""

    dtype: torch.dtype  # the activations'
    device: torch.device
    # The op set the unfused path runs (``Ops``): the step runs only where it is the CPU
    # kernels', and reads its ``rowwise_max_query_len`` each step.
    ops: Any
    tensor_parallel: bool  # a rank's slice: the unfused path's all-reduces are needed
    hidden: int
    heads: int  # this model's query heads
    kv_heads: int
    head_dim: int
    eps: float  # the RMSNorms'
    scale: float  # attention scale
    softcap: float  # attention score soft-cap (Gemma 2), 0 for none
    # Gemma's layer: four "1 + w" norms in fp32 a layer (the others keep theirs in the
    # activation dtype), GeGLU instead of SwiGLU.
    gemma: bool
    final_norm: torch.Tensor
    layers: tuple[FusedLayer, ...]
    # Granite's residual_multiplier: each block output times it (rounded to the dtype)
    # before it joins the residual stream; 1 elsewhere.
    residual_scale: float = 1.0
    # The gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU: Gemma's).
    activation: str = "silu"
    # q_norm / k_norm span all of q's / k's heads (OLMo), else they norm each head.
    qk_norm_full: bool = False


__all__ = ["DenseProjection", "FusedLayer", "FusedModel", "LoraProjection", "Projection", "QuantProjection"]
