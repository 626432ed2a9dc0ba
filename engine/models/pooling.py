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
as vLLM's embed default. ``sentence_bert_config.json``'s ``max_seq_length`` caps the
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
_ST_MODULES = ("Transformer", "Pooling", "Normalize")


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
    return PoolerConfig(
        task="embed", pooling=pooling, normalize=normalize, size=config.hidden_size,
        max_seq_length=(st or {}).get("max_seq_length"),
        matryoshka_dimensions=config.matryoshka_dimensions,
    )


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
    pooling_module = next((m for m in modules if str(m.get("type", "")).endswith("Pooling")), None)
    if pooling_module is not None:
        out["pooling"] = _st_pooling(folder / str(pooling_module.get("path", "")) / "config.json")
    bert_config = folder / "sentence_bert_config.json"
    if bert_config.is_file():
        length = _json(bert_config).get("max_seq_length")
        out["max_seq_length"] = int(length) if length else None
    return out


def _st_pooling(path: Path) -> str:
    raw = _json(path)
    if raw.get("include_prompt") is False:
        raise UnsupportedModelError(f"{path}: include_prompt false is not supported")
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
