"""The hybrid (Mamba-2) families at long contexts: prompt processing and decoding of one
stream on the engine's model runner beside transformers, on bench/moe_families.py's
random models (``granite4h``, ``nemotron_h``, ``qwen3_5``; also ``falcon_h1``, ``mamba2``,
``mamba``), bf16.

    .venv/bin/python bench/hybrid.py [--families granite4h,nemotron_h,qwen3_5] [--contexts 512,2048] [--rounds 2]

Per family and context, alternated in rounds, best of each: the engine's prefill tok/s
(the whole prompt in one step, its Mamba layers scanned in blocks of ``SCAN_BLOCK``
tokens, its DeltaNet layers in blocks of ``CHUNK``) beside transformers' forward over the
same prompt (its torch paths for the same layers: the chunked scan and the chunked delta
rule), and decode tok/s of one stream after
the prompt beside transformers' ``generate``. Then what a request's recurrent states cost
against the KV cache the same model would keep were its Mamba layers attention layers.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import EngineDecode, hf_decode_seconds, prompts  # noqa: E402
from moe_families import write  # noqa: E402

from engine.models.loader import load_model  # noqa: E402
from engine.runner.kv_cache import bytes_per_block, state_bytes  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="granite4h,nemotron_h,qwen3_5")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(2)
    from transformers import AutoModelForCausalLM

    print("| family | context | prefill tok/s | transformers prefill tok/s | prefill / transformers | "
          "decode tok/s | transformers decode tok/s | decode / transformers |")
    print("|---|---|---|---|---|---|---|---|")
    footprint = []
    for family in args.families.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / family
            write(family, folder)
            base = load_model(folder, dtype="float32")
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
            hf.generation_config.eos_token_id = None
            hf.generation_config.pad_token_id = 0
            c = base.config
            for n in (int(x) for x in args.contexts.split(",")):
                eng = EngineDecode(base, torch.bfloat16, 1, n + args.new_tokens)
                ps = prompts(1, n, c.vocab_size)
                eng.run(ps, 2)  # warm-up
                best = {"prefill": 0.0, "hf_prefill": 0.0, "decode": 0.0, "hf": 0.0}
                for _ in range(args.rounds):
                    t0 = time.perf_counter()
                    decode = eng.run(ps, args.new_tokens)
                    prefill = time.perf_counter() - t0 - decode
                    best["prefill"] = max(best["prefill"], n / prefill)
                    best["decode"] = max(best["decode"], (args.new_tokens - 1) / decode)
                    with torch.inference_mode():
                        t0 = time.perf_counter()
                        hf(torch.tensor(ps))
                        best["hf_prefill"] = max(best["hf_prefill"], n / (time.perf_counter() - t0))
                    best["hf"] = max(best["hf"], (args.new_tokens - 1) / hf_decode_seconds(hf, ps, args.new_tokens))
                # generate(n) - generate(1) can come out at or below zero where the prompt's
                # pass dwarfs the decode steps (transformers' token loop over a Mamba-1 scan).
                theirs = (f"{best['hf']:.1f} | {best['decode'] / best['hf']:.2f}x" if best["hf"] > 0
                          else "lost in its prefill's noise | -")
                print(f"| {family} | {n} | {best['prefill']:.0f} | {best['hf_prefill']:.0f} | "
                      f"{best['prefill'] / best['hf_prefill']:.2f}x | {best['decode']:.1f} | {theirs} |", flush=True)
                del eng
            m = c.recurrent
            per_token = bytes_per_block(c, torch.bfloat16, 1)  # the attention layers' K and V
            layers = len(m.layers)
            attn = c.num_hidden_layers - layers - len(m.mlp_layers)
            footprint.append((family, state_bytes(c, torch.bfloat16, 1), per_token, per_token // max(attn, 1) * layers))
            del hf, base
    print()
    print("| family | recurrent states a request | KV a token (attention layers) | KV a token the Mamba layers "
          "would add as attention | context where the states equal that KV |")
    print("|---|---|---|---|---|")
    for family, states, kv, would in footprint:
        where = f"{states // would} tokens" if would else "- (no attention layer)"
        print(f"| {family} | {states / 2**20:.2f} MiB | {kv} bytes | {would} bytes | {where} |")


if __name__ == "__main__":
    main()
