"""Qwen3.5 from a GGUF: the engine (blocks kept) beside llama.cpp on the same file.

    .venv/bin/python bench/qwen35_gguf.py --llama-cpp /work/llama [--outtype q8_0]
        [--new-tokens 64] [--prompt-len 512] [--rounds 3] [--dtypes float32,bfloat16]

Writes a random-weight Qwen3.5 with transformers (``--shape small``:
``moe_families.SHAPES["qwen3_5"]``, 110M, 8 layers; ``--shape 0.8b``: the layer stack of
Qwen3.5-0.8B, :data:`SHAPE_0_8B`, 24 layers, 0.5B without the embedding; both three Gated
DeltaNet layers to each gated attention layer and the tiny 384-token vocabulary, so the
layers and not the head are what is timed), converts it with llama.cpp's
own ``convert_hf_to_gguf.py`` (the source tree ``../shared/anchors/build_llama_cpp.sh``
leaves under ``DIR/src``; ``--outtype`` as that script takes it), then times on that one
file, alternating the two in each round:

* decode: the engine's runner at batch 1 after a 64-token prompt (``bench/decode``'s
  ``EngineDecode``; activations in each of ``--dtypes``), against ``llama-bench -p 0 -n
  N`` (tg);
* prompt processing: the engine's one-step prefill of ``--prompt-len`` tokens, against
  ``llama-bench -p N -n 0`` (pp).

Both on 2 threads (``build_llama_cpp.sh``'s fair settings). The best of ``--rounds`` for each.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import EngineDecode, prompts  # noqa: E402
from moe_families import SHAPES, write  # noqa: E402

from engine.models.loader import load_model  # noqa: E402

# Qwen3.5-0.8B's layers: hidden 1024, 24 layers (every fourth attends), DeltaNet 16 key
# and 16 value heads of 128, attention 8 heads of 256 and 2 KV heads, MLP 3584 wide.
SHAPE_0_8B = dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=3584, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                  linear_key_head_dim=128, linear_value_head_dim=128, layer_types=None, full_attention_interval=4)

# llama.cpp's converter names each BPE pre-tokenizer by the hash of what it makes of a test
# text; the tiny tokenizer's is not one it knows, so its name is given (the weights and the
# layout are the converter's own).
DRIVER = """
import runpy, sys
root = sys.argv.pop(1)
sys.path[:0] = [root + "/gguf-py", root]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv[0] = root + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(llama_cpp: Path, folder: Path, out: Path, outtype: str) -> None:
    roots = sorted(llama_cpp.glob("src/llama_cpp_python-*/vendor/llama.cpp"))
    if not roots:
        raise SystemExit(f"no llama.cpp source under {llama_cpp}/src (run ../shared/anchors/build_llama_cpp.sh)")
    subprocess.run([sys.executable, "-c", DRIVER, str(roots[-1]), str(folder), "--outfile", str(out),
                    "--outtype", outtype, "--no-mtp"], check=True, capture_output=True)


def llama_bench(llama_cpp: Path, model: Path, prompt: int, gen: int) -> float:
    out = subprocess.run(
        [str(llama_cpp / "bin" / "llama-bench"), "-m", str(model), "-t", "2", "-p", str(prompt), "-n", str(gen),
         "-r", "3", "-o", "json"], capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, required=True)
    ap.add_argument("--outtype", default="q8_0")
    ap.add_argument("--shape", default="small", choices=("small", "0.8b"))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        folder, path = Path(tmp) / "qwen3_5", Path(tmp) / f"qwen3_5-{args.outtype}.gguf"
        if args.shape == "0.8b":
            SHAPES["qwen3_5"] = SHAPES["qwen3_5"] | SHAPE_0_8B
        write("qwen3_5", folder)
        convert(args.llama_cpp, folder, path, args.outtype)
        loaded = load_model(path, dtype="float32")
        print(f"{path.name}: {path.stat().st_size / 2**20:.1f} MiB, quantization {loaded.quantization}")
        best = time_beside_llama(args.llama_cpp, path, loaded, args.dtypes.split(","), args.prompt_len,
                                 args.new_tokens, args.rounds)
        dtypes = args.dtypes.split(",")
        print("| | " + " | ".join(f"engine ({d})" for d in dtypes) + " | llama.cpp | " +
              " | ".join(f"engine ({d}) / llama.cpp" for d in dtypes) + " |")
        print("|---" * (2 + 2 * len(dtypes)) + "|")
        labels = {"decode": f"decode tok/s, batch 1 (tg{args.new_tokens})", "prefill": f"prompt tok/s (pp{args.prompt_len})"}
        for kind, label in labels.items():
            print(f"| {label} | " + table_cells(best, kind, dtypes))


def time_beside_llama(llama_cpp: Path, path: Path, loaded, dtypes: list[str], n: int, new: int,
                      rounds: int) -> dict[str, float]:
    """The best of ``rounds`` alternated rounds: the engine's runner on ``loaded`` (in each
    of ``dtypes``) decoding ``new`` tokens after 64 and prefilling ``n`` in one step, and
    ``llama-bench`` tg / pp on ``path``; tokens/s under "decode D", "prefill D", "decode
    llama.cpp" and "prefill llama.cpp"."""
    engines = {d: EngineDecode(loaded, getattr(torch, d), 1, n + new) for d in dtypes}
    return time_engines(llama_cpp, path, engines, loaded.config.vocab_size, n, new, rounds)


def time_engines(llama_cpp: Path, path: Path, engines: dict, vocab: int, n: int, new: int,
                 rounds: int) -> dict[str, float]:
    """:func:`time_beside_llama` over ``engines`` (label -> ``EngineDecode``): tokens/s under
    "decode LABEL", "prefill LABEL" and llama.cpp's two."""
    best: dict[str, float] = {}

    def keep(key: str, value: float) -> None:
        best[key] = max(best.get(key, 0.0), value)

    for _ in range(rounds):
        for label, eng in engines.items():
            short = prompts(1, 64, vocab)
            eng.run(short, 4)  # warm-up
            keep(f"decode {label}", (new - 1) / eng.run(short, new))
            long = prompts(1, n, vocab)
            t0 = time.perf_counter()
            decode = eng.run(long, 2)
            keep(f"prefill {label}", n / (time.perf_counter() - t0 - decode))
        keep("decode llama.cpp", llama_bench(llama_cpp, path, 0, new))
        keep("prefill llama.cpp", llama_bench(llama_cpp, path, n, 0))
    return best


def table_cells(best: dict[str, float], kind: str, dtypes: list[str]) -> str:
    """A table row's cells for ``kind`` ("decode" or "prefill"): the engine's figure in each
    dtype, llama.cpp's, then each ratio."""
    ref = best[f"{kind} llama.cpp"]
    ours = [best[f"{kind} {d}"] for d in dtypes]
    return (" | ".join(f"{v:.1f}" for v in ours) + f" | {ref:.1f} | "
            + " | ".join(f"**{v / ref:.2f}x**" for v in ours) + " |")


if __name__ == "__main__":
    main()
