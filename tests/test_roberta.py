"""RoBERTa and XLM-RoBERTa encoders (multilingual-e5, bge-m3, bge-reranker-v2-m3 are
XLM-RoBERTa): tiny random models written by transformers, an XLM-R-style SentencePiece
tokenizer trained here, and transformers / sentence-transformers as the oracles."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from pooling_fixtures import check_classifier_and_tagger, cosines, sentences

import engine
from engine.errors import ConfigError, InputTooLongError

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # XLM-R's order: <pad> is id 1


@functools.cache
def _tokenizer_json() -> str:
    """A Unigram (SentencePiece) tokenizer trained on the test corpus, with XLM-R's
    special tokens and pair template ``<s> A </s></s> B </s>``. Trained once: the trainer's
    threads make two trainings differ."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=400, special_tokens=SPECIALS, unk_token="<unk>")
    tok.train_from_iterator(sentences(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)])
    return tok.to_str()


def _write_tokenizer(path: Path) -> None:
    (path / "tokenizer.json").write_text(_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "sep_token": "</s>", "cls_token": "<s>", "unk_token": "<unk>", "pad_token": "<pad>",
        "mask_token": "<mask>", "model_max_length": 256}))


def _config(cls_name: str, **extra):
    import transformers

    config_cls = getattr(transformers, "XLMRobertaConfig" if cls_name.startswith("XLM") else "RobertaConfig")
    # 258 position rows: the first two are the pad's and below it, so 256 tokens fit.
    return config_cls(vocab_size=400, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=258, type_vocab_size=1,
                      pad_token_id=1, bos_token_id=0, eos_token_id=2, initializer_range=0.2,
                      **extra)


def _write(path: Path, cls_name: str, **extra) -> Path:
    import transformers

    torch.manual_seed(0)
    getattr(transformers, cls_name)(_config(cls_name, **extra)).eval().save_pretrained(str(path))
    _write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def e5_like(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An XLMRobertaModel in a sentence-transformers folder: mean pooling, normalised (the
    multilingual-e5 pipeline)."""
    path = _write(tmp_path_factory.mktemp("xlmr"), "XLMRobertaModel")
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


async def test_an_xlm_roberta_embedder_matches_sentence_transformers(e5_like: Path) -> None:
    from sentence_transformers import SentenceTransformer

    # The last text holds the pad token itself: RoBERTa gives it the pad's position row
    # and counts the rows after it from there, as transformers does.
    texts = sentences()[:40] + ["a <pad> inside the text", "x"]
    want = SentenceTransformer(str(e5_like), device="cpu").encode(texts, batch_size=8)
    async with engine.open_engine(e5_like, dtype="float32", max_num_seqs=16) as eng:
        assert eng.pooler.task == "embed" and eng.pooler.pooling == "mean" and eng.pooler.normalize
        got = np.stack([p.vector() for p in await eng.embed(texts)])
    assert cosines(got, want).min() >= 0.9999
    assert np.allclose(got, want, atol=1e-5)


async def test_the_longest_input_is_the_position_tables_less_the_pad_rows(e5_like: Path) -> None:
    from transformers import AutoTokenizer, XLMRobertaModel

    hf = XLMRobertaModel.from_pretrained(str(e5_like)).eval()
    tok = AutoTokenizer.from_pretrained(str(e5_like))
    words = " ".join(sentences())
    async with engine.open_engine(e5_like, dtype="float32") as eng:
        longest = eng.max_model_len
        ids = tok(words, truncation=True, max_length=longest)["input_ids"]
        got = (await eng.embed([ids]))[0].vector()
        with pytest.raises(InputTooLongError):
            await eng.embed([ids[:-1] + [ids[-2]] * 2])
    with torch.no_grad():
        hidden = hf(torch.tensor([ids])).last_hidden_state[0].mean(0)
        with pytest.raises((IndexError, RuntimeError)):  # one more reads past the position table
            hf(torch.tensor([ids + [ids[-2]]]))
    assert len(ids) == longest
    want = torch.nn.functional.normalize(hidden, dim=0).numpy()
    assert np.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("cls_name", ["XLMRobertaForSequenceClassification",
                                      "RobertaForSequenceClassification"])
async def test_a_roberta_cross_encoder_scores_as_transformers(tmp_path: Path, cls_name: str) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = _write(tmp_path, cls_name, num_labels=1)
    query = "How many people live in the city?"
    docs = sentences()[5:9] + ["x"]
    async with engine.open_engine(path, dtype="float32") as eng:
        assert eng.pooler.task == "classify"
        scores = await eng.score(query, docs)
    tok = AutoTokenizer.from_pretrained(str(path))
    hf = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    with torch.no_grad():
        batch = tok([query] * len(docs), docs, padding=True, return_tensors="pt")
        want = torch.sigmoid(hf(**batch).logits[:, 0]).tolist()
    assert np.allclose([s for s, _ in scores], want, atol=1e-5)
    assert [n for _, n in scores] == batch["attention_mask"].sum(1).tolist()
    assert np.ptp(want) > 1e-3  # the pairs score apart: the head reads what the encoder gave


async def test_a_roberta_classifier_and_tagger_give_transformers_probabilities(tmp_path: Path) -> None:
    from transformers import XLMRobertaForSequenceClassification, XLMRobertaForTokenClassification

    texts = sentences()[10:14]
    labels = {"id2label": {0: "neg", 1: "neu", 2: "pos"}, "label2id": {"neg": 0, "neu": 1, "pos": 2}}
    classifier = _write(tmp_path / "cls", "XLMRobertaForSequenceClassification", **labels)
    tagger = _write(tmp_path / "tag", "XLMRobertaForTokenClassification", **labels)
    pooler = await check_classifier_and_tagger(classifier, tagger, texts, XLMRobertaForSequenceClassification,
                                               XLMRobertaForTokenClassification)
    assert pooler.labels == ("neg", "neu", "pos")


async def test_an_encoder_longer_than_the_step_budget_takes_a_step_its_size(tmp_path: Path) -> None:
    """bge-m3 reads 8,192 tokens, past the default step budget (2,048): left at its default
    the budget grows to a whole input, as vLLM sizes an encoder's; set lower, it is refused."""
    from transformers import XLMRobertaModel

    path = tmp_path / "long"
    torch.manual_seed(0)
    config = _config("XLMRobertaModel")
    config.max_position_embeddings = 4096 + 2
    XLMRobertaModel(config).eval().save_pretrained(str(path))
    _write_tokenizer(path)
    ids = [0] + [5 + i % 300 for i in range(4094)] + [2]
    async with engine.open_engine(path, dtype="float32") as eng:
        assert eng.max_model_len == 4096 and eng.pooler.pooling == "cls"
        got = (await eng.embed([ids]))[0].vector()
    with torch.no_grad():
        first = XLMRobertaModel.from_pretrained(str(path)).eval()(torch.tensor([ids])).last_hidden_state[0, 0]
    assert np.allclose(got, torch.nn.functional.normalize(first, dim=0).numpy(), atol=1e-5)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        async with engine.open_engine(path, dtype="float32", max_num_batched_tokens=1024):
            pass
