"""Model load times: cold GGUF conversion, cached load, and transformers' own GGUF load.

    .venv/bin/python bench/load.py [--model PATH] [--skip-transformers]

Every library is imported before any timing starts, so each figure is the load itself.
"Cached, fresh process" is what a server start pays: a new interpreter loading an
already-converted model (its import time is printed separately). The cold load uses an
empty temporary cache directory, never the user's cache.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch  # noqa: F401 -- imported up front so no timing below includes it
import transformers  # noqa: F401

from engine.models import cache, gguf_convert  # noqa: F401
from engine.models.loader import load_model, resolve_model

_FRESH_PROCESS = """
import sys, time
t0 = time.perf_counter()
from engine.models.loader import load_model
t1 = time.perf_counter()
load_model(sys.argv[1], cache_dir=sys.argv[2])
t2 = time.perf_counter()
print(f"{t1 - t0:.3f} {t2 - t1:.3f}")
"""


def _timed(label: str, fn) -> object:
    start = time.perf_counter()
    result = fn()
    print(f"{label:<40} {time.perf_counter() - start:8.2f} s", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2 Q4_1)")
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    path = resolve_model(args.model)
    if path.suffix != ".gguf":
        parser.error("this benchmark measures GGUF loading; give a .gguf file")
    # The tokenizer conversion imports this lazily; import it now so cold load excludes it.
    import transformers.integrations.gguf.gguf_tokenizer_mapping  # noqa: F401

    print(f"model: {path} ({path.stat().st_size / 1e6:.1f} MB)")
    print(f"torch threads: {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory(prefix="engine-load-bench-") as tmp:
        cache_dir = Path(tmp)
        _timed("sha256 of the file", lambda: cache.file_digest(path))
        loaded = _timed(
            "cold load (convert + cache + load)", lambda: load_model(path, cache_dir=cache_dir)
        )
        _timed("cached load (same process)", lambda: load_model(path, cache_dir=cache_dir))
        out = subprocess.run(
            [sys.executable, "-c", _FRESH_PROCESS, str(path), str(cache_dir)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        print(
            f"{'cached load (fresh process)':<40} {float(out[1]):8.2f} s   (+ {float(out[0]):.2f} s import)"
        )
        size = sum(f.stat().st_size for f in loaded.folder.iterdir()) / 1e6
        print(f"cache entry: {loaded.folder.name} ({size:.0f} MB)")
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        _timed(
            "transformers from_pretrained(gguf_file=)",
            lambda: AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=torch.float32
            ),
        )


if __name__ == "__main__":
    main()
