"""Greedy continuations of the quantized engine beside the dequantized one, as markdown.

    .venv/bin/python bench/greedy_compare.py [--model FILE.gguf] [--tokens 64] [--dtype float32]

Loads the GGUF twice (its blocks kept, and dequantized with ``quantization="none"``),
greedy-decodes the same prompts through the model runner, and prints each prompt's two
continuations side by side with the index of the first token where they part.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from engine.models.loader import default_model_path, load_model
from engine.models.tokenizer import Tokenizer
from engine.ops import get_ops
from engine.runner.model_runner import ModelRunner

# The scheduler-free greedy driver lives with the tests that use it most.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from greedy_driver import run_greedy  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nGive me three tips for staying focused while studying.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
]
BLOCK = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = default_model_path() if args.model is None else args.model
    outputs = {}
    tok = None
    for quantization in ("gguf", "none"):
        loaded = load_model(path, dtype=args.dtype, quantization=quantization)
        tok = tok or Tokenizer.from_folder(loaded.folder)
        prompts = [tok.encode(p) for p in PROMPTS]
        need = sum(-(-(len(p) + args.tokens) // BLOCK) for p in prompts)
        runner = ModelRunner(loaded, device="cpu", ops=get_ops("auto"), num_blocks=need, block_size=BLOCK,
                             max_num_batched_tokens=4096, max_num_seqs=len(prompts))
        runs = run_greedy(runner, prompts, args.tokens, block_size=BLOCK)
        outputs[quantization] = [[s.token_id for s in run] for run in runs]
    print(f"| prompt | GGUF blocks kept ({args.dtype} activations) | dequantized {args.dtype} | first difference |")
    print("|---|---|---|---|")
    for prompt, q, d in zip(PROMPTS, outputs["gguf"], outputs["none"], strict=True):
        first = next((i for i, (a, b) in enumerate(zip(q, d, strict=True)) if a != b), None)
        cells = [prompt, tok.decode(q), tok.decode(d)]
        cells = [c.replace("|", "\\|").replace("\n", "⏎") for c in cells]
        print(f"| {cells[0]} | {cells[1]} | {cells[2]} | {'none' if first is None else f'token {first}'} |")


if __name__ == "__main__":
    main()
