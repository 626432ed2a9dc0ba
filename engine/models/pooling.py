"""Pooling models: what a model computes when it embeds or scores instead of generating.

:func:`pooler_config` reads the model's task from its files, as vLLM's ``--runner`` /
``--convert`` resolve it:

* ``BertModel`` embeds, ``BertForSequenceClassification`` classifies (a cross-encoder:
  one logit per label from the [CLS] row through the pooler and classifier), and so do
  RoBERTa's and ModernBERT's (whose classifier pools the [CLS] row or the mean of all
  rows, as its ``classifier_pooling`` says); their ``*ForTokenClassification`` classify
  every token;
* a decoder saved without its LM head (``Qwen3Model``, ``LlamaModel``, ...) embeds; one
  with a classifier head (``Qwen3ForSequenceClassification``, ...; or Qwen3-Reranker, a
  causal LM converted by ``hf_overrides``' ``classifier_from_token``) classifies its last
  token;
* a causal LM generates, unless its folder is a sentence-transformers model (a
  ``modules.json`` with a Pooling module, as Qwen3-Embedding ships) or the engine is told
  ``runner="pooling"`` / ``convert="embed"``: then it embeds its last hidden states (after
  the final norm), pooled.

The pooling of an embedder comes from sentence-transformers' ``1_Pooling/config.json``
when there is one (cls, mean, max or last token), else the flag ``pooling_type``, else
vLLM's defaults (CLS for BERT, the last token for a decoder). Normalisation is on when
``modules.json`` lists a Normalize module; a folder without ``modules.json`` normalises,
as vLLM's embed default. Dense modules between the pooling and the normalisation
(EmbeddingGemma's two projections) run on the pooled vector, in fp32. ``sentence_bert_config.json``'s ``max_seq_length`` caps the
context (sentence-transformers truncates there; the engine refuses longer inputs unless
the request asks for truncation).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from engine.errors import ConfigError, CorruptModelError, UnsupportedModelError
from engine.models.config import ModelConfig
from engine.models.encoder_config import SEQUENCE_CLASSIFIERS, TOKEN_CLASSIFIERS

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed")
POOLING_TYPES = ("auto", "cls", "mean", "max", "last")

# sentence-transformers' Pooling modes -> ours; the others (weighted mean, mean/sqrt(len))
# are refused rather than approximated.
_ST_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "last",
}
_ST_MODULES = ("Transformer", "Pooling", "Dense", "Normalize")
# sentence-transformers' Dense activations (its config's activation_function) -> ours.
_ST_DENSE_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity",
                         "torch.nn.modules.activation.Tanh": "tanh"}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PoolerConfig:
    """How a pooling model turns a prompt's hidden states into its one output vector."""

    # "embed" (a vector per input), "classify" (one logit per label) or "token_classify"
    # (one logit per label for every token)
    task: str
    pooling: str  # "cls", "mean", "max" or "last" (classify: "cls"; token_classify: "all")
    normalize: bool  # L2-normalise the embedding
    size: int  # the output's length: hidden size, or num_labels
    # sentence_bert_config.json's max_seq_length (None: the model's positions)
    max_seq_length: int | None = None
    # Dimensions a request may cut the embedding to (Matryoshka); None: refused.
    matryoshka_dimensions: tuple[int, ...] | None = None
    # sentence-transformers' Dense modules after the pooling (EmbeddingGemma's 768 -> 3072
    # -> 768), in order: their folders under the model's (:func:`read_dense`); ``size`` is
    # the last one's output.
    dense: tuple[str, ...] = ()
    # A classifier's label names by index (``size`` of them); () for an embedder.
    labels: tuple[str, ...] = ()

    def normalizes(self, asked: bool | None) -> bool:
        """Whether an embedding is L2-normalised: as a request asks (vLLM's ``normalize``),
        else as the model's pipeline does."""
        return self.normalize if asked is None else asked


