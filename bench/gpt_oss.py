"""gpt-oss decode on the engine's model runner beside transformers' ``generate``.

    .venv/bin/python bench/gpt_oss.py [--dtype bfloat16] [--batches 1,8] [--new-tokens 64]
                                      [--prompt-len 64] [--rounds 2]

No gpt-oss checkpoint is on this machine (gpt-oss-20b's experts alone are 12 GB in MXFP4,
40 GB dense), so this writes a random-weight gpt-oss with transformers
(engine.models.testing_gpt_oss) at a reduced shape that keeps what sets gpt-oss apart:
every layer a mixture of 32 experts with 4 routed a token, biased attention with sinks,
sliding (128) and full layers alternating. ``SHAPE``: hidden 1024, 8 layers, 16 query and
4 KV heads of 64, experts 512 wide; about 420M parameters, 0.84 GB in bf16. Random
weights decode as fast as trained ones: only the shapes matter here.

Both sides load the same folder in ``--dtype``; each round times the engine's decode steps
(one prefill step, then ``new_tokens - 1`` steps, as bench/decode.py) with the fused CPU
decode step (the default) and without it (``ENGINE_FUSED_DECODE=0``: the layers one by
one), and transformers' (``generate(n) - generate(1)`` on the same prompts), alternating,
and the table keeps each arm's best round. The model is written to a temporary folder and removed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import EngineDecode, hf_decode_seconds, prompts  # noqa: E402

from engine.models.loader import load_model  # noqa: E402
from engine.models.testing_gpt_oss import write_gpt_oss  # noqa: E402

SHAPE = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
             intermediate_size=512, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
             max_position_embeddings=4096,
             rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "truncate": False, "original_max_position_embeddings": 4096,
                              "rope_theta": 150000.0})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    from transformers import GptOssForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "gpt-oss"
        write_gpt_oss(folder, config=SHAPE, spread=0.02)
        base = load_model(folder, dtype="float32")
        params = sum(w.numel() for w in base.weights.values())
        engine = EngineDecode(base, dtype, max(batches), args.prompt_len + args.new_tokens)
        del base
        hf = GptOssForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
        print(f"random gpt-oss, {params / 1e6:.0f}M parameters in {args.dtype}; torch threads "
              f"{torch.get_num_threads()}; {args.new_tokens - 1} decode steps after a {args.prompt_len}-token "
              f"prompt; best of {args.rounds} alternated rounds")
        print("| batch | engine tok/s | engine unfused tok/s | transformers tok/s | engine / transformers |")
        print("|---|---|---|---|---|")
        for b in batches:
            ps = prompts(b, args.prompt_len, hf.config.vocab_size)
            engine.run(ps[:1], 4)  # warm-up
            rates: dict[str, list[float]] = {"1": [], "0": [], "hf": []}
            for _ in range(args.rounds):
                for flag in ("1", "0"):
                    os.environ["ENGINE_FUSED_DECODE"] = flag
                    rates[flag].append(b * (args.new_tokens - 1) / engine.run(ps, args.new_tokens))
                rates["hf"].append(b * (args.new_tokens - 1) / hf_decode_seconds(hf, ps, args.new_tokens))
            os.environ.pop("ENGINE_FUSED_DECODE")
            fused, unfused, theirs = (max(rates[k]) for k in ("1", "0", "hf"))
            print(f"| {b} | {fused:.1f} | {unfused:.1f} | {theirs:.1f} | {fused / theirs:.2f}x |", flush=True)
        step = engine.runner.model.fused_step
        assert step is not None and step.steps > 0, "the fused step did not run"


if __name__ == "__main__":
    main()
