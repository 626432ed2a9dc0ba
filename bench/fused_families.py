"""The fused CPU decode step on each decoder family, against the unfused layers.

    .venv/bin/python bench/fused_families.py [--archs gemma2,gemma3,qwen3_moe,mixtral,qwen2_moe,llama,
                                                       gemma,phi4,smollm3,granite,olmo2,olmo3]
                                             [--dtype bfloat16] [--batches 1,4] [--new-tokens 64]

SmolLM2 (``bench/decode.py``) is the only real model on this machine, and it is a Llama. For
the other families this writes a random-weight model of each architecture at a small real
size (``SIZE``: hidden 1024, 12 layers, 16 query and 4 KV heads of 64, MLP 2816; MoE layers
of 8 experts of 512 with 2 routed a token; about 140M parameters, bf16 weights of ~280 MB,
more than the host's effective last-level cache) with the tiny-model helpers, loads it
with dense weights in ``--dtype`` and times decode steps through the model runner,
alternating the fused step (``ENGINE_FUSED_DECODE=1``) and the unfused layers (``=0``,
whose projections take the same small-batch dense kernel through ``Linear``) in the same
process, twice each; the table keeps each arm's best run. Random weights decode as fast as trained ones: only the
shapes matter here. The models are written to a temporary folder and removed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import EngineDecode, prompts  # noqa: E402

from engine.models.loader import load_model  # noqa: E402
from engine.models.testing import write_tiny_model  # noqa: E402

SIZE = dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
            intermediate_size=2816)
MOE = dict(moe_intermediate_size=512, num_experts=8, num_experts_per_tok=2)
OVERRIDES = {
    "llama": SIZE,
    "gemma2": SIZE | dict(query_pre_attn_scalar=64, sliding_window=4096),
    "gemma3": SIZE | dict(query_pre_attn_scalar=64, sliding_window=4096),
    "qwen3_moe": SIZE | MOE | dict(mlp_only_layers=[]),
    "qwen2_moe": SIZE | MOE | dict(shared_expert_intermediate_size=1024),
    "mixtral": SIZE | dict(intermediate_size=512, num_local_experts=8, num_experts_per_tok=2),
    # Session 20's families: Gemma 1's two norms, Phi-4-mini's partial rotary (48 of 64; no
    # longrope, whose factors the tiny model sizes for its own heads), SmolLM3's fourth layer
    # without RoPE, Granite's multipliers, OLMo's post-norms and full-width q/k norms.
    "gemma": SIZE,
    "phi4": SIZE | dict(rope_scaling=None),
    "smollm3": SIZE | dict(no_rope_layer_interval=4),
    "granite": SIZE,
    "olmo2": SIZE,
    "olmo3": SIZE | dict(sliding_window=4096),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default=",".join(OVERRIDES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"dense {args.dtype} weights; torch threads {torch.get_num_threads()}; {args.new_tokens - 1} decode "
          f"steps after a {args.prompt_len}-token prompt")
    print(f"| {'arch':<10} | batch | unfused tok/s | fused tok/s | fused / unfused |")
    print("|---|---|---|---|---|")
    for arch in args.archs.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            folder = write_tiny_model(Path(tmp) / arch, arch, overrides=OVERRIDES[arch])
            base = load_model(folder, dtype="float32")
            engine = EngineDecode(base, dtype, max(batches), args.prompt_len + args.new_tokens)
            for b in batches:
                ps = prompts(b, args.prompt_len, base.config.vocab_size)
                rates: dict[str, list[float]] = {"0": [], "1": []}
                for _ in range(2):
                    for flag in ("0", "1"):
                        os.environ["ENGINE_FUSED_DECODE"] = flag
                        engine.run(ps[:1], 4)
                        secs = engine.run(ps, args.new_tokens)
                        rates[flag].append(b * (args.new_tokens - 1) / secs)
                fused = engine.runner.model.fused_step
                assert fused is not None and fused.steps > 0, f"{arch}: the fused step did not run"
                u, f = max(rates["0"]), max(rates["1"])
                print(f"| {arch:<10} | {b} | {u:.1f} | {f:.1f} | {f / u:.2f}x |", flush=True)
            os.environ.pop("ENGINE_FUSED_DECODE")
            del engine, base


if __name__ == "__main__":
    main()
