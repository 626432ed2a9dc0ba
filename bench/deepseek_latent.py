"""DeepSeek-V3's latent cache (bench/moe_families.py's random model, bf16): prompt
processing and decoding at long contexts, and what a token costs the cache.

    .venv/bin/python bench/deepseek_latent.py [--contexts 1024,2048] [--rounds 2]

Per context length, alternated in rounds, best of each: prefill tok/s of one prompt with
prompt chunks attended as multi-head attention over their context expanded from the
latent (vLLM's MLA prefill, the engine's default) beside the absorbed form (every row
against the latent, ``DeepseekModel.prefill_expanded = False``); decode tok/s of one
stream after that prompt; transformers' ``generate`` decode on the same weights and
prompt. Then the KV cache's bytes a token against an expanded per-head cache's.
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
from engine.runner.kv_cache import bytes_per_block  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,2048")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(2)
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "deepseek_v3"
        write("deepseek_v3", folder)
        base = load_model(folder, dtype="float32")
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
        c = base.config
        print("| context | prefill tok/s, expanded (default) | prefill tok/s, absorbed | decode tok/s | "
              "transformers decode tok/s | decode / transformers |")
        print("|---|---|---|---|---|---|")
        for n in (int(x) for x in args.contexts.split(",")):
            eng = EngineDecode(base, torch.bfloat16, 1, n + args.new_tokens)
            ps = prompts(1, n, c.vocab_size)
            eng.run(ps, 2)  # warm-up
            best = {True: 0.0, False: 0.0, "decode": 0.0, "hf": 0.0}
            for _ in range(args.rounds):
                for expanded in (True, False):
                    eng.runner.model.prefill_expanded = expanded
                    t0 = time.perf_counter()
                    dec = eng.run(ps, args.new_tokens)
                    best[expanded] = max(best[expanded], n / (time.perf_counter() - t0 - dec))
                    if expanded:
                        best["decode"] = max(best["decode"], (args.new_tokens - 1) / dec)
                best["hf"] = max(best["hf"], (args.new_tokens - 1) / hf_decode_seconds(hf, ps, args.new_tokens))
            print(f"| {n} | {best[True]:.1f} | {best[False]:.1f} | {best['decode']:.1f} | {best['hf']:.1f} | "
                  f"{best['decode'] / best['hf']:.2f}x |", flush=True)
            del eng
        mla = c.mla
        latent = bytes_per_block(c, torch.bfloat16, 1)
        width = max(mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim)
        expanded = 2 * c.num_hidden_layers * c.num_attention_heads * width * 2
        print(f"KV cache a token (bf16, {c.num_hidden_layers} layers): latent {latent} bytes; "
              f"expanded per-head keys and values {expanded} bytes ({expanded / latent:.1f}x)")


if __name__ == "__main__":
    main()
