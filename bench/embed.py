"""Embedding throughput: the server's /v1/embeddings against sentence-transformers offline.

    python bench/embed.py --concurrencies 1,32 --num-sentences 512 [--per-request 1,16]

Starts ``python -m engine serve --model all-MiniLM-L6-v2`` on a free port (or uses
``--base-url``), sends ``--num-sentences`` sentences (the sentences of
tests/data/perplexity_en.txt, repeated) one per request from a closed loop of N clients
for each N in ``--concurrencies``, then stops the server and times
``SentenceTransformer.encode`` of the same sentences at ``--st-batch-size`` (32) in this
process, with the same model folder. Prints sentences/s for each row and each row's ratio
to the offline figure, and checks the server's vectors against the offline ones (the
smallest cosine). The server and the offline encoder run one after the other, never at
once, so they do not share the cores.
"""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.cli.loadclient import JSONExchange, LoadClient  # noqa: E402

CORPUS = REPO / "tests" / "data" / "perplexity_en.txt"
MODEL = "all-MiniLM-L6-v2"


def corpus(count: int) -> list[str]:
    text = CORPUS.read_text(encoding="utf-8")
    base = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if len(s.strip()) > 3]
    return [base[i % len(base)] for i in range(count)]


class _Embed(JSONExchange):
    def __init__(self, start: int, batch: list[str], headers: dict[str, str]) -> None:
        super().__init__("POST", "/v1/embeddings", {
            "model": MODEL, "input": batch[0] if len(batch) == 1 else batch,
            "encoding_format": "float"}, headers)
        self.start = start


def run_load(base_url: str, sentences: list[str], concurrency: int,
             per_request: int = 1, new_connection: bool = False) -> tuple[float, np.ndarray]:
    """Seconds to embed every sentence, ``per_request`` sentences a request (a string, or a
    list of strings), from ``concurrency`` clients; with ``new_connection`` each request
    asks the server to close its connection (``Connection: close``), so the next one opens
    a new one, as a script calling ``requests.post`` in a loop does."""
    headers = {"Connection": "close"} if new_connection else {}
    exchanges = [_Embed(start, sentences[start:start + per_request], headers)
                 for start in range(0, len(sentences), per_request)]
    with LoadClient(base_url, timeout=600.0) as http:
        seconds = http.run(exchanges, max_concurrency=concurrency)
    vectors: list[list[float]] = [[] for _ in sentences]
    for e in exchanges:
        if e.error or e.status != 200:
            raise SystemExit(f"/v1/embeddings: {e.error or f'HTTP {e.status}: {e.result}'}")
        for item in e.result["data"]:
            vectors[e.start + item["index"]] = item["embedding"]
    return seconds, np.array(vectors)


def offline(sentences: list[str], batch_size: int) -> tuple[float, np.ndarray]:
    from sentence_transformers import SentenceTransformer

    from engine.models.loader import default_embedding_model_path

    model = SentenceTransformer(str(default_embedding_model_path()), device="cpu")
    model.encode(sentences[:batch_size], batch_size=batch_size)  # warm-up
    start = time.perf_counter()
    out = model.encode(sentences, batch_size=batch_size, convert_to_numpy=True)
    return time.perf_counter() - start, out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become ready")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="a running server (default: start one)")
    parser.add_argument("--concurrencies", default="1,32")
    parser.add_argument("--num-sentences", type=int, default=512)
    parser.add_argument("--st-batch-size", type=int, default=32)
    parser.add_argument("--per-request", default="1",
                        help="sentences per request, comma-separated runs (1: one string; "
                             "more: a list of strings, as LangChain and LlamaIndex send)")
    parser.add_argument("--server-args", default="--dtype float32",
                        help="extra flags for the server it starts")
    args = parser.parse_args(argv)
    sentences = corpus(args.num_sentences)
    rows: list[tuple[str, float, np.ndarray]] = []
    proc = None
    base_url = args.base_url
    if base_url is None:
        port = _free_port()
        base_url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine", "serve", "--model", MODEL, "--port", str(port),
             *args.server_args.split()], cwd=REPO, stdout=subprocess.DEVNULL)
    try:
        if proc is not None:
            _wait_ready(base_url, proc)
        run_load(base_url, sentences[:32], 4)  # warm-up
        for per in (int(p) for p in args.per_request.split(",")):
            for n in (int(c) for c in args.concurrencies.split(",")):
                seconds, vectors = run_load(base_url, sentences, n, per)
                label = f"server, concurrency {n}" + (f", {per} a request" if per > 1 else "")
                rows.append((label, seconds, vectors))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    seconds, reference = offline(sentences, args.st_batch_size)
    base_rate = len(sentences) / seconds
    print(f"{len(sentences)} sentences, {MODEL}")
    print(f"{'':40} {'sentences/s':>12} {'vs offline':>11} {'min cosine':>11}")
    print(f"{f'sentence-transformers, batch {args.st_batch_size}':40} {base_rate:12.1f} {1.0:10.2f}x {'':>11}")
    for name, secs, vectors in rows:
        a, b = vectors.astype(np.float64), reference.astype(np.float64)
        cos = ((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min()
        rate = len(sentences) / secs
        print(f"{name:40} {rate:12.1f} {rate / base_rate:10.2f}x {cos:11.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
