"""What compiling a grammar in a worker process costs, against compiling in-process.

    python bench/grammar_compile.py [--model PATH] [--repeat 5]

For each schema below: the in-process compile (GrammarBackend.compile on a fresh cache),
the same through CompilePool (a warm worker: the compile, the serialized grammar crossing
the pipe, and reading it back), and a cached lookup through the pool. Also the time to
start a worker (Python, xgrammar, the tokenizer's tables). Without --model it uses the
tiny test model's tokenizer (384 tokens); pass a real model folder for real figures.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import trio

from engine.models.tokenizer import Tokenizer
from engine.structured import GrammarBackend, StructuredOutputs
from engine.structured.pool import CompilePool

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
        "required": ["name", "age"]},
    "invoice": {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
        "lines": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
            "price": {"type": "number", "minimum": 0}}, "required": ["sku", "qty", "price"]}},
        "currency": {"enum": ["EUR", "USD", "GBP"]}}, "required": ["id", "lines", "currency"]},
}


def _median_ms(values: list[float]) -> str:
    return f"{1000 * statistics.median(values):8.1f} ms"


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    folder = args.model
    if folder is None:
        from engine.models.testing import write_tiny_model

        folder = write_tiny_model(Path(tempfile.mkdtemp()), "llama")
    tok = Tokenizer.from_folder(folder)
    import json

    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    stops = tuple(sorted(tok.eos_token_ids))
    print(f"tokenizer: {folder} (vocab {vocab})")
    for name, schema in SCHEMAS.items():
        spec = StructuredOutputs(json=schema)
        local, pooled, cached, starts = [], [], [], []
        for i in range(args.repeat):
            backend = GrammarBackend(tok, vocab_size=vocab, stop_token_ids=stops)
            t0 = time.perf_counter()
            backend.compile(spec)
            local.append(time.perf_counter() - t0)
            backend = GrammarBackend(tok, vocab_size=vocab, stop_token_ids=stops)
            pool = CompilePool(backend, workers=1, timeout=60, max_bytes=2**30)
            # A first compile of another schema starts the worker and its lazy imports.
            warm = StructuredOutputs(json={"type": "integer", "minimum": -1 - i})
            t0 = time.perf_counter()
            await pool.compile(warm)  # starts the worker
            starts.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await pool.compile(spec)
            pooled.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await pool.compile(spec)
            cached.append(time.perf_counter() - t0)
            await pool.aclose()
        print(f"{name:8s} in-process {_median_ms(local)}   worker {_median_ms(pooled)}   "
              f"cached {_median_ms(cached)}   worker start {_median_ms(starts)}")


if __name__ == "__main__":
    trio.run(main)
