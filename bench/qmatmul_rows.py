"""The quantized matmul at prompt sizes against torch's matmul of the dequantized weight.

    .venv/bin/python bench/qmatmul_rows.py [--rows 512] [--formats Q4_K,Q8_0,Q3_K]
        [--path amx-bf16] [--rounds 2]

For each format and shape (K x N: 1,024 x 2,816, 2,816 x 1,024 and 1,024 x 1,536, an MLP's
and an attention projection's), random GGUF blocks (tests/test_quant.py's
``random_blocks``) multiply ``--rows`` bf16 activations through ``qmatmul`` on
``--path`` (the CPU kernels' path a prompt takes: AMX-BF16 on a CPU with it) and through
``Linear`` over the dequantized bf16 weight (oneDNN, its own AMX path on such a CPU), on
2 threads; milliseconds a product, each side's best of 10 calls per round, alternated.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
from test_quant import random_blocks  # noqa: E402

from engine.models.layers.linear import Linear  # noqa: E402
from engine.ops.cpu import qmatmul as cq  # noqa: E402
from engine.ops.quant import FORMATS, QuantizedWeight  # noqa: E402


def best_ms(f, calls: int = 10) -> float:
    for _ in range(3):
        f()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--formats", default="Q4_K,Q8_0,Q3_K")
    ap.add_argument("--path", default="amx-bf16")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if args.path not in cq.paths():
        raise SystemExit(f"this CPU has no {args.path} path: {cq.paths()}")
    torch.set_num_threads(2)
    print("| format | K x N | qmatmul ms | dense bf16 ms | dense ms / qmatmul ms |\n|---|---|---|---|---|")
    for name in args.formats.split(","):
        for k, n in ((1024, 2816), (2816, 1024), (1024, 1536)):
            w = QuantizedWeight.from_blocks(random_blocks(name, n, k), FORMATS[name], k)
            x = torch.randn(args.rows, k).bfloat16()
            dense = Linear(w.dequantize().bfloat16())
            q = d = float("inf")
            for _ in range(args.rounds):
                q = min(q, best_ms(lambda: cq.qmatmul(x, w, path=args.path)))  # noqa: B023
                d = min(d, best_ms(lambda: dense(x)))  # noqa: B023
            print(f"| {name} | {k} x {n} | {q:.2f} | {d:.2f} | {d / q:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
