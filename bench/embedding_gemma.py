"""EmbeddingGemma-shaped embeddings: the engine's offline ``LLM.embed`` against
sentence-transformers' ``encode`` (batch 32) on the same folder and sentences.

    python bench/embedding_gemma.py [--sentences 256] [--rounds 3] [--layers 24]

Writes a random-weight sentence-transformers folder with embeddinggemma-300m's shape
(Gemma 3, hidden 768, 24 layers, 3 query heads and 1 KV head of 256, MLP 1152, five
sliding layers of 512 to one global, bidirectional; mean pooling, Dense 768 -> 3072 ->
768, Normalize) and the tiny models' tokenizer (so the vocabulary is 32,000 rows, not
262,144: the lookup is not what is timed). Each round times both, alternating which goes
first; prints sentences/s, the ratio of the medians, and the smallest cosine between the
two sides' vectors. fp32, the host's torch threads.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import embed as embed_bench  # noqa: E402

import engine  # noqa: E402
from engine.models.testing_gemma3 import write_embedding_gemma  # noqa: E402

SHAPE = dict(vocab_size=32000, hidden_size=768, intermediate_size=1152, num_attention_heads=3,
             num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
             max_position_embeddings=2048, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
             tie_word_embeddings=True)


def compare(llm: engine.LLM, st: object, sentences: list[str], rounds: int,
            warm: int = 8) -> dict[str, float]:
    """``llm.embed`` against ``st.encode`` (batch 32) of ``sentences``, ``rounds`` times,
    alternating which goes first, after both warmed up on the first ``warm``; prints each
    round, the medians, their ratio and the smallest cosine between the two sides'
    vectors, and returns the medians."""
    llm.embed(sentences[:warm], use_tqdm=False)
    st.encode(sentences[:warm], batch_size=32)  # type: ignore[attr-defined]
    rates: dict[str, list[float]] = {"engine": [], "sentence-transformers": []}
    ours = theirs = None
    for r in range(rounds):
        order = ("engine", "sentence-transformers") if r % 2 == 0 else ("sentence-transformers", "engine")
        for name in order:
            t0 = time.perf_counter()
            if name == "engine":
                ours = np.stack([o.outputs.embedding for o in llm.embed(sentences, use_tqdm=False)])
            else:
                theirs = st.encode(sentences, batch_size=32)  # type: ignore[attr-defined]
            rates[name].append(len(sentences) / (time.perf_counter() - t0))
        print(f"round {r + 1}: " + ", ".join(f"{n} {rates[n][-1]:.1f}/s" for n in order))
    med = {n: statistics.median(v) for n, v in rates.items()}
    cos = float(np.min(np.sum(ours * theirs, axis=1)))
    print(f"median: engine {med['engine']:.1f}/s, sentence-transformers "
          f"{med['sentence-transformers']:.1f}/s, engine / sentence-transformers "
          f"{med['engine'] / med['sentence-transformers']:.3f}; smallest cosine {cos:.6f}")
    return med


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sentences", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=24)
    args = p.parse_args(argv)
    from sentence_transformers import SentenceTransformer

    sentences = embed_bench.corpus(args.sentences)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_embedding_gemma(Path(tmp), text={**SHAPE, "num_hidden_layers": args.layers},
                                       dense_mult=4, std=None)
        st = SentenceTransformer(str(folder), device="cpu")
        llm = engine.LLM(str(folder), dtype="float32")
        tokens = sum(len(ids) for ids in st.tokenize(sentences)["input_ids"])
        print(f"{len(sentences)} sentences, {tokens} tokens with padding to each batch's longest "
              f"(sentence-transformers' batches); torch threads {torch.get_num_threads()}")
        compare(llm, st, sentences, args.rounds)
        llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
