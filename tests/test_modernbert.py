"""ModernBERT encoders (gte-modernbert, modernbert-embed, gte-reranker-modernbert): tiny
random models written by transformers, a BPE tokenizer with ModernBERT's [CLS]/[SEP]
template trained here, and transformers / sentence-transformers as the oracles.

The models have a global layer, a local one and a global one again (global every second
layer), with a window of 4 tokens either side (local_attention 8): the test texts are
longer than that, and some longer than a block of queries of the local attention (64),
so the band mask and its blocks both count."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from pooling_fixtures import check_classifier_and_tagger, cosines, sentences

import engine
from engine.errors import ConfigError, UnsupportedModelError
from engine.models.config import ModelConfig
from engine.models.pooling import pooler_config

SPECIALS = ["[CLS]", "[SEP]", "[PAD]", "[UNK]", "[MASK]"]
LAYERS = 3
# Texts of 3 to 155 tokens (the longest joins four sentences).
TEXTS = sentences()[:24] + [" ".join(sentences()[30:34]), "x"]


@functools.cache
def _tokenizer_json() -> str:
    """A byte-level BPE tokenizer (ModernBERT's kind) trained on the test corpus, with the
    template ``[CLS] A [SEP]`` and ``[CLS] A [SEP] B [SEP]``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sentences(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", 0), ("[SEP]", 1)])
    return tok.to_str()


def _write_tokenizer(path: Path) -> None:
    (path / "tokenizer.json").write_text(_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "cls_token": "[CLS]", "sep_token": "[SEP]",
        "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]",
        "model_max_length": 512, "model_input_names": ["input_ids", "attention_mask"]}))


def _config(**extra):
    from transformers import ModernBertConfig

    # A wide initialisation, so that the texts' outputs differ.
    fields = dict(vocab_size=400, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                  intermediate_size=48, max_position_embeddings=512, local_attention=8,
                  global_attn_every_n_layers=2, pad_token_id=2, bos_token_id=0, cls_token_id=0,
                  eos_token_id=1, sep_token_id=1, initializer_range=0.2)
    return ModernBertConfig(**(fields | extra))


