"""ModernBERT: the bidirectional encoder of gte-modernbert and modernbert-embed
(``ModernBertModel``, an embedder), of gte-reranker-modernbert
(``ModernBertForSequenceClassification``, a cross-encoder) and of token taggers
(``ModernBertForTokenClassification``).

What it computes, as transformers does:

* embeddings: the token's row of ``tok_embeddings`` through a LayerNorm; no position table
  and no token types (positions enter through RoPE in every layer);
* each layer is pre-norm: ``x += Wo(attention(attn_norm(x)))`` then
  ``x += mlp(mlp_norm(x))``; layer 0 has no ``attn_norm`` (its input is the normed
  embeddings); the MLP is gated: ``Wi`` gives ``[input | gate]``, then
  ``Wo(gelu(input) * gate)``;
* attention: ``Wqkv`` fused (q, k, v heads back to back, as BERT's fused projection), RoPE
  (rotate-half) on q and k at the positions the runner gives (each sequence from 0), then
  bidirectional attention within the sequence. Global layers (every
  ``global_attn_every_n_layers``-th from layer 0, or config.json's ``layer_types``) see
  the whole sequence, at RoPE base ``global_rope_theta``; local layers see only the keys
  within ``local_attention // 2`` positions either side (``|i - j| <= local_window``), at
  base ``local_rope_theta``;
* ``final_norm`` after the last layer: the hidden states an embedder pools;
* the classifier head (``head``: dense, GELU, LayerNorm; then ``classifier``) on the pooled
  row of a sequence classifier (``classifier_pooling``: the [CLS] row or the mean of all
  rows; the runner pools, :meth:`classify` applies the head) or on every row of a token
  classifier (:meth:`classify_tokens`).

LayerNorms carry a bias iff ``norm_bias``; Wqkv and the attention's Wo iff
``attention_bias``; Wi and the MLP's Wo iff ``mlp_bias``; the head's dense iff
``classifier_bias`` (the classifier always has one).

The step's flat varlen batch (sequences back to back, ``[T, H]``) stays flat, as in
models/bert.py: the matmuls run on all rows, global attention is
:meth:`Ops.encoder_attention` on the rotated fused q/k/v. Local attention runs in torch on
any op set (:func:`window_attention`): per sequence, one unmasked SDPA call when the whole
sequence fits in the window, else one SDPA call per block of queries over the keys their
window can reach, with the band mask. Nothing is kept between steps (no KV cache).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from engine.models.config import ModelConfig
from engine.models.encoder_config import SEQUENCE_CLASSIFIERS, TOKEN_CLASSIFIERS
from engine.models.layers.linear import Linear
from engine.models.layers.rope import cos_sin_cache
from engine.models.layers.shard import ShardedWeights
from engine.ops import AttentionMetadata, Ops
from engine.ops.reference import one_intra_op_thread

# Queries a local layer's SDPA call takes at once (at least the half window): few calls a
# sequence, and keys of at most this plus the window per call.
_QUERY_BLOCK = 64

_Norm = tuple[torch.Tensor, torch.Tensor | None]  # LayerNorm weight, bias (None: no bias)


@dataclasses.dataclass(slots=True)
class _Layer:
    attn_norm: _Norm | None  # None: layer 0 (identity)
    qkv: Linear  # Wqkv: [3 * hidden, hidden]
    attn_out: Linear  # attn.Wo
    mlp_norm: _Norm
    wi: Linear  # [2 * intermediate, hidden]: input rows, then gate rows
    wo: Linear  # mlp.Wo
    rope: torch.Tensor  # the cos/sin table of its kind of layer
    window: int  # local: keys within this many positions either side; 0: global


def modernbert_weight_names(config: ModelConfig) -> list[str]:
    """The tensor names a ModernBERT with ``config`` has (without a ``model.`` prefix)."""
    mb = config.modernbert
    assert mb is not None  # a modernbert family config always has it

    def linear(name: str, bias: bool) -> list[str]:
        return [f"{name}.weight"] + ([f"{name}.bias"] if bias else [])

    def norm(name: str) -> list[str]:
        return linear(name, mb.norm_bias)

    names = ["embeddings.tok_embeddings.weight", *norm("embeddings.norm")]
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        if i:
            names += norm(p + "attn_norm")
        names += linear(p + "attn.Wqkv", config.attention_bias) + linear(p + "attn.Wo", config.attention_bias)
        names += norm(p + "mlp_norm") + linear(p + "mlp.Wi", mb.mlp_bias) + linear(p + "mlp.Wo", mb.mlp_bias)
    names += norm("final_norm")
    if config.architecture in SEQUENCE_CLASSIFIERS | TOKEN_CLASSIFIERS:
        names += linear("head.dense", mb.classifier_bias) + norm("head.norm")
        names += ["classifier.weight", "classifier.bias"]
    return names


class ModernBertModel:
    """The encoder stack; :meth:`classify` / :meth:`classify_tokens` add a classifier's head."""

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        """The checkpoint tensors a model of ``config`` reads, in checkpoint order."""
        return modernbert_weight_names(config)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """A stored tensor's name under :meth:`weight_names`' names: the classifiers (and
        the masked LM) keep the encoder under ``model.``, ModernBertModel has no prefix."""
        return name.removeprefix("model.")

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        ops: Ops,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        mb = config.modernbert
        assert mb is not None  # a modernbert family config always has it
        self.config = config
        self.ops = ops
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps  # config.json's norm_eps
        get = ShardedWeights(weights, dtype, self.device)

        def linear(name: str, bias: bool) -> Linear:
            return Linear(get(f"{name}.weight"), get(f"{name}.bias") if bias else None)

        def norm(name: str) -> _Norm:
            return get(f"{name}.weight"), get(f"{name}.bias") if mb.norm_bias else None

        def table(theta: float) -> torch.Tensor:
            return cos_sin_cache(theta=theta, scaling=None, head_dim=self.head_dim,
                                 max_positions=config.max_position_embeddings, dtype=dtype,
                                 device=self.device)

        global_rope = table(config.rope_theta)
        local_rope = table(mb.local_rope_theta) if mb.local_layers else global_rope
        self.word = get("embeddings.tok_embeddings.weight")
        self.embed_norm = norm("embeddings.norm")
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"layers.{i}."
            local = i in mb.local_layers
            self.layers.append(_Layer(
                attn_norm=norm(p + "attn_norm") if i else None,
                qkv=linear(p + "attn.Wqkv", config.attention_bias),
                attn_out=linear(p + "attn.Wo", config.attention_bias),
                mlp_norm=norm(p + "mlp_norm"),
                wi=linear(p + "mlp.Wi", mb.mlp_bias),
                wo=linear(p + "mlp.Wo", mb.mlp_bias),
                rope=local_rope if local else global_rope,
                window=mb.local_window if local else 0,
            ))
        self.final_norm = norm("final_norm")
        self.head: Linear | None = None
        self.head_norm: _Norm | None = None
        self.classifier: Linear | None = None
        if config.architecture in SEQUENCE_CLASSIFIERS | TOKEN_CLASSIFIERS:
            self.head = linear("head.dense", mb.classifier_bias)
            self.head_norm = norm("head.norm")
            self.classifier = linear("classifier", True)

    def _norm(self, x: torch.Tensor, norm: _Norm) -> torch.Tensor:
        with one_intra_op_thread(x):
            return F.layer_norm(x, (x.shape[-1],), norm[0], norm[1], self.eps)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64, each sequence from 0
        meta: AttentionMetadata,
        kv_caches: list[Any],  # unused: an encoder keeps nothing between steps
    ) -> torch.Tensor:
        """The last hidden states [T, hidden] (after final_norm) of whole sequences."""
        lens = meta.query_lens_host
        x = self._norm(self.word[input_ids], self.embed_norm)
        for layer in self.layers:
            h = x if layer.attn_norm is None else self._norm(x, layer.attn_norm)
            x = layer.attn_out.add(self._attention(layer, h, positions, lens), x)
            gated = layer.wi(self._norm(x, layer.mlp_norm))
            inputs, gate = gated.chunk(2, dim=-1)
            x = layer.wo.add(F.gelu(inputs).mul_(gate), x)
        return self._norm(x, self.final_norm)

    def _attention(self, layer: _Layer, x: torch.Tensor, positions: torch.Tensor,
                   lens: tuple[int, ...]) -> torch.Tensor:
        """Each sequence's attention over its own rows (a local layer's within its window)."""
        h, d = self.num_heads, self.head_dim
        qkv = layer.qkv(x)
        t = qkv.shape[0]
        heads = qkv.view(t, 3 * h, d)
        q, k = self.ops.rotary_embedding(positions, heads[:, :h], heads[:, h:2 * h], layer.rope)
        if q.data_ptr() != heads.data_ptr() or k.data_ptr() != heads[:, h:].data_ptr():
            # Rotated into new tensors rather than in place: put them back beside v.
            qkv = torch.cat((q.reshape(t, h * d), k.reshape(t, h * d), qkv[:, 2 * h * d:]), dim=1)
        if layer.window and max(lens) - 1 > layer.window:
            return window_attention(qkv, lens, h, d, layer.window)
        # A global layer, or every sequence within its window: the whole sequence.
        return self.ops.encoder_attention(qkv, lens, h, d)

    def _head(self, rows: torch.Tensor) -> torch.Tensor:
        assert self.head is not None and self.head_norm is not None and self.classifier is not None
        return self.classifier(self._norm(F.gelu(self.head(rows)), self.head_norm)).float()

    @torch.inference_mode()
    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """A sequence classifier's logits [B, num_labels] (fp32) from each sequence's pooled
        row (its [CLS] row, or the mean of its rows: ``classifier_pooling``)."""
        assert self.config.architecture in SEQUENCE_CLASSIFIERS
        return self._head(pooled)

    @torch.inference_mode()
    def classify_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """A token classifier's logits [T, num_labels] (fp32), one row a token."""
        assert self.config.architecture in TOKEN_CLASSIFIERS
        return self._head(rows)


