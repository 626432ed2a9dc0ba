"""Decoders as sequence classifiers: transformers' ``Qwen3ForSequenceClassification`` (its
last token's final hidden state through ``score``) and Qwen3-Reranker's form, a causal LM
converted by vLLM's ``hf_overrides`` (``classifier_from_token``: the two tokens' LM-head
rows, differenced), each against transformers on the same weights and text."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

import engine
from engine.errors import InvalidParamError, UnsupportedModelError
from engine.models.testing import write_tiny_model

TEXTS = ["The first request of the day.", "A second one, somewhat longer than the first one.", "x"]


# Tiny family -> transformers' classifier class (the scored row is the final norm's,
# before any of the LM head's own soft-cap).
CLASSIFIERS = {"qwen3": "Qwen3ForSequenceClassification", "gemma2": "Gemma2ForSequenceClassification",
               "phi3": "Phi3ForSequenceClassification", "smollm3": "SmolLM3ForSequenceClassification",
               "olmo2": "Olmo2ForSequenceClassification"}


def _classifier(tmp_path: Path, labels: int, arch: str = "qwen3") -> Path:
    """The tiny ``arch`` model rewritten by transformers as its *ForSequenceClassification."""
    import transformers

    folder = write_tiny_model(tmp_path / f"{arch}-cls{labels}", arch)
    raw = json.loads((folder / "config.json").read_text())
    names = {i: f"class-{i}" for i in range(labels)}
    config = transformers.AutoConfig.for_model(**{k: v for k, v in raw.items() if k != "architectures"},
                                               num_labels=labels, id2label=names,
                                               label2id={v: k for k, v in names.items()})
    torch.manual_seed(0)
    model = getattr(transformers, CLASSIFIERS[arch])(config)
    # The decoder's weights as the tiny model drew them (transformers' 0.02 init makes every
    # text look alike); a wide head, so the texts score apart.
    weights = {k: v for k, v in load_file(str(folder / "model.safetensors")).items() if k != "lm_head.weight"}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert set(missing) == {"score.weight"} and not unexpected, (missing, unexpected)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)
    (folder / "model.safetensors").unlink()
    model.save_pretrained(str(folder))
    return folder


def _ids(folder: Path, text: str) -> list[int]:
    return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids


@pytest.mark.parametrize(("arch", "labels"), [("qwen3", 1), ("qwen3", 3), ("gemma2", 1), ("phi3", 3),
                                             ("smollm3", 1), ("olmo2", 1)])
async def test_a_decoder_sequence_classifier_gives_transformers_logits(tmp_path: Path, arch: str,
                                                                      labels: int) -> None:
    import transformers

    folder = _classifier(tmp_path, labels, arch)
    hf = getattr(transformers, CLASSIFIERS[arch]).from_pretrained(str(folder)).eval()
    async with engine.open_engine(folder, dtype="float32") as eng:
        assert eng.pooler.task == "classify" and eng.pooler.pooling == "last"
        assert eng.pooler.labels == tuple(hf.config.id2label[i] for i in range(labels))
        logits = [p for p, _ in await eng.classify(TEXTS, use_activation=False)]
        probs = [p for p, _ in await eng.classify(TEXTS)]
        scores = await eng.score(TEXTS[0], TEXTS[1:]) if labels == 1 else None
        with pytest.raises(InvalidParamError):
            await eng.embed(TEXTS[0])
    with torch.no_grad():
        want = [hf(torch.tensor([_ids(folder, t)])).logits[0] for t in TEXTS]
        assert np.allclose(logits, torch.stack(want).numpy(), atol=1e-5)
        act = [torch.sigmoid(w) if labels == 1 else torch.softmax(w, -1) for w in want]
        assert np.allclose(probs, torch.stack(act).numpy(), atol=1e-6)
        if scores is not None:  # a pair is read as its two texts' tokens back to back
            pairs = [hf(torch.tensor([_ids(folder, TEXTS[0]) + _ids(folder, t)])).logits[0, 0] for t in TEXTS[1:]]
            assert np.allclose([s for s, _ in scores], torch.sigmoid(torch.stack(pairs)).numpy(), atol=1e-6)
    assert np.ptp(np.array(logits), axis=0).max() > 0.1  # the texts score apart


async def test_a_causal_lm_served_as_a_reranker_from_two_tokens(tmp_path: Path) -> None:
    """Qwen3-Reranker's recipe: hf_overrides names Qwen3ForSequenceClassification and the
    tokens [no, yes]; a pair's score is then P(yes) over {no, yes} at the last position of
    the causal LM (its softmax over the two tokens' logits)."""
    from transformers import AutoModelForCausalLM

    folder = write_tiny_model(tmp_path / "lm", "qwen3")
    vocab = Tokenizer.from_file(str(folder / "tokenizer.json"))
    no, yes = vocab.id_to_token(100), vocab.id_to_token(200)  # two tokens of the tiny vocabulary
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [no, yes],
                 "is_original_qwen3_reranker": True}
    query, docs = "Which text is about the day?", TEXTS
    async with engine.open_engine(folder, dtype="float32", hf_overrides=overrides) as eng:
        assert eng.pooler.task == "classify"
        scores = await eng.score(query, docs)
    lm = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        want = []
        for doc in docs:
            last = lm(torch.tensor([_ids(folder, query) + _ids(folder, doc)])).logits[0, -1]
            want.append(torch.softmax(last[[100, 200]], -1)[1].item())
    assert np.allclose([s for s, _ in scores], want, atol=1e-5)
    assert np.ptp(want) > 1e-3


