"""Models and oracles the pooling tests share (tests/test_pooling.py, test_http_pooling.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import engine
from engine.models.loader import default_embedding_model_path

CORPUS = Path(__file__).parent / "data" / "perplexity_en.txt"


def sentences() -> list[str]:
    """The test corpus cut into its sentences (109 of them, 1 to ~60 tokens)."""
    text = CORPUS.read_text(encoding="utf-8")
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if len(s.strip()) > 3]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="session")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """all-MiniLM-L6-v2's folder, extracted from its package into a test cache."""
    return default_embedding_model_path(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def st_embeddings(minilm: Path) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm), device="cpu")
    return model.encode(sentences(), batch_size=32, convert_to_numpy=True)



@pytest.fixture(scope="session")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory, minilm: Path) -> Path:
    """A tiny random BertForSequenceClassification (one label) with MiniLM's tokenizer."""
    from transformers import BertConfig, BertForSequenceClassification

    path = tmp_path_factory.mktemp("cross")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, num_labels=1,
                        max_position_embeddings=128)
    BertForSequenceClassification(config).save_pretrained(str(path))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).write_bytes((minilm / name).read_bytes())
    return path


@pytest.fixture(scope="session")
def classifier(tmp_path_factory: pytest.TempPathFactory, minilm: Path) -> Path:
    """A tiny random BertForSequenceClassification with three named labels whose head is
    set so that three texts (``CLASSIFIER_TEXTS``) each get a different label: its rows
    point from the texts' mean pooled vector towards each text's."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    path = tmp_path_factory.mktemp("classifier")
    torch.manual_seed(0)
    names = {0: "negative", 1: "neutral", 2: "positive"}
    # A wide initialisation: at the default 0.02 every text's [CLS] row is nearly the same.
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, num_labels=3,
                        id2label=names, label2id={v: k for k, v in names.items()},
                        max_position_embeddings=128, initializer_range=0.2)
    model = BertForSequenceClassification(config).eval()
    tok = AutoTokenizer.from_pretrained(str(minilm))
    with torch.no_grad():
        pooled = model.bert(**tok(CLASSIFIER_TEXTS, padding=True, return_tensors="pt")).pooler_output
        mean = pooled.mean(0)
        rows = pooled - mean
        rows = 4.0 * rows / rows.norm(dim=1, keepdim=True)
        model.classifier.weight.copy_(rows)
        model.classifier.bias.copy_(-(rows @ mean))
    model.save_pretrained(str(path))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).write_bytes((minilm / name).read_bytes())
    return path


CLASSIFIER_TEXTS = ["Dreadful.", "It was fine, I suppose.", "I loved every minute of it."]


@pytest.fixture(scope="session")
def tagger(tmp_path_factory: pytest.TempPathFactory, minilm: Path) -> Path:
    """A tiny random BertForTokenClassification (an NER-style tagger, five named labels)
    with MiniLM's tokenizer; a wide initialisation so that its tokens get different labels."""
    from transformers import BertConfig, BertForTokenClassification

    path = tmp_path_factory.mktemp("tagger")
    torch.manual_seed(0)
    names = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, num_labels=5,
                        id2label=names, label2id={v: k for k, v in names.items()},
                        max_position_embeddings=128, initializer_range=0.2)
    BertForTokenClassification(config).save_pretrained(str(path))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).write_bytes((minilm / name).read_bytes())
    return path


async def check_classifier_and_tagger(classifier: Path, tagger: Path, texts: list[str],
                                      hf_classifier: type, hf_tagger: type) -> Any:
    """An encoder's sequence classifier and token tagger (folders written by transformers)
    give transformers' probabilities: softmax of the classifier's logits for each text,
    and of the tagger's for every token. Returns the classifier's pooler (labels, pooling)."""
    from transformers import AutoTokenizer

    async with engine.open_engine(classifier, dtype="float32") as eng:
        pooler = eng.pooler
        classes = [probs for probs, _ in await eng.classify(texts)]
    async with engine.open_engine(tagger, dtype="float32") as eng:
        assert eng.pooler.task == "token_classify"
        tags = [p.matrix() for p in await eng.classify_tokens(texts)]
    tok = AutoTokenizer.from_pretrained(str(classifier))
    hf_cls = hf_classifier.from_pretrained(str(classifier)).eval()
    hf_tag = hf_tagger.from_pretrained(str(tagger)).eval()
    with torch.no_grad():
        want = torch.softmax(hf_cls(**tok(texts, padding=True, return_tensors="pt")).logits, -1)
        assert np.allclose(np.array(classes), want.numpy(), atol=1e-5)
        for got, text in zip(tags, texts, strict=True):
            rows = torch.softmax(hf_tag(**tok(text, return_tensors="pt")).logits[0], -1)
            assert got.shape == tuple(rows.shape)
            assert np.allclose(got, rows.numpy(), atol=1e-5)
    return pooler
