"""BERT's, RoBERTa's and XLM-RoBERTa's ``config.json``, read into
:class:`~engine.models.config.ModelConfig`'s fields (``ModelConfig.from_hf`` builds the
config from :func:`encoder_fields`), and the pooling fields (labels, Matryoshka
dimensions) that decoders share."""

from __future__ import annotations

from typing import Any

from engine.errors import CorruptModelError, UnsupportedModelError

# Bidirectional encoders (models/bert.py): no causal mask and no paged KV cache, so a
# prompt runs whole in one step. BertModel is an embedder (sentence-transformers folders
# add their pooling), BertForSequenceClassification a cross-encoder (reranker).
ENCODER_ARCHITECTURES = {
    "BertModel": "bert",
    "BertForSequenceClassification": "bert_classifier",
    # A classifier head on every token's hidden state (NER taggers): vLLM's token_classify.
    "BertForTokenClassification": "bert_token_classifier",
    # RoBERTa and XLM-RoBERTa (multilingual-e5, bge-m3, bge-reranker-v2-m3) are BERT's layers
    # with positions counted from the pad id, one token type and their own classifier head
    # (ModelConfig.encoder_kind "roberta").
    "RobertaModel": "bert",
    "XLMRobertaModel": "bert",
    "RobertaForSequenceClassification": "bert_classifier",
    "XLMRobertaForSequenceClassification": "bert_classifier",
    "RobertaForTokenClassification": "bert_token_classifier",
    "XLMRobertaForTokenClassification": "bert_token_classifier",
}
_ROBERTA_ARCHITECTURES = frozenset(a for a in ENCODER_ARCHITECTURES if "Roberta" in a)


# Decoders with a sequence classifier head (transformers' *ForSequenceClassification: the
# last token's final hidden state through ``score``, no LM head) -> family.
DECODER_CLASSIFIER_ARCHITECTURES = {
    "LlamaForSequenceClassification": "llama",
    "MistralForSequenceClassification": "mistral",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForSequenceClassification": "qwen3",
}


def decoder_classifier_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig``'s classifier fields for a decoder classifier's ``config.json``: its
    labels, or vLLM's conversion of a causal LM by hf_overrides (Qwen3-Reranker's
    ``classifier_from_token: [false token, true token]`` with ``is_original_qwen3_reranker``
    or ``method: "from_2_way_softmax"``): one label whose logit is the difference of the two
    tokens' LM-head logits, so its sigmoid is the true token's probability of the two."""
    tokens = raw.get("classifier_from_token")
    if tokens is None:
        names = _labels(raw)
        return {"seq_classifier": True, "num_labels": len(names), "labels": names}
    two_way = raw.get("is_original_qwen3_reranker") or raw.get("method") == "from_2_way_softmax"
    if not (isinstance(tokens, list) and len(tokens) == 2 and all(isinstance(t, str) for t in tokens)
            and two_way):
        raise UnsupportedModelError(
            "classifier_from_token is supported as two tokens [false, true] with "
            "is_original_qwen3_reranker (or method from_2_way_softmax), as Qwen3-Reranker is served")
    return {"seq_classifier": True, "num_labels": 1, "labels": ("LABEL_0",),
            "classifier_from_tokens": (tokens[0], tokens[1])}


def _labels(raw: dict[str, Any]) -> tuple[str, ...]:
    """A classifier's label names by index: config.json's ``id2label`` (string keys "0",
    "1", ...), else ``num_labels`` of transformers' default names ``LABEL_i``."""
    id2label = raw.get("id2label")
    if id2label:
        by_index = {int(k): str(v) for k, v in id2label.items()}
        if sorted(by_index) != list(range(len(by_index))):
            raise ValueError(f"id2label keys {sorted(by_index)} are not 0..{len(by_index) - 1}")
        return tuple(by_index[i] for i in range(len(by_index)))
    return tuple(f"LABEL_{i}" for i in range(int(raw.get("num_labels", 2))))


def matryoshka(raw: dict[str, Any], hidden: int) -> tuple[int, ...] | None:
    """The dimensions an embedding may be cut to: config.json's ``matryoshka_dimensions``,
    or any up to ``hidden_size`` with ``is_matryoshka`` (vLLM reads the same two fields)."""
    dims = raw.get("matryoshka_dimensions")
    if dims:
        return tuple(sorted(int(d) for d in dims))
    if raw.get("is_matryoshka"):
        return tuple(range(1, hidden + 1))
    return None


def encoder_fields(raw: dict[str, Any], hf_arch: str) -> dict[str, Any]:
    """``ModelConfig``'s fields for a BERT (or RoBERTa) encoder's ``config.json``, in the
    decoder's terms (the fields that mean nothing to it, RoPE and windows, stay neutral)."""
    arch = ENCODER_ARCHITECTURES[hf_arch]
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise UnsupportedModelError(
            f"position_embedding_type {raw['position_embedding_type']!r} is not supported; "
            "BERT models with absolute positions are")
    act = raw.get("hidden_act", "gelu")
    if act != "gelu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported for BERT; gelu is")
    if raw.get("is_decoder") or raw.get("add_cross_attention"):
        raise UnsupportedModelError(f"{hf_arch} as a decoder (is_decoder, add_cross_attention) "
                                    "is not supported; as a bidirectional encoder it is")
    roberta = hf_arch in _ROBERTA_ARCHITECTURES
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        layers = int(raw["num_hidden_layers"])
        names = _labels(raw) if arch in ("bert_classifier", "bert_token_classifier") else ()
        positions = int(raw.get("max_position_embeddings", 512))
        pad = int(raw.get("pad_token_id", 1)) if roberta else None
        if pad is not None:
            # Rows 0..pad are the pad's and those below it: a sequence's first token reads
            # row pad + 1, so pad + 1 fewer positions are usable (514 rows: 512 tokens).
            positions -= pad + 1
        return dict(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=hidden // heads,
            rms_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),  # LayerNorm's eps here
            rope_theta=0.0,
            rope_scaling=None,
            max_position_embeddings=positions,
            tie_word_embeddings=False,
            attention_bias=True,
            qk_norm=False,
            sliding_window=None,
            layer_windows=(0,) * layers,
            bos_token_id=None,
            eos_token_ids=(),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            activation="gelu",
            type_vocab_size=int(raw.get("type_vocab_size", 2)),
            encoder_kind="roberta" if roberta else "bert",
            pad_token_id=pad,
            num_labels=len(names),
            labels=names,
            matryoshka_dimensions=matryoshka(raw, hidden),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptModelError(f"config.json is missing or has a bad field: {exc}") from exc