@pytest.mark.parametrize(("overrides", "match"), [
    ({"classifier_from_token": ["a"], "is_original_qwen3_reranker": True}, "two tokens"),
    ({"classifier_from_token": ["a", "b"]}, "from_2_way_softmax"),
    ({"classifier_from_token": ["<not a token>", "b"], "method": "from_2_way_softmax"}, "not a token"),
])
async def test_a_token_classifier_conversion_it_cannot_build_is_refused(
    tmp_path: Path, overrides: dict, match: str
) -> None:
    folder = write_tiny_model(tmp_path / "lm", "qwen3")
    vocab = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokens = [t if t != "a" and t != "b" else vocab.id_to_token(100 if t == "a" else 200)
              for t in overrides["classifier_from_token"]]
    overrides = overrides | {"classifier_from_token": tokens, "architectures": ["Qwen3ForSequenceClassification"]}
    with pytest.raises(UnsupportedModelError, match=match):
        async with engine.open_engine(folder, dtype="float32", hf_overrides=overrides):
            pass


def test_the_reranker_recipe_over_http_in_an_engine_core_process(tmp_path: Path) -> None:
    """vLLM's Qwen3-Reranker recipe end to end: the hf_overrides through an engine core in
    its own process (which reads the tokens' ids itself), then /rerank and /score, against
    the causal LM's two-token softmax."""
    import httpx
    from http_server import ServerThread
    from transformers import AutoModelForCausalLM

    folder = write_tiny_model(tmp_path / "lm", "qwen3")
    vocab = Tokenizer.from_file(str(folder / "tokenizer.json"))
    overrides = {"architectures": ["Qwen3ForSequenceClassification"],
                 "classifier_from_token": [vocab.id_to_token(100), vocab.id_to_token(200)],
                 "method": "from_2_way_softmax"}
    query, docs = "Which text is about the day?", TEXTS
    opener = lambda: engine.open_engine(folder, dtype="float32", hf_overrides=overrides,  # noqa: E731
                                        engine_core="process")
    with ServerThread(opener) as srv:
        rerank = httpx.post(srv.base_url + "/rerank", timeout=60, json={
            "query": query, "documents": docs}).json()
        score = httpx.post(srv.base_url + "/score", timeout=60, json={"text_1": query, "text_2": docs[0]}).json()
    lm = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        want = np.array([torch.softmax(lm(torch.tensor([_ids(folder, query) + _ids(folder, d)])).logits[0, -1, [100, 200]],
                                       -1)[1].item() for d in docs])
    order = list(np.argsort(-want, kind="stable"))
    assert [r["index"] for r in rerank["results"]] == order
    assert np.allclose([r["relevance_score"] for r in rerank["results"]], want[order], atol=1e-5)
    assert np.allclose([score["data"][0]["score"]], want[:1], atol=1e-5)
