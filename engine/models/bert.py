"""BERT: the bidirectional encoder of sentence-transformers embedders (``BertModel``), of
cross-encoder rerankers (``BertForSequenceClassification``) and of token taggers
(``BertForTokenClassification``: a classifier on every token's hidden state). RoBERTa and
XLM-RoBERTa (``ModelConfig.encoder_kind`` "roberta") are the same layers with positions
counted from the pad id, a single token type, and a classifier head of their own.

Unlike the decoders, every token attends to every token of its own sequence, so a
sequence's hidden states depend on all of it: a prompt cannot be split over steps, and
nothing is kept between steps (no KV cache). A step's flat varlen batch (the runner's
layout: sequences back to back, ``[T, H]`` with T the sum of lengths) stays flat: the
matmuls run on all its rows, and attention (:meth:`Ops.encoder_attention`) runs each
sequence over its own rows of the fused q/k/v, unpadded and unmasked: one C call for the
whole batch on CPU, one SDPA call per sequence in the torch reference. Padding the batch
to ``[B, L]`` with a key mask, as transformers does, cost 2.5x as much as the SDPA loop at
32 sentences of 10-59 tokens (torch's CPU flash kernel with a mask, plus the scatter into
and gather out of the padded rows); the C kernel then took the loop's 60 us a sequence
per layer, mostly dispatch, down to a few. The GELU and the residual adds run in the
matmuls' epilogues (:meth:`Linear.gelu`, :meth:`Linear.add`); the small ops run on one
intra-op thread (:func:`engine.ops.reference.one_intra_op_thread`).

Token types (segment A / B of a pair) are not sent by the runner: a pair is tokenized as
``[CLS] A [SEP] B [SEP]``, so a token is of type 1 iff a ``[SEP]`` comes before it in its
sequence (``ModelConfig.sep_token_id``). Single texts have their only ``[SEP]`` last, so
all their tokens are type 0, as the tokenizer would say.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from engine.models.config import ModelConfig
from engine.models.layers.linear import Linear
from engine.models.layers.shard import ShardedWeights
from engine.ops import AttentionMetadata, Ops
from engine.ops.reference import one_intra_op_thread


@dataclasses.dataclass(slots=True)
class _EncoderLayer:
    qkv: Linear  # query, key, value fused: [3 * hidden, hidden] with their biases
    attn_out: Linear
    attn_norm: tuple[torch.Tensor, torch.Tensor]  # LayerNorm weight, bias
    intermediate: Linear
    output: Linear
    out_norm: tuple[torch.Tensor, torch.Tensor]


def encoder_weight_names(config: ModelConfig) -> list[str]:
    """The tensor names a BERT with ``config`` has (without a ``bert.`` prefix)."""
    names = [
        "embeddings.word_embeddings.weight",
        "embeddings.position_embeddings.weight",
        "embeddings.token_type_embeddings.weight",
        "embeddings.LayerNorm.weight",
        "embeddings.LayerNorm.bias",
    ]
    for i in range(config.num_hidden_layers):
        p = f"encoder.layer.{i}."
        for part in ("attention.self.query", "attention.self.key", "attention.self.value",
                     "attention.output.dense", "attention.output.LayerNorm",
                     "intermediate.dense", "output.dense", "output.LayerNorm"):
            names += [p + part + ".weight", p + part + ".bias"]
    if config.architecture == "bert_classifier" and config.encoder_kind == "roberta":
        names += ["classifier.dense.weight", "classifier.dense.bias",
                  "classifier.out_proj.weight", "classifier.out_proj.bias"]
    elif config.architecture == "bert_classifier":
        names += ["pooler.dense.weight", "pooler.dense.bias", "classifier.weight", "classifier.bias"]
    elif config.architecture == "bert_token_classifier":
        names += ["classifier.weight", "classifier.bias"]  # no pooler (add_pooling_layer=False)
    return names


class BertModel:
    """The encoder stack; :meth:`classify` adds a classifier's pooler and head."""

    @classmethod
    def weight_names(cls, config: ModelConfig) -> list[str]:
        """The checkpoint tensors a model of ``config`` reads, in checkpoint order."""
        return encoder_weight_names(config)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """A stored tensor's name under :meth:`weight_names`' names:
        BertForSequenceClassification names the encoder ``bert.*`` (RoBERTa's heads
        ``roberta.*``), BertModel has no prefix."""
        return name.removeprefix("bert.").removeprefix("roberta.")

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        ops: Ops,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config
        self.ops = ops
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps  # config.json's layer_norm_eps
        get = ShardedWeights(weights, dtype, self.device)
        self.word = get("embeddings.word_embeddings.weight")
        self.position = get("embeddings.position_embeddings.weight")
        self.token_type = get("embeddings.token_type_embeddings.weight")
        self.embed_norm = (get("embeddings.LayerNorm.weight"), get("embeddings.LayerNorm.bias"))
        self.layers = [self._layer(get, i) for i in range(config.num_hidden_layers)]
        self.pooler: Linear | None = None
        self.classifier: Linear | None = None
        if config.architecture == "bert_classifier" and config.encoder_kind == "roberta":
            # RobertaClassificationHead: dense + tanh + out_proj, the first token's row.
            self.pooler = Linear(get("classifier.dense.weight"), get("classifier.dense.bias"))
            self.classifier = Linear(get("classifier.out_proj.weight"), get("classifier.out_proj.bias"))
        elif config.architecture == "bert_classifier":
            self.pooler = Linear(get("pooler.dense.weight"), get("pooler.dense.bias"))
            self.classifier = Linear(get("classifier.weight"), get("classifier.bias"))
        elif config.architecture == "bert_token_classifier":
            self.classifier = Linear(get("classifier.weight"), get("classifier.bias"))

    def _layer(self, get: ShardedWeights, i: int) -> _EncoderLayer:
        p = f"encoder.layer.{i}."
        attn = p + "attention.self."
        return _EncoderLayer(
            qkv=Linear(torch.cat([get(attn + f"{n}.weight") for n in ("query", "key", "value")]),
                       torch.cat([get(attn + f"{n}.bias") for n in ("query", "key", "value")])),
            attn_out=Linear(get(p + "attention.output.dense.weight"), get(p + "attention.output.dense.bias")),
            attn_norm=(get(p + "attention.output.LayerNorm.weight"), get(p + "attention.output.LayerNorm.bias")),
            intermediate=Linear(get(p + "intermediate.dense.weight"), get(p + "intermediate.dense.bias")),
            output=Linear(get(p + "output.dense.weight"), get(p + "output.dense.bias")),
            out_norm=(get(p + "output.LayerNorm.weight"), get(p + "output.LayerNorm.bias")),
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64, each sequence from 0
        meta: AttentionMetadata,
        kv_caches: list[Any],  # unused: an encoder keeps nothing between steps
    ) -> torch.Tensor:
        """The last hidden states [T, hidden] of whole sequences (each starts at 0)."""
        lens = meta.query_lens_host
        width = (self.word.shape[1],)
        with one_intra_op_thread(input_ids):
            types = self._token_types(input_ids, meta)
            if self.config.encoder_kind == "roberta":
                positions = self._roberta_positions(input_ids, positions, meta)
            x = self.word[input_ids] + self.position[positions] + self.token_type[types]
            x = F.layer_norm(x, width, *self.embed_norm, self.eps)
        for layer in self.layers:
            attn = layer.attn_out.add(self._attention(layer, x, lens), x)
            with one_intra_op_thread(x):
                x = F.layer_norm(attn, width, *layer.attn_norm, self.eps)
            h = layer.output.add(layer.intermediate.gelu(x), x)
            with one_intra_op_thread(x):
                x = F.layer_norm(h, width, *layer.out_norm, self.eps)
        return x

    def _token_types(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        sep = self.config.sep_token_id
        if sep is None or self.token_type.shape[0] < 2:
            return torch.zeros_like(input_ids)
        seps = (input_ids == sep).to(torch.int64)
        before = seps.cumsum(0) - seps  # [SEP]s strictly before each row, over the flat batch
        return (_within_sequence(before, meta) > 0).to(torch.int64)

    def _roberta_positions(self, input_ids: torch.Tensor, positions: torch.Tensor,
                           meta: AttentionMetadata) -> torch.Tensor:
        """RoBERTa's position rows: pad + 1 + the row's index among its sequence's non-pad
        tokens, pad for a pad token (transformers' create_position_ids_from_input_ids)."""
        pad = self.config.pad_token_id
        assert pad is not None  # set for every RoBERTa config
        real = input_ids != pad
        if bool(real.all()):
            return positions + (pad + 1)
        counted = _within_sequence(real.to(torch.int64).cumsum(0), meta, inclusive=True)
        return torch.where(real, counted + pad, pad)

    def _attention(self, layer: _EncoderLayer, x: torch.Tensor, lens: tuple[int, ...]) -> torch.Tensor:
        """Each sequence's bidirectional attention over its own rows, ``[T, hidden]``."""
        return self.ops.encoder_attention(layer.qkv(x), lens, self.num_heads, self.head_dim)

    @torch.inference_mode()
    def classify(self, first_rows: torch.Tensor) -> torch.Tensor:
        """A cross-encoder's logits [B, num_labels] (fp32) from each sequence's [CLS] row
        (RoBERTa's head computes the same two linears around its tanh)."""
        assert self.pooler is not None and self.classifier is not None  # bert_classifier only
        return self.classifier(torch.tanh(self.pooler(first_rows))).float()

    @torch.inference_mode()
    def classify_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """A token classifier's logits [T, num_labels] (fp32), one row a token."""
        assert self.pooler is None and self.classifier is not None  # bert_token_classifier only
        return self.classifier(rows).float()


def _within_sequence(counts: torch.Tensor, meta: AttentionMetadata, *, inclusive: bool = False) -> torch.Tensor:
    """A running count over the step's flat batch made per sequence: each row's count less
    the count before its sequence's first row. ``counts`` counts strictly before each row
    (``inclusive``: up to and including it)."""
    lens = meta.query_lens_host
    seq = torch.repeat_interleave(
        torch.arange(len(lens), device=counts.device),
        torch.tensor(lens, device=counts.device), output_size=counts.shape[0])
    starts = meta.query_start_loc[:-1].to(torch.int64)
    # The count before each sequence's first row (an inclusive count shifted by one row).
    before = torch.cat([counts.new_zeros(1), counts]) if inclusive else counts
    return counts - before[starts][seq]
