"""``engine.LLM`` in an application that runs torch itself: decode at one stream when the
calling thread ran a matmul before opening the engine, beside one that did not, and the
caller's own torch work after the engine closed.

    .venv/bin/python bench/caller_torch.py [--model PATH] [--new-tokens 128] [--rounds 3]

Each scenario runs in a fresh interpreter (a thread's OpenMP team lasts as long as the
thread), alternated round by round; the best of ``--rounds`` each:

* ``clean``: ``engine.LLM`` opened by a thread that never ran torch;
* ``caller-torch``: the same after the caller's thread ran a matmul over the cores' torch
  threads (its team then sits idle in libgomp's pool while the model's runs);
* ``after-close``: the caller's own matmuls (``[64, 512] @ [512, 512]``, 2,000 of them),
  timed before an ``engine.LLM`` opened and after it closed: the ratio after / before.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

CHILD = r"""
import sys, time, torch, engine
torch.set_num_threads(2)
mode, model, new = sys.argv[1], sys.argv[2], int(sys.argv[3])
a = torch.randn(512, 512)

def matmuls():
    t0 = time.perf_counter()
    for _ in range(2000):
        a[:64] @ a
    return time.perf_counter() - t0

before = matmuls() if mode != "clean" else None
llm = engine.LLM(model, max_model_len=512)
sp = engine.SamplingParams(max_tokens=new, ignore_eos=True, temperature=0.0)
prompt = {"prompt_token_ids": [1, 2, 3, 4]}
llm.generate(prompt, sp, use_tqdm=False)
t0 = time.perf_counter()
llm.generate(prompt, sp, use_tqdm=False)
rate = new / (time.perf_counter() - t0)
llm.close()
after = matmuls() if mode == "after-close" else None
print(rate, (after / before) if after else 0.0)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF or folder (default: the shipped SmolLM2 Q4_1)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.model is None:
        from engine.models.loader import default_model_path

        args.model = str(default_model_path())
    best: dict[str, float] = {}
    slow: list[float] = []
    for _ in range(args.rounds):
        for mode in ("clean", "caller-torch", "after-close"):
            out = subprocess.run([sys.executable, "-c", CHILD, mode, args.model, str(args.new_tokens)],
                                 capture_output=True, text=True, check=True).stdout.split()
            rate, ratio = float(out[-2]), float(out[-1])
            best[mode] = max(best.get(mode, 0.0), rate)
            if mode == "after-close":
                slow.append(ratio)
        time.sleep(0.1)
    print(f"decode tok/s at one stream, {args.new_tokens} tokens, best of {args.rounds}:")
    for mode in ("clean", "caller-torch", "after-close"):
        print(f"  {mode:13s} {best[mode]:7.1f}  ({best[mode] / best['clean']:.2f}x of clean)")
    print(f"the caller's matmuls after the engine closed, time / before: {min(slow):.2f}-{max(slow):.2f}")


if __name__ == "__main__":
    main()
