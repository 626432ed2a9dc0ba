"""BERT's, RoBERTa's, XLM-RoBERTa's and ModernBERT's ``config.json``, read into
:class:`~engine.models.config.ModelConfig`'s fields (``ModelConfig.from_hf`` builds the
config from :func:`encoder_fields`), and the pooling fields (labels, Matryoshka
dimensions) that decoders share. ModernBERT's own fields (its local layers, their window
and RoPE base, its biases and classifier pooling) ride in :class:`ModernBertConfig`; what
models/modernbert.py does not compute is refused, naming the field."""

from __future__ import annotations

import dataclasses
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
    # ModernBERT (models/modernbert.py: RoPE, pre-norm layers, a gated MLP, local layers
    # that attend within a window between the global ones): gte-modernbert,
    # modernbert-embed, gte-reranker-modernbert.
    "ModernBertModel": "modernbert",
    "ModernBertForSequenceClassification": "modernbert_classifier",
    "ModernBertForTokenClassification": "modernbert_token_classifier",
}
_ROBERTA_ARCHITECTURES = frozenset(a for a in ENCODER_ARCHITECTURES if "Roberta" in a)
# The encoder families with a sequence classifier head (classify: one pooled row through
# the head), and those with a token classifier (token_classify: every row through it).
SEQUENCE_CLASSIFIERS = frozenset({"bert_classifier", "modernbert_classifier"})
TOKEN_CLASSIFIERS = frozenset({"bert_token_classifier", "modernbert_token_classifier"})


