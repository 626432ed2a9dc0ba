"""The engine's offline ``LLM.embed`` against sentence-transformers' ``encode`` (batch 32)
on all-MiniLM-L6-v2 (the embeddings server's model in bench/embed.py and bench/served.py)
and the same sentences, in one process.

    python bench/embed_offline.py [--sentences 512] [--rounds 5]

What the served embedding rows of issue 42 stand on: the encoder's own speed, without
HTTP. Each round times both, alternating which goes first; prints sentences/s, the ratio
of the medians and the smallest cosine between the two sides' vectors. fp32, the host's
torch threads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import embed as embed_bench  # noqa: E402
from embedding_gemma import compare  # noqa: E402

import engine  # noqa: E402
from engine.models.loader import default_embedding_model_path  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sentences", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    from sentence_transformers import SentenceTransformer

    sentences = embed_bench.corpus(args.sentences)
    folder = str(default_embedding_model_path())
    st = SentenceTransformer(folder, device="cpu")
    llm = engine.LLM(embed_bench.MODEL, dtype="float32")
    print(f"{len(sentences)} sentences; torch threads {torch.get_num_threads()}")
    compare(llm, st, sentences, args.rounds, warm=32)
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
