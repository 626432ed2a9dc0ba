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
from engine.models.testing_gemma3 import write_embedding_gemma

SENTENCES = ["The quick brown fox jumps over the lazy dog near the river bank today.",
             "Paris is the capital of France.", "a", "Embeddings map text to vectors, "
             "and a bidirectional model reads every word before it writes one vector."]


@pytest.fixture(scope="module")
def embedding_gemma(tmp_path_factory) -> Path:
    # The tiny Gemma 3's 8-token window reads as 5 either side: the sentences cross it.
    return write_embedding_gemma(tmp_path_factory.mktemp("embedding-gemma"))


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
