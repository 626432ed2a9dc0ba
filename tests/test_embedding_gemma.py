"""EmbeddingGemma's layout (google/embeddinggemma-300m): Gemma 3's decoder with every token
attending to every other (``use_bidirectional_attention``; the sliding layers within the
window either side), mean pooling, two Dense projections and normalisation, as a
sentence-transformers folder. A tiny one is written by transformers and
sentence-transformers; its embeddings against sentence-transformers' ``encode`` of the
same sentences, which is the oracle (it runs transformers' ``Gemma3TextModel``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import engine
from engine.errors import ConfigError
from engine.models.testing import write_tiny_model

SENTENCES = ["The quick brown fox jumps over the lazy dog near the river bank today.",
             "Paris is the capital of France.", "a", "Embeddings map text to vectors, "
             "and a bidirectional model reads every word before it writes one vector."]


def write_tiny_embedding_gemma(root: Path) -> Path:
    """A sentence-transformers folder: the tiny Gemma 3's weights as a bidirectional
    ``Gemma3TextModel`` (its 8-token window: 5 either side), mean pooling, Dense 64 -> 192
    -> 64 without bias (EmbeddingGemma's 768 -> 3072 -> 768), Normalize."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models
    from transformers import AutoTokenizer, Gemma3TextConfig, Gemma3TextModel

    text = write_tiny_model(root / "text", "gemma3")
    raw = json.loads((text / "config.json").read_text())
    config = Gemma3TextConfig(**{k: v for k, v in raw.items()
                                 if k not in ("architectures", "model_type", "transformers_version")},
                              use_bidirectional_attention=True)
    torch.manual_seed(0)
    model = Gemma3TextModel(config)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.normal_(0.0, 0.3) if p.dim() > 1 else p.normal_(0.0, 0.1)
    hf = root / "hf"
    model.save_pretrained(hf)
    AutoTokenizer.from_pretrained(text).save_pretrained(hf)
    # Without a chat template, as EmbeddingGemma's sentence-transformers folder reads its
    # texts (sentence-transformers 6 would wrap each text in the tiny model's ChatML).
    (hf / "chat_template.jinja").unlink(missing_ok=True)
    tok_config = json.loads((hf / "tokenizer_config.json").read_text())
    tok_config.pop("chat_template", None)
    (hf / "tokenizer_config.json").write_text(json.dumps(tok_config))
    word = models.Transformer(str(hf))
    dim = word.get_embedding_dimension()
    identity = torch.nn.Identity()
    dense = [models.Dense(dim, 3 * dim, bias=False, activation_function=identity),
             models.Dense(3 * dim, dim, bias=False, activation_function=identity)]
    for layer in dense:
        torch.nn.init.normal_(layer.linear.weight, 0.0, 0.2)
    st = SentenceTransformer(modules=[word, models.Pooling(dim, "mean"), *dense, models.Normalize()],
                             device="cpu")
    st.save(str(root / "st"))
    return root / "st"


@pytest.fixture(scope="module")
def embedding_gemma(tmp_path_factory) -> Path:
    return write_tiny_embedding_gemma(tmp_path_factory.mktemp("embedding-gemma"))


def _oracle(folder: Path, sentences: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return torch.tensor(SentenceTransformer(str(folder), device="cpu").encode(sentences))


@pytest.mark.parametrize("ops", ["cpu", "torch"])
async def test_embeddings_match_sentence_transformers(embedding_gemma, ops) -> None:
    want = _oracle(embedding_gemma, SENTENCES)
    async with engine.open_engine(str(embedding_gemma), dtype="float32", ops_backend=ops,
                                  kv_cache_memory=8 * 2**20) as eng:
        got = torch.tensor(np.stack([p.vector() for p in await eng.embed(SENTENCES)]))
    assert got.shape == want.shape == (len(SENTENCES), 64)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


async def test_prompts_that_share_a_step_budget_each_run_whole(embedding_gemma) -> None:
    """A step of 64 tokens holds two or three of these prompts: the scheduler starts a
    prompt only where it fits whole (a bidirectional prompt cannot be chunked)."""
    sentences = [f"{SENTENCES[0]} Number {i}." for i in range(8)]
    want = _oracle(embedding_gemma, sentences)
    async with engine.open_engine(str(embedding_gemma), dtype="float32", max_model_len=64,
                                  max_num_batched_tokens=64, kv_cache_memory=8 * 2**20) as eng:
        got = torch.tensor(np.stack([p.vector() for p in await eng.embed(sentences)]))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


async def test_the_model_really_reads_both_ways(embedding_gemma, tmp_path) -> None:
    """The same weights read causally (the flag off) embed otherwise: the oracle tells the
    two layouts apart, so a causal engine could not pass the test above."""
    causal = tmp_path / "causal"
    import shutil

    shutil.copytree(embedding_gemma, causal)
    raw = json.loads((causal / "config.json").read_text())
    raw["use_bidirectional_attention"] = False
    (causal / "config.json").write_text(json.dumps(raw))
    both, one_way = _oracle(embedding_gemma, SENTENCES[:1]), _oracle(causal, SENTENCES[:1])
    assert (both - one_way).abs().max() > 1e-2


async def test_a_bidirectional_decoder_only_embeds(embedding_gemma) -> None:
    with pytest.raises(ConfigError, match="only embeds|can only pool"):
        async with engine.open_engine(str(embedding_gemma), dtype="float32", runner="generate",
                                      kv_cache_memory=8 * 2**20):
            pass