# Decoders with a sequence classifier head (transformers' *ForSequenceClassification: the
# last token's final hidden state through ``score``, no LM head) -> family.
DECODER_CLASSIFIER_ARCHITECTURES = {
    "LlamaForSequenceClassification": "llama",  # Skywork-Reward-Llama-3.1 and the like
    "MistralForSequenceClassification": "mistral",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForSequenceClassification": "qwen3",
    "Phi3ForSequenceClassification": "phi3",
    "SmolLM3ForSequenceClassification": "smollm3",
    "GemmaForSequenceClassification": "gemma",
    "Gemma2ForSequenceClassification": "gemma2",  # Skywork-Reward-Gemma-2
    "Gemma3TextForSequenceClassification": "gemma3",
    "Olmo2ForSequenceClassification": "olmo2",
    "Olmo3ForSequenceClassification": "olmo3",
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


def _encoder_shape(raw: dict[str, Any], arch: str, names: tuple[str, ...], **fields: Any) -> dict[str, Any]:
    """The ``ModelConfig`` fields every encoder sets alike (its width, depth and heads from
    config.json; the decoders' RoPE scaling, windows and EOS neutral: an encoder keeps no
    paged KV, and a local layer's bidirectional window is its own family's), with
    ``fields`` (eps, RoPE base, position count, biases, the family's own) over them."""
    hidden, heads, layers = int(raw["hidden_size"]), int(raw["num_attention_heads"]), int(raw["num_hidden_layers"])
    return dict(
        architecture=arch, vocab_size=int(raw["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
        rope_scaling=None, tie_word_embeddings=False, qk_norm=False, sliding_window=None,
        layer_windows=(0,) * layers, bos_token_id=None, eos_token_ids=(),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"), activation="gelu",
        num_labels=len(names), labels=names, matryoshka_dimensions=matryoshka(raw, hidden),
    ) | fields


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
    if arch.startswith("modernbert"):
        return modernbert_fields(raw, arch)
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
        names = _labels(raw) if arch in SEQUENCE_CLASSIFIERS | TOKEN_CLASSIFIERS else ()
        positions = int(raw.get("max_position_embeddings", 512))
        pad = int(raw.get("pad_token_id", 1)) if roberta else None
        if pad is not None:
            # Rows 0..pad are the pad's and those below it: a sequence's first token reads
            # row pad + 1, so pad + 1 fewer positions are usable (514 rows: 512 tokens).
            positions -= pad + 1
        return _encoder_shape(
            raw, arch, names,
            rms_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),  # LayerNorm's eps here
            rope_theta=0.0,
            max_position_embeddings=positions,
            attention_bias=True,
            type_vocab_size=int(raw.get("type_vocab_size", 2)),
            encoder_kind="roberta" if roberta else "bert",
            pad_token_id=pad,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptModelError(f"config.json is missing or has a bad field: {exc}") from exc


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModernBertConfig:
    """What a ModernBERT encoder sets apart from the rest of ``ModelConfig`` (whose
    ``rope_theta`` is its global layers' base, ``attention_bias`` the bias of Wqkv and Wo,
    ``rms_norm_eps`` its LayerNorms' eps)."""

    # The layers that attend within the window (transformers' "sliding_attention" layer
    # types); the others attend to their whole sequence.
    local_layers: tuple[int, ...]
    # Half the window: in a local layer, query i sees key j of its sequence iff
    # |i - j| <= local_window (config.json's local_attention // 2, transformers' sliding_window).
    local_window: int
    local_rope_theta: float  # the RoPE base of the local layers
    norm_bias: bool  # every LayerNorm has a bias
    mlp_bias: bool  # Wi and Wo have biases
    classifier_bias: bool  # the classifier head's dense has a bias (its classifier always does)
    # A sequence classifier's pooled row: "cls" (the first token's) or "mean" (all tokens').
    classifier_pooling: str


# ModernBERT's RoPE bases by layer type: rope_parameters' key, the older top-level key,
# transformers' default.
_MODERNBERT_THETAS = (("full_attention", "global_rope_theta", 160_000.0),
                      ("sliding_attention", "local_rope_theta", 10_000.0))


def modernbert_fields(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """``ModelConfig``'s fields for a ModernBERT ``config.json``."""
    for key in ("hidden_activation", "classifier_activation"):
        if key == "classifier_activation" and arch == "modernbert":
            continue  # the bare encoder has no classifier head
        if raw.get(key, "gelu") != "gelu":
            raise UnsupportedModelError(f"ModernBERT {key} {raw[key]!r} is not supported; gelu is")
    pooling = str(raw.get("classifier_pooling", "cls"))
    if arch == "modernbert_classifier" and pooling not in ("cls", "mean"):
        raise UnsupportedModelError(f"ModernBERT classifier_pooling {pooling!r} is not supported; cls and mean are")
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        layers = int(raw["num_hidden_layers"])
        if heads < 1 or hidden % heads:
            raise ValueError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        if raw.get("head_dim") not in (None, hidden // heads):
            # transformers' attention splits hidden_size over the heads, its RoPE would
            # rotate head_dim values: not a shape the model computes.
            raise UnsupportedModelError(f"ModernBERT head_dim {raw['head_dim']} other than "
                                        f"hidden_size / num_attention_heads ({hidden // heads}) is not supported")
        global_theta, local_theta = _modernbert_thetas(raw)
        names = _labels(raw) if arch != "modernbert" else ()
        # transformers: sliding_window, when written, sets local_attention to twice it.
        window = raw.get("sliding_window")
        half = int(window) if window is not None else int(raw.get("local_attention", 128)) // 2
        return _encoder_shape(
            raw, arch, names,
            rms_norm_eps=float(raw.get("norm_eps", 1e-5)),  # LayerNorm's eps here
            rope_theta=global_theta,
            max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
            attention_bias=bool(raw.get("attention_bias", False)),
            modernbert=ModernBertConfig(
                local_layers=_modernbert_local_layers(raw, layers),
                local_window=half,
                local_rope_theta=local_theta,
                norm_bias=bool(raw.get("norm_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                classifier_bias=bool(raw.get("classifier_bias", False)),
                classifier_pooling=pooling,
            ),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptModelError(f"config.json is missing or has a bad field: {exc}") from exc


def _modernbert_local_layers(raw: dict[str, Any], layers: int) -> tuple[int, ...]:
    """The local layers: config.json's ``layer_types``, else every layer but each
    ``global_attn_every_n_layers``-th from layer 0 (transformers' default: 3)."""
    types = raw.get("layer_types")
    if types is None:
        every = int(raw.get("global_attn_every_n_layers", 3))
        if every < 1:
            raise ValueError(f"global_attn_every_n_layers {every} is below 1")
        types = ["sliding_attention" if i % every else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise ValueError(f"layer_types lists {len(types)} layers, the model has {layers}")
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise UnsupportedModelError(f"ModernBERT layer_types {unknown} are not supported; "
                                    "full_attention and sliding_attention are")
    return tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")


def _modernbert_thetas(raw: dict[str, Any]) -> tuple[float, float]:
    """The global and local layers' RoPE bases. transformers merges a legacy
    ``rope_scaling`` into both layer types' ``rope_parameters``; only the default
    (unscaled) RoPE is computed here, anything else is refused."""
    params = raw.get("rope_parameters") or {}
    other = sorted(set(params) - {kind for kind, _, _ in _MODERNBERT_THETAS})
    if other:
        raise UnsupportedModelError(f"ModernBERT rope_parameters keys {other} are not supported; "
                                    "per layer type (full_attention, sliding_attention) they are")
    thetas = []
    for kind, legacy, default in _MODERNBERT_THETAS:
        merged = {**(params.get(kind) or {}), **(raw.get("rope_scaling") or {})}
        rope_type = merged.get("rope_type", merged.get("type", "default"))
        if rope_type != "default":
            raise UnsupportedModelError(f"ModernBERT RoPE type {rope_type!r} ({kind} rope_parameters / "
                                        "rope_scaling) is not supported; default is")
        thetas.append(float(merged.get("rope_theta", raw.get(legacy, default))))
    return thetas[0], thetas[1]
