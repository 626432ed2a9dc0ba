"""GGUF's Q5_0, Q5_1, Q3_K, Q2_K, IQ4_NL and IQ4_XS kept in their blocks: against the same
file read dense (what the loader did with these formats before session 35) and beside
llama.cpp.

    .venv/bin/python bench/gguf_formats.py --llama-cpp /work/llama-noamx
        [--types Q5_0,Q5_1,Q3_K_S,Q2_K,Q3_K_M,Q2_K-mix] [--rounds 2] [--dtypes float32,bfloat16]
        [--new-tokens 64] [--prompt-len 512]

A random-weight dense Llama (``moe_families.SHAPES["llama"]``: hidden 1,024, 8 layers, 16/4
heads of 64, MLP 2,816, the tiny 384-token vocabulary, so the layers and not the head are
timed) is written by transformers, converted to F16 by llama.cpp's own
``convert_hf_to_gguf.py`` and quantized by its ``llama-quantize`` (built beside
``llama-bench`` in ``DIR/bin``; ``../shared/anchors/build_llama_cpp.sh`` builds the other two,
``cmake --build build --target llama-quantize`` in the same tree this one). Each type is
quantized ``--pure`` (every matrix in that type: ``Q3_K_S`` pure is all Q3_K) unless it
ends in ``-mix``, which is llama.cpp's own mixture of that name (``Q2_K-mix``: Q2_K with
Q3_K/Q4_K/Q6_K where llama.cpp puts them; ``Q3_K_M`` always so).

Then, alternated in each round, the best of ``--rounds``: the engine's runner on the
file with its blocks kept and with ``quantization="none"`` (dequantized at load), each in
``--dtypes``, at batch 1 after a 64-token prompt and on a one-step prefill of
``--prompt-len`` tokens, and ``llama-bench`` tg / pp on the same file (2 threads each,
``build_llama_cpp.sh``'s fair settings). Also the weights' resident bytes both ways.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import EngineDecode  # noqa: E402
from moe_families import write  # noqa: E402
from qwen35_gguf import time_engines  # noqa: E402
from recurrent_gguf import convert  # noqa: E402

from engine.models.layers.linear import weight_bytes  # noqa: E402
from engine.models.loader import load_model  # noqa: E402


def quantize(llama_cpp: Path, f16: Path, out: Path, kind: str) -> None:
    tool = llama_cpp / "bin" / "llama-quantize"
    if not tool.exists():
        raise SystemExit(f"{tool} is missing: cmake --build build --target llama-quantize in the llama.cpp tree")
    ftype, pure = (kind[: -len("-mix")], []) if kind.endswith("-mix") else (kind, ["--pure"])
    if ftype == "Q3_K_M":
        pure = []
    done = subprocess.run([str(tool), *pure, str(f16), str(out), ftype, "2"], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"llama-quantize {kind} failed:\n{done.stderr[-2000:]}")


def resident_bytes(path: Path, dtype: str, quantization: str) -> int:
    loaded = load_model(path, dtype=dtype, quantization=quantization)
    eng = EngineDecode(loaded, getattr(torch, dtype), 1, 128)
    return weight_bytes(eng.runner.model)


def time_file(llama_cpp: Path, path: Path, dtypes: list[str], n: int, new: int, rounds: int) -> dict[str, float]:
    """The best of ``rounds`` alternated rounds (tokens/s): "decode|prefill kept|dense D" and
    "decode|prefill llama.cpp"."""
    kept = load_model(path, dtype="float32")
    dense = load_model(path, dtype="float32", quantization="none")
    assert kept.quantization == "gguf" and dense.quantization != "gguf"
    engines = {f"{way} {d}": EngineDecode(loaded, getattr(torch, d), 1, n + new)
               for way, loaded in (("kept", kept), ("dense", dense)) for d in dtypes}
    return time_engines(llama_cpp, path, engines, kept.config.vocab_size, n, new, rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, required=True)
    ap.add_argument("--types", default="Q5_0,Q5_1,Q3_K_S,Q2_K,Q3_K_M,Q2_K-mix")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(2)
    dtypes = args.dtypes.split(",")
    rows, sizes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        folder, f16 = Path(tmp) / "llama", Path(tmp) / "llama-f16.gguf"
        write("llama", folder)
        convert(args.llama_cpp, folder, f16, "f16")
        for kind in args.types.split(","):
            path = Path(tmp) / f"llama-{kind}.gguf"
            quantize(args.llama_cpp, f16, path, kind)
            kept_b = resident_bytes(path, "bfloat16", "auto")
            dense_b = resident_bytes(path, "bfloat16", "none")
            sizes.append(f"| {kind} | {path.stat().st_size / 2**20:.1f} | {kept_b / 2**20:.1f} | {dense_b / 2**20:.1f} |")
            print(sizes[-1], flush=True)
            best = time_file(args.llama_cpp, path, dtypes, args.prompt_len, args.new_tokens, args.rounds)
            for kind_, label in (("decode", f"tg{args.new_tokens}"), ("prefill", f"pp{args.prompt_len}")):
                ref = best[f"{kind_} llama.cpp"]
                for d in dtypes:
                    k, dn = best[f"{kind_} kept {d}"], best[f"{kind_} dense {d}"]
                    rows.append(f"| {kind} | {label} | {d} | {dn:.1f} | {k:.1f} | {ref:.1f} | **{k / dn:.2f}x** | "
                                f"**{k / ref:.2f}x** |")
                    print(rows[-1], flush=True)
    print("\n| type | file MiB | weights kept MiB | weights dense (bf16) MiB |\n|---|---|---|---|")
    print("\n".join(sizes))
    print("\n| type | run | activations | dense tok/s | kept tok/s | llama.cpp tok/s | kept / dense | "
          "kept / llama.cpp |\n|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