def pooler_config(
    config: ModelConfig,
    folder: Path,
    *,
    runner: str = "auto",
    convert: str = "auto",
    pooling_type: str = "auto",
    normalize: bool | None = None,
) -> PoolerConfig | None:
    """The model's pooler, or ``None`` for a model that generates. Raises
    :class:`ConfigError` for flags that contradict the model, and
    :class:`UnsupportedModelError` for a sentence-transformers pipeline it cannot run."""
    classifier = config.architecture in SEQUENCE_CLASSIFIERS | TOKEN_CLASSIFIERS
    if config.seq_classifier:  # a decoder's *ForSequenceClassification: its last token scored
        if runner == "generate" or convert in ("embed", "none"):
            raise ConfigError(f"{folder}: a sequence classifier is a pooling model; it cannot "
                              f"{'generate' if runner == 'generate' or convert == 'none' else 'be converted to embed'}",
                              field="runner" if runner == "generate" else "convert")
        if pooling_type not in ("auto", "last"):
            raise ConfigError(f"a decoder's sequence classifier pools its last token; pooling_type "
                              f"{pooling_type!r} does not apply", field="pooling_type")
        return PoolerConfig(task="classify", pooling="last", normalize=False,
                            size=config.num_labels, labels=config.labels)
    if config.is_encoder and (runner == "generate" or convert == "embed" and classifier):
        raise ConfigError(
            f"{folder}: a {config.architecture} encoder is a pooling model; it cannot "
            f"{'generate' if runner == 'generate' else 'be converted to embed'}",
            field="runner" if runner == "generate" else "convert")
    if config.architecture in TOKEN_CLASSIFIERS:
        if pooling_type != "auto":
            raise ConfigError(f"a token classifier classifies every token; pooling_type "
                              f"{pooling_type!r} does not apply", field="pooling_type")
        return PoolerConfig(task="token_classify", pooling="all", normalize=False,
                            size=config.num_labels, labels=config.labels)
    if classifier:
        # BERT's head reads the [CLS] row; ModernBERT's the row its classifier_pooling says.
        own = config.modernbert.classifier_pooling if config.modernbert is not None else "cls"
        if pooling_type not in ("auto", own):
            what = "its [CLS] token" if own == "cls" else "the mean of its tokens"
            raise ConfigError(f"this sequence classifier pools {what}; pooling_type "
                              f"{pooling_type!r} does not apply", field="pooling_type")
        return PoolerConfig(task="classify", pooling=own, normalize=False,
                            size=config.num_labels, labels=config.labels)
    if config.base_model and (runner == "generate" or convert == "none"):
        raise ConfigError(f"{folder}: a decoder saved without its LM head can only pool; it "
                          "cannot generate", field="runner" if runner == "generate" else "convert")
    if not config.is_encoder and (runner == "generate" or convert == "none"):
        if convert == "embed":
            raise ConfigError("convert 'embed' makes a pooling model; runner 'generate' "
                              "contradicts it", field="convert")
        if runner == "pooling":
            raise ConfigError("runner 'pooling' needs a pooling model: with convert 'none' "
                              "this causal LM only generates", field="runner")
        return None
    st = _sentence_transformers(folder)
    if (not config.is_encoder and not config.base_model and runner == "auto"
            and convert == "auto" and st is None):
        return None  # a causal LM generates unless its files or the flags say otherwise
    pooling = pooling_type
    if pooling == "auto":
        pooling = (st or {}).get("pooling") or ("cls" if config.is_encoder else "last")
    if normalize is None:
        normalize = st["normalize"] if st is not None else True
    dense = (st or {}).get("dense", ())
    size = config.hidden_size
    for path in dense:
        layer = read_dense(folder, path, weights=False)
        if layer.in_features != size:
            raise CorruptModelError(f"{folder / path}: in_features {layer.in_features} does not "
                                    f"follow the {size} values before it")
        size = layer.out_features
    return PoolerConfig(
        task="embed", pooling=pooling, normalize=normalize, size=size,
        max_seq_length=(st or {}).get("max_seq_length"),
        matryoshka_dimensions=config.matryoshka_dimensions, dense=tuple(dense),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class DenseLayer:
    """One sentence-transformers Dense module: ``activation(x @ weight.T + bias)``."""

    in_features: int
    out_features: int
    activation: str  # "identity" or "tanh"
    weight: Any = None  # torch.Tensor [out, in], fp32 (None: not read)
    bias: Any = None  # torch.Tensor [out] or None


def read_dense(folder: Path, path: str, *, weights: bool = True) -> DenseLayer:
    """The Dense module in ``folder / path`` (its config.json, and with ``weights`` its
    model.safetensors' ``linear.weight`` / ``linear.bias`` in fp32)."""
    where = folder / path
    raw = _json(where / "config.json")
    activation = _ST_DENSE_ACTIVATIONS.get(str(raw.get("activation_function", "")))
    if activation is None:
        raise UnsupportedModelError(f"{where}: Dense activation {raw.get('activation_function')!r} "
                                    f"is not supported; {', '.join(_ST_DENSE_ACTIVATIONS)} are")
    try:
        layer = DenseLayer(int(raw["in_features"]), int(raw["out_features"]), activation)
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptModelError(f"{where}/config.json: {exc}") from exc
    if not weights:
        return layer
    file = where / "model.safetensors"
    if not file.is_file():
        raise CorruptModelError(f"{where}: no model.safetensors (a pickled pytorch_model.bin is "
                                "not read)")
    from safetensors.torch import load_file

    tensors = load_file(str(file))
    weight = tensors.get("linear.weight")
    if weight is None or tuple(weight.shape) != (layer.out_features, layer.in_features):
        raise CorruptModelError(f"{file}: linear.weight is not [{layer.out_features}, {layer.in_features}]")
    bias = tensors.get("linear.bias")
    if bool(raw.get("bias", True)) != (bias is not None):
        raise CorruptModelError(f"{file}: the bias does not match config.json's")
    return dataclasses.replace(layer, weight=weight.float(), bias=None if bias is None else bias.float())


def _sentence_transformers(folder: Path) -> dict[str, Any] | None:
    """``{"pooling", "normalize", "max_seq_length"}`` of a sentence-transformers folder
    (``modules.json``), or None when it is not one."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _json(modules_file)
    if not isinstance(modules, list):
        raise CorruptModelError(f"{modules_file}: expected a list of modules")
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules if isinstance(m, dict)]
    unknown = [k for k in kinds if k not in _ST_MODULES]
    if unknown:
        raise UnsupportedModelError(
            f"{modules_file}: sentence-transformers module(s) {', '.join(unknown)} are not "
            f"supported; supported: {', '.join(_ST_MODULES)}")
    out: dict[str, Any] = {"pooling": None, "normalize": "Normalize" in kinds}
    order = [k for k in kinds if k in ("Pooling", "Dense", "Normalize")]
    dense_at = [i for i, k in enumerate(order) if k == "Dense"]
    if dense_at and (order[:dense_at[0]] != ["Pooling"] or "Pooling" in order[dense_at[0]:]
                     or order[dense_at[-1] + 1:] not in ([], ["Normalize"])):
        raise UnsupportedModelError(f"{modules_file}: Dense modules are supported between the "
                                    f"Pooling and the Normalize module only, got {order}")
    out["dense"] = tuple(str(m.get("path", "")) for m in modules
                         if str(m.get("type", "")).endswith("Dense"))
    pooling_module = next((m for m in modules if str(m.get("type", "")).endswith("Pooling")), None)
    if pooling_module is not None:
        out["pooling"] = _st_pooling(folder / str(pooling_module.get("path", "")) / "config.json")
    bert_config = folder / "sentence_bert_config.json"
    if bert_config.is_file():
        length = _json(bert_config).get("max_seq_length")
        out["max_seq_length"] = int(length) if length else None
    return out


# sentence-transformers 6's one "pooling_mode" string -> ours.
_ST_MODE_NAMES = {"cls": "cls", "mean": "mean", "max": "max", "lasttoken": "last"}


def _st_pooling(path: Path) -> str:
    raw = _json(path)
    if raw.get("include_prompt") is False:
        raise UnsupportedModelError(f"{path}: include_prompt false is not supported")
    mode = raw.get("pooling_mode")
    if isinstance(mode, str):  # sentence-transformers 6 writes one mode by name
        if mode not in _ST_MODE_NAMES:
            raise UnsupportedModelError(f"{path}: pooling {mode!r} is not supported; one of "
                                        f"{', '.join(_ST_MODE_NAMES)} is")
        return _ST_MODE_NAMES[mode]
    modes = [name for name, on in raw.items() if name.startswith("pooling_mode_") and on]
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise UnsupportedModelError(
            f"{path}: pooling {modes or 'none'} is not supported; one of "
            f"{', '.join(_ST_MODES)} is")
    return _ST_MODES[modes[0]]


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CorruptModelError(f"{path}: not readable JSON ({exc})") from exc
