"""Quantized Hugging Face checkpoints (engine/models/hf_quant.py) against the dense one they
were made from: the size on disk, the load time, and how far greedy decoding follows the
dense model's tokens.

    .venv/bin/python bench/quantized_load.py [--model PATH] [--rounds N] [--tokens N]

The dense folder is the model's (default: SmolLM2-135M-Instruct's GGUF as the engine
converts it to a folder). Each layout of ``engine.models.testing_quant`` chosen with
``--layouts`` is written from it into a temporary folder (blocks and groups of 64, which
divide SmolLM2's 576- and 1536-wide matrices). Every round loads each folder once in a
fresh process (``load_model`` in fp32, then a pass over every weight so that a dense
folder's lazily mapped file is read too), in turns so
that drift on the machine falls on all; the medians are printed beside the dense one's.
Then each folder's model generates ``--tokens`` greedy tokens of one chat prompt with
``engine.LLM``; the table gives the length of the prefix it shares with the dense run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from engine import LLM, SamplingParams
from engine.models.loader import default_model_path, load_model
from engine.models.testing_quant import write_quantized

_LOAD = """
import sys, time
from engine.models.loader import load_model
t0 = time.perf_counter()
weights = load_model(sys.argv[1], dtype="float32").weights
sum(float(w.sum()) for w in weights.values())  # every byte read (a dense load maps lazily)
print(time.perf_counter() - t0)
"""


def load_seconds(folder: Path) -> float:
    done = subprocess.run([sys.executable, "-c", _LOAD, str(folder)], capture_output=True,
                          text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def size_mib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20


def tokens(folder: Path, count: int) -> list[int]:
    with LLM(str(folder), dtype="float32") as llm:
        (out,) = llm.chat([{"role": "user", "content": "Name three rivers of Europe."}],
                          SamplingParams(max_tokens=count, temperature=0, ignore_eos=True),
                          use_tqdm=False)
    return list(out.outputs[0].token_ids)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a dense folder or a .gguf (default: SmolLM2)")
    p.add_argument("--layouts", default="fp8-block,ct-channel,ct-int8-channel,ct-w4-group")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args(argv)
    dense = load_model(args.model or default_model_path(), quantization="none").folder
    with tempfile.TemporaryDirectory() as tmp:
        folders = {"dense": dense}
        for layout in args.layouts.split(","):
            folders[layout] = write_quantized(dense, Path(tmp) / layout, layout, block=(64, 64), group=64)
        times: dict[str, list[float]] = {name: [] for name in folders}
        for r in range(args.rounds):
            order = list(folders) if r % 2 == 0 else list(reversed(folders))
            for name in order:
                times[name].append(load_seconds(folders[name]))
        want = tokens(dense, args.tokens)
        print(f"{'checkpoint':18} {'MiB':>8} {'load s (median)':>16} {'/ dense':>8} {'tokens as dense':>16}")
        base = statistics.median(times["dense"])
        for name, folder in folders.items():
            got = want if name == "dense" else tokens(folder, args.tokens)
            same = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(want))
            median = statistics.median(times[name])
            print(f"{name:18} {size_mib(folder):8.1f} {median:16.3f} {median / base:8.2f} "
                  f"{same:>10} / {len(want)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