def _write(path: Path, cls_name: str, **extra) -> Path:
    import transformers

    torch.manual_seed(0)
    getattr(transformers, cls_name)(_config(**extra)).eval().save_pretrained(str(path))
    _write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ModernBertModel in a sentence-transformers folder: mean pooling, normalised (the
    gte-modernbert / modernbert-embed pipeline)."""
    path = _write(tmp_path_factory.mktemp("modernbert"), "ModernBertModel")
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}))
    (path / "2_Normalize").mkdir()
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256}))
    return path


def test_the_test_texts_reach_past_the_window_and_the_query_blocks(embedder: Path) -> None:
    from transformers import AutoTokenizer

    lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(str(embedder))(TEXTS)["input_ids"]]
    config = ModelConfig.from_hf(json.loads((embedder / "config.json").read_text()))
    assert config.modernbert is not None
    assert config.modernbert.local_layers == (1,) and config.modernbert.local_window == 4
    assert min(lengths) <= 5 and max(lengths) > 128 and max(lengths) <= 256


@pytest.fixture(scope="module")
def st_embeddings(embedder: Path) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(embedder), device="cpu").encode(TEXTS, batch_size=8)


# The C kernels (global layers' attention and RoPE in C, the local layers' in torch) and
# the torch reference ops.
@pytest.mark.parametrize("ops", ["cpu", "torch"])
async def test_a_modernbert_embedder_matches_sentence_transformers(
        embedder: Path, st_embeddings: np.ndarray, ops: str) -> None:
    async with engine.open_engine(embedder, dtype="float32", max_num_seqs=16, ops_backend=ops) as eng:
        assert eng.pooler.task == "embed" and eng.pooler.pooling == "mean" and eng.pooler.normalize
        got = np.stack([p.vector() for p in await eng.embed(TEXTS)])
    assert cosines(got, st_embeddings).min() >= 0.9999
    assert np.allclose(got, st_embeddings, atol=1e-5)


def test_the_local_window_changes_the_oracle(embedder: Path, st_embeddings: np.ndarray) -> None:
    """The same weights with every layer global embed the test texts differently, far
    beyond the tolerance: a model that ignored the window would fail the test above."""
    from transformers import AutoTokenizer, ModernBertModel

    everywhere = ModernBertModel.from_pretrained(str(embedder), layer_types=["full_attention"] * LAYERS).eval()
    assert everywhere.config.layer_types == ["full_attention"] * LAYERS
    tok = AutoTokenizer.from_pretrained(str(embedder))
    with torch.no_grad():
        batch = tok(TEXTS, padding=True, return_tensors="pt")
        hidden = everywhere(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1)
        global_only = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy()
    assert np.abs(global_only - st_embeddings).max() > 1e-2


@pytest.mark.parametrize("pooling", ["mean", "cls"])
async def test_a_modernbert_cross_encoder_scores_as_transformers(tmp_path: Path, pooling: str) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    # Every bias on (norms, attention, MLP, head) for the classifiers.
    path = _write(tmp_path, "ModernBertForSequenceClassification", num_labels=1, classifier_pooling=pooling,
                  norm_bias=True, attention_bias=True, mlp_bias=True, classifier_bias=True)
    query = "How many people live in the city?"
    docs = sentences()[5:9] + [" ".join(sentences()[50:54]), "x"]
    async with engine.open_engine(path, dtype="float32") as eng:
        assert eng.pooler.task == "classify" and eng.pooler.pooling == pooling
        scores = await eng.score(query, docs)
    tok = AutoTokenizer.from_pretrained(str(path))
    hf = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    with torch.no_grad():
        batch = tok([query] * len(docs), docs, padding=True, return_tensors="pt")
        want = torch.sigmoid(hf(**batch).logits[:, 0]).tolist()
    assert np.allclose([s for s, _ in scores], want, atol=1e-5)
    assert [n for _, n in scores] == batch["attention_mask"].sum(1).tolist()
    assert max(batch["attention_mask"].sum(1).tolist()) > 64
    assert np.ptp(want) > 1e-3  # the pairs score apart: the head reads what the encoder gave


async def test_a_modernbert_classifier_and_tagger_give_transformers_probabilities(tmp_path: Path) -> None:
    from transformers import ModernBertForSequenceClassification, ModernBertForTokenClassification

    texts = sentences()[10:14] + [" ".join(sentences()[60:65])]
    labels = {"id2label": {0: "neg", 1: "neu", 2: "pos"}, "label2id": {"neg": 0, "neu": 1, "pos": 2}}
    classifier = _write(tmp_path / "cls", "ModernBertForSequenceClassification", **labels)
    tagger = _write(tmp_path / "tag", "ModernBertForTokenClassification", norm_bias=True,
                    classifier_bias=True, **labels)
    pooler = await check_classifier_and_tagger(classifier, tagger, texts, ModernBertForSequenceClassification,
                                               ModernBertForTokenClassification)
    assert pooler.labels == ("neg", "neu", "pos") and pooler.pooling == "cls"


async def test_an_activation_the_model_does_not_compute_is_refused_naming_it(embedder: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="hidden_activation"):
        async with engine.open_engine(embedder, dtype="float32", hf_overrides={"hidden_activation": "silu"}):
            pass


@pytest.mark.parametrize(("arch", "field", "value"), [
    ("ModernBertForSequenceClassification", "classifier_activation", "relu"),
    ("ModernBertForSequenceClassification", "classifier_pooling", "max"),
    ("ModernBertModel", "rope_parameters", {"full_attention": {"rope_type": "linear", "factor": 2.0},
                                           "sliding_attention": {"rope_type": "default"}}),
    ("ModernBertModel", "rope_scaling", {"rope_type": "dynamic", "factor": 2.0}),
    ("ModernBertModel", "layer_types", ["full_attention", "chunked_attention", "full_attention"]),
    ("ModernBertModel", "head_dim", 16),
])
def test_what_the_layer_does_not_compute_is_refused_naming_the_field(
        embedder: Path, arch: str, field: str, value: object) -> None:
    raw = json.loads((embedder / "config.json").read_text()) | {"architectures": [arch], field: value}
    with pytest.raises(UnsupportedModelError, match=field if field != "layer_types" else "chunked_attention"):
        ModelConfig.from_hf(raw)


def test_older_configs_name_the_rope_bases_and_the_pattern_at_the_top_level() -> None:
    # ModernBERT-base's own config.json (transformers 4): global_rope_theta, local_rope_theta
    # and global_attn_every_n_layers, no layer_types or rope_parameters.
    raw = {"architectures": ["ModernBertModel"], "vocab_size": 50368, "hidden_size": 768,
           "intermediate_size": 1152, "num_hidden_layers": 22, "num_attention_heads": 12,
           "global_attn_every_n_layers": 3, "global_rope_theta": 160000.0, "local_rope_theta": 10000.0,
           "local_attention": 128, "max_position_embeddings": 8192, "norm_eps": 1e-5,
           "position_embedding_type": "absolute", "rope_scaling": None}
    config = ModelConfig.from_hf(raw)
    assert config.modernbert is not None
    assert config.rope_theta == 160000.0 and config.modernbert.local_rope_theta == 10000.0
    assert config.modernbert.local_window == 64
    assert config.modernbert.local_layers == tuple(i for i in range(22) if i % 3)
    assert config.head_dim == 64 and config.max_position_embeddings == 8192


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_a_classifier_pools_as_its_classifier_pooling_and_refuses_another(
        embedder: Path, tmp_path: Path, pooling: str) -> None:
    raw = json.loads((embedder / "config.json").read_text()) | {
        "architectures": ["ModernBertForSequenceClassification"], "classifier_pooling": pooling}
    config = ModelConfig.from_hf(raw)
    assert pooler_config(config, tmp_path).pooling == pooling
    assert pooler_config(config, tmp_path, pooling_type=pooling).pooling == pooling
    with pytest.raises(ConfigError, match="pooling_type"):
        pooler_config(config, tmp_path, pooling_type="mean" if pooling == "cls" else "cls")
