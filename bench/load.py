"""Model load times: cold GGUF conversion, cached load, transformers' own GGUF load, and
a model named by Hub id from a hot Hugging Face cache against the same plain folder.

    .venv/bin/python bench/load.py [--model PATH] [--skip-transformers] [--rounds N]

Every library is imported before any timing starts, so each figure is the load itself.
"Cached, fresh process" is what a server start pays: a new interpreter loading an
already-converted model (its import time is printed separately). The cold load uses an
empty temporary cache directory, never the user's cache.

Hub cache (hot) vs plain folder: the converted folder is published on the test suite's
fake Hub (tests/hub_server.py, on 127.0.0.1), fetched once into a temporary Hugging Face
cache, then each round starts two fresh processes, alternated so that drift on the
machine falls on both: one opens an engine on the id, resolved from the cache
(HF_HUB_OFFLINE=1, as a start with the model cached), the other on the folder by its
path; each times open_engine until the engine is ready. The medians and their ratio.
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


# One fresh process: open an engine on ``sys.argv[1]`` (a Hub id resolved against the cache
# ``sys.argv[2]``, or a path: nothing to resolve) until it is ready; prints the seconds it
# took (imports excluded). A small KV pool: the pool is the same for both, and not measured.
_FRESH_START = """
import sys, time
import trio
import engine
async def main():
    t0 = time.perf_counter()
    async with engine.open_engine(sys.argv[1], download_dir=sys.argv[2],
                                  kv_cache_memory=16 * 2**20, max_num_seqs=4):
        print(f"{time.perf_counter() - t0:.4f}")
trio.run(main)
"""


def _hub_vs_folder(folder: Path, rounds: int) -> None:
    import os
    import statistics

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from hub_server import FakeHub

    from engine.config import EngineConfig
    from engine.process.names import resolve_config

    with tempfile.TemporaryDirectory(prefix="engine-hub-bench-") as tmp, FakeHub() as hub:
        hub.add_folder("bench/model", folder)
        env = dict(os.environ, HF_HUB_OFFLINE="1", ENGINE_CACHE_DIR=str(Path(tmp) / "engine"))
        os.environ["ENGINE_CACHE_DIR"] = env["ENGINE_CACHE_DIR"]  # where the checks are kept
        _timed("fetch into the Hub cache (cold)", lambda: resolve_config(
            EngineConfig(model="bench/model", download_dir=str(Path(tmp) / "hub")),
            endpoint=hub.url))
        times: dict[str, list[float]] = {"hub": [], "folder": []}
        for _ in range(rounds):
            for kind, name in (("hub", "bench/model"), ("folder", str(folder))):
                out = subprocess.run([sys.executable, "-c", _FRESH_START, name, str(Path(tmp) / "hub")],
                                     check=True, capture_output=True, text=True, env=env)
                times[kind].append(float(out.stdout.split()[-1]))
    hub_s, folder_s = statistics.median(times["hub"]), statistics.median(times["folder"])
    print(f"{'start from the Hub cache (hot), median':<40} {hub_s:8.3f} s   ({rounds} rounds)")
    print(f"{'start from the plain folder, median':<40} {folder_s:8.3f} s   "
          f"(hub / folder {hub_s / folder_s:.3f})")


def _timed(label: str, fn) -> object:
    start = time.perf_counter()
    result = fn()
    print(f"{label:<40} {time.perf_counter() - start:8.2f} s", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2 Q4_1)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--rounds", type=int, default=7,
                        help="alternated fresh-process starts, Hub cache vs folder (default 7)")
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
        # The converted folder is a Hugging Face folder (safetensors, config, tokenizer).
        _hub_vs_folder(loaded.folder, args.rounds)
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