def window_attention(qkv: torch.Tensor, lens: tuple[int, ...], num_heads: int, head_dim: int,
                     window: int) -> torch.Tensor:
    """Bidirectional sliding-window attention over a packed batch (``qkv`` as
    :meth:`Ops.encoder_attention` takes it): query ``i`` of a sequence attends to its keys
    ``j`` with ``|i - j| <= window``, at scale ``head_dim ** -0.5``. Returns
    ``[T, num_heads * head_dim]``."""
    h, d = num_heads, head_dim
    out = torch.empty(qkv.shape[0], h * d, dtype=qkv.dtype, device=qkv.device)
    block = max(_QUERY_BLOCK, window)
    start = 0
    with one_intra_op_thread(qkv):
        for n, rows in zip(lens, qkv.split(list(lens)), strict=True):
            q, k, v = rows.view(n, 3, h, d).permute(1, 2, 0, 3)  # each [h, n, d]
            dest = out[start:start + n].view(n, h, d)
            start += n
            if n - 1 <= window:  # every key within reach of every query
                dest.copy_(F.scaled_dot_product_attention(q, k, v).transpose(0, 1))
                continue
            for a in range(0, n, block):
                b = min(n, a + block)
                lo, hi = max(0, a - window), min(n, b + window)
                rows_i = torch.arange(a, b, device=qkv.device).unsqueeze(1)
                cols_j = torch.arange(lo, hi, device=qkv.device).unsqueeze(0)
                band = (rows_i - cols_j).abs() <= window
                o = F.scaled_dot_product_attention(q[:, a:b], k[:, lo:hi], v[:, lo:hi], attn_mask=band)
                dest[a:b].copy_(o.transpose(0, 1))
    return out
