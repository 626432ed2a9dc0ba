"""Decode of the MoE families transformers writes (gpt-oss, GLM-4.5) on the engine's model
runner beside transformers' ``generate``.

    .venv/bin/python bench/moe_families.py [--families gpt_oss,glm4_moe] [--dtype bfloat16]
                                           [--batches 1,8] [--new-tokens 64] [--prompt-len 64] [--rounds 2]

No checkpoint of either fits this machine (gpt-oss-20b's experts are 12 GB in MXFP4 and
40 GB dense; GLM-4.5-Air is 106B), so this writes random-weight models with transformers
at reduced shapes that keep what sets each family apart (``SHAPES``):

* gpt-oss: every layer a mixture of 32 experts with 4 routed a token, biased attention
  with sinks, sliding (128) and full layers alternating. Hidden 1024, 8 layers, 16 query
  and 4 KV heads of 64, experts 512 wide: about 420M parameters.
* GLM-4.5: GLM-4.5-Air's routing (128 experts, 8 routed a token by sigmoid scores and a
  selection bias, one shared expert; here 64 experts), half of each head rotated, q/k/v
  biases, a dense first layer. Hidden 1024, 8 layers, 16 query and 4 KV heads of 64,
  experts 256 wide: about 390M parameters.
* DeepSeek-V3: its latent attention (q through a 384 bottleneck, a 256 latent, keys 64 +
  32 rotated, values 64) and routing (64 experts in 8 groups, 4 kept, 8 routed a token,
  one shared); hidden 1024, 8 layers, 16 heads. It runs unfused (the fused column is
  the same path).
* GLM-4 (dense, beside them): q/k/v biases, norms on each block's output, RoPE on
  interleaved pairs of half of each head; hidden 1024, 8 layers, 16 query and 4 KV heads
  of 64, MLP 2816. It runs unfused too.
* OLMoE: q/k norms across all heads, 64 experts with 8 routed a token on every layer (OLMoE-1B-7B's
  routing), experts 256 wide; the same attention. Unfused.
* GPTBigCode (dense): StarCoder's layer (learned positions, LayerNorm, one KV head, a
  4096 GELU MLP); hidden 1024, 8 layers, 16 heads. Unfused (GPT-2's path).
* StarCoder2 (dense): LayerNorm and biases on every projection, a 4096 GELU MLP, the same
  attention with a sliding window. Unfused.
* GPT-NeoX (dense): Pythia's layer (two LayerNorms, blocks side by side, a quarter of each
  head rotated, 16 heads of 64, a 4096 GELU MLP). Unfused.
* Phi-2 (dense): its layer (one LayerNorm, blocks side by side, half of each 64-wide head rotated,
  biases, a biased head) at the same shape as GPT-NeoX. Unfused.
* Cohere2 (dense): attention and the MLP side by side on one LayerNorm, sliding layers
  (128) and every fourth global without RoPE; the same shape as GLM-4. Unfused.
* Granite 4.0 H (hybrid): three Mamba-2 layers to each attention layer (32 heads of 64,
  a 128-wide state, one group), the shared MLP 2816 wide, no RoPE. Unfused (the Mamba
  layers run in torch); transformers runs its own torch path for the same layers.
* Qwen3.5 (dense): three Gated DeltaNet layers (8 key and 16 value heads of 64) to each
  gated attention layer (16 query and 4 KV heads of 128, a quarter rotated), a 2816 MLP.
  Unfused.
* Nemotron-H: single-mixer blocks (Mamba, MLP, Mamba, attention, MLP, Mamba, MLP, Mamba),
  the mixer 32 heads of 64 with a 128-wide state in 8 groups, squared-ReLU MLPs 2816 wide.
  Unfused.
* Falcon-H1: attention (8 query and 2 KV heads of 64) and a Mamba-2 mixer (24 heads of 64,
  a 128-wide state, one group) side by side in each of 8 layers, a 2048 SwiGLU MLP, its
  multipliers as Falcon-H1-0.5B's: that model's shape with 8 of its 36 layers. Unfused.
* Mamba-1 (selective scan): 8 Mamba blocks at mamba-370m's width (hidden 1024, 2048 channels, a
  16-wide state). Unfused.
* Jamba: Jamba Mini's layer pattern at hidden 1024 over 8 layers (attention, 8 query and 2 KV heads
  of 128 without positions, in layer 4; Mamba-1 with 2048 channels and a 16-wide state in
  the others; 16 experts 1024 wide, 2 routed a token, every other layer; SwiGLU MLPs
  1024 wide between). Unfused.
* Qwen3-MoE: Qwen3-30B-A3B's routing (softmax over the experts, 8 routed a token,
  renormalised, no shared expert) with 64 experts 512 wide on every layer; the same
  attention with q/k norms. Unfused (the experts run through ``fused_moe``).
* Mamba-2 alone: 8 Mamba blocks (32 heads of 64, a 128-wide state in 8 groups: Mamba-Codestral's
  mixer at a quarter of its width), no attention. Unfused.

Random weights decode as fast as trained ones: only the shapes matter here. Both sides
load the same folder in ``--dtype``; each round times the engine's decode steps (one
prefill step, then ``new_tokens - 1`` steps, as bench/decode.py) with the fused CPU
decode step (the default) and without it (``ENGINE_FUSED_DECODE=0``: the layers one by
one), and transformers' (``generate(n) - generate(1)`` on the same prompts), alternating,
and the table keeps each arm's best round. The models are written to a temporary folder
and removed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import EngineDecode, hf_decode_seconds, prompts  # noqa: E402

from engine.models.loader import load_model  # noqa: E402
from engine.models.testing import write_tiny_model  # noqa: E402
from engine.models.testing_gpt_oss import write_gpt_oss  # noqa: E402

ATTENTION = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                 max_position_embeddings=4096)
SHAPES = {
    "gpt_oss": ATTENTION | dict(
        intermediate_size=512, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096, "rope_theta": 150000.0}),
    "deepseek_v3": ATTENTION | dict(
        num_key_value_heads=16, head_dim=32, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, intermediate_size=2816, moe_intermediate_size=256, n_routed_experts=64, num_experts_per_tok=8,
        n_shared_experts=1, n_group=8, topk_group=4, first_k_dense_replace=1, vocab_size=384,
        tie_word_embeddings=False),
    # GLM-4 (dense; bench/deepseek_latent.py's neighbour): the same attention, a 2816 MLP.
    "glm4": ATTENTION | dict(intermediate_size=2816, attention_bias=True, vocab_size=384, tie_word_embeddings=False,
                             pad_token_id=0, eos_token_id=2),
    "cohere2": ATTENTION | dict(intermediate_size=2816, vocab_size=384, sliding_window=128, logit_scale=0.25,
                                pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "olmoe": ATTENTION | dict(intermediate_size=256, num_experts=64, num_experts_per_tok=8, vocab_size=384,
                              tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # GPTBigCode (StarCoder's layer: learned positions, LayerNorm, one KV head): its own keys.
    "gpt_bigcode": dict(n_embd=1024, n_layer=8, n_head=16, n_inner=4096, n_positions=4096, vocab_size=384,
                        multi_query=True, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "starcoder2": ATTENTION | dict(intermediate_size=4096, sliding_window=4096, vocab_size=384, bos_token_id=1,
                                   eos_token_id=2, pad_token_id=0),
    "gpt_neox": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, intermediate_size=4096,
                     max_position_embeddings=4096, vocab_size=384, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "phi": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, intermediate_size=4096,
                partial_rotary_factor=0.5, max_position_embeddings=4096, vocab_size=384, bos_token_id=1,
                eos_token_id=2, pad_token_id=0),
    # Granite 4.0 H (hybrid): three Mamba-2 layers to one attention layer (granite-4.0-h's
    # ratio is about 9:1), the mixer 32 heads of 64 with a 128-wide state, one group.
    "granite4h": ATTENTION | dict(
        shared_intermediate_size=2816, num_local_experts=0, vocab_size=384, tie_word_embeddings=False,
        layer_types=(["mamba"] * 3 + ["attention"]) * 2, mamba_n_heads=32, mamba_d_head=64, mamba_d_state=128,
        mamba_n_groups=1, position_embedding_type=None, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Nemotron-H (Nano 9B v2's pattern, shortened): Mamba, MLP, Mamba, attention, MLP, Mamba,
    # MLP, Mamba blocks; the mixer 32 heads of 64, a 128-wide state in 8 groups; squared-ReLU
    # MLPs 2816 wide.
    "nemotron_h": dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                       max_position_embeddings=4096, intermediate_size=2816, hybrid_override_pattern="M-M*-M-M",
                       num_hidden_layers=8, mamba_num_heads=32, mamba_head_dim=64, n_groups=8, ssm_state_size=128,
                       vocab_size=384, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Nemotron 3 Nano's blocks (NVIDIA-Nemotron-3-Nano-30B-A3B's pattern, shortened) at
    # hidden 1024: Mamba, experts, Mamba, attention, experts, Mamba, experts, Mamba; 32
    # experts of 512 (Nano: 128 of 1856 at hidden 2688), 6 routed a token, scaled by 2.5,
    # a shared expert of 1024; the routers drawn (write() below: transformers starts them at 0).
    "nemotron3": dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=4096, hybrid_override_pattern="MEM*EMEM", num_hidden_layers=8,
                      mamba_num_heads=32, mamba_head_dim=64, n_groups=8, ssm_state_size=128, n_routed_experts=32,
                      num_experts_per_tok=6, moe_intermediate_size=512, moe_shared_expert_intermediate_size=1024,
                      routed_scaling_factor=2.5, n_group=1, topk_group=1, norm_topk_prob=True, vocab_size=384,
                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Falcon-H1-0.5B's layer, 8 of its 36, with its multipliers.
    "falcon_h1": dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                      intermediate_size=2048, num_hidden_layers=8, mamba_d_ssm=1536, mamba_n_heads=24, mamba_d_head=64,
                      mamba_n_groups=1, mamba_d_state=128, max_position_embeddings=4096, vocab_size=384,
                      tie_word_embeddings=False, rope_theta=1e11, embedding_multiplier=5.66, lm_head_multiplier=0.039,
                      key_multiplier=0.39, attention_out_multiplier=0.9375, ssm_in_multiplier=1.25,
                      ssm_out_multiplier=0.2357, ssm_multipliers=[0.354, 0.25, 0.354, 0.5, 0.354],
                      mlp_multipliers=[0.884, 0.586], pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Mamba-1: mamba-370m's block (hidden 1024, 2048 channels, a 16-wide state, dt rank 64).
    "mamba": dict(hidden_size=1024, state_size=16, num_hidden_layers=8, vocab_size=384, tie_word_embeddings=False,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Jamba: Jamba Mini's pattern (attention every 8th layer from the 4th, experts every other).
    "jamba": dict(hidden_size=1024, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, num_experts=16, num_experts_per_tok=2, mamba_d_state=16, vocab_size=384,
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Mamba-2 alone: Mamba-Codestral-7B's mixer (heads of 64, 8 groups, a 128-wide state) at hidden 1024.
    "mamba2": dict(hidden_size=1024, num_heads=32, head_dim=64, n_groups=8, state_size=128, num_hidden_layers=8,
                   vocab_size=384, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Qwen3.5 (dense): three Gated DeltaNet layers to one gated attention layer, the
    # DeltaNet 8 key and 16 value heads of 64 (Qwen3.5's ratio), attention heads of 128.
    "qwen3_5": ATTENTION | dict(
        head_dim=128, intermediate_size=2816, vocab_size=384, tie_word_embeddings=False, linear_num_key_heads=8,
        linear_num_value_heads=16, linear_key_head_dim=64, linear_value_head_dim=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2),
    # Qwen3-MoE (Qwen3-30B-A3B's routing: 128 experts of 768 at hidden 2048, 8 routed a
    # token, renormalised; here 64 experts of 512 at hidden 1024), q/k norms, no shared expert.
    "qwen3_moe": ATTENTION | dict(
        intermediate_size=2816, moe_intermediate_size=512, num_experts=64, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], vocab_size=384, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2),
    # A dense Llama at the same attention (bench/gguf_formats.py's model: its widths are
    # whole 256-column super-blocks, so every matrix takes a k-quant).
    "llama": ATTENTION | dict(intermediate_size=2816, vocab_size=384, tie_word_embeddings=False, pad_token_id=0,
                              bos_token_id=1, eos_token_id=2),
    "glm4_moe": ATTENTION | dict(
        intermediate_size=2816, moe_intermediate_size=256, n_routed_experts=64, num_experts_per_tok=8,
        n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, attention_bias=True,
        vocab_size=384, tie_word_embeddings=False),
}


def write(family: str, folder: Path) -> None:
    if family == "gpt_oss":
        write_gpt_oss(folder, config=SHAPES[family], spread=0.02)
        return
    import transformers

    name = {"glm4_moe": "Glm4Moe", "deepseek_v3": "DeepseekV3", "glm4": "Glm4", "cohere2": "Cohere2", "olmoe": "Olmoe",
            "qwen3_moe": "Qwen3Moe", "llama": "Llama",
            "gpt_bigcode": "GPTBigCode", "starcoder2": "Starcoder2", "gpt_neox": "GPTNeoX",
            "phi": "Phi", "granite4h": "GraniteMoeHybrid", "nemotron_h": "NemotronH", "nemotron3": "NemotronH",
            "qwen3_5": "Qwen3_5",
            "falcon_h1": "FalconH1", "mamba2": "Mamba2", "mamba": "Mamba",
            "jamba": "Jamba"}[family]
    config = getattr(transformers, f"{name}{'TextConfig' if family == 'qwen3_5' else 'Config'}")(**SHAPES[family])
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForCausalLM")(config)
    if family == "nemotron3":  # the routers and their selection biases away from 0
        with torch.no_grad():
            for n, p in [*model.named_parameters(), *model.named_buffers()]:
                if n.endswith(("mixer.gate.weight", "e_score_correction_bias")):
                    p.normal_(0.0, 0.02 if n.endswith("weight") else 0.01)
    model.save_pretrained(folder)
    tokenizer = write_tiny_model(folder.parent / "tokenizer", "llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(SHAPES))
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
    from transformers import AutoModelForCausalLM

    print(f"random weights in {args.dtype}; torch threads {torch.get_num_threads()}; {args.new_tokens - 1} decode "
          f"steps after a {args.prompt_len}-token prompt; best of {args.rounds} alternated rounds")
    print("| family | parameters | batch | engine tok/s | engine unfused tok/s | transformers tok/s | "
          "engine / transformers |")
    print("|---|---|---|---|---|---|---|")
    for family in args.families.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / family
            write(family, folder)
            base = load_model(folder, dtype="float32")
            params = sum(w.numel() for w in base.weights.values())
            engine = EngineDecode(base, dtype, max(batches), args.prompt_len + args.new_tokens)
            del base
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
            hf.generation_config.eos_token_id = None
            hf.generation_config.pad_token_id = 0
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
                print(f"| {family} | {params / 1e6:.0f}M | {b} | {fused:.1f} | {unfused:.1f} | {theirs:.1f} | "
                      f"{fused / theirs:.2f}x |", flush=True)
            step = engine.runner.model.fused_step
            # latent attention, post-block norms, LayerNorm, q/k norms across the heads
            fuses = family not in ("deepseek_v3", "glm4", "cohere2", "olmoe", "gpt_bigcode", "starcoder2", "gpt_neox",
                                  "phi", "granite4h", "nemotron_h", "nemotron3", "qwen3_5", "falcon_h1", "mamba2",
                                  "mamba", "jamba")
            assert (step is not None and step.steps > 0) == fuses, f"{family}: the fused step ran or not"
            del engine, hf


if __name__ == "__main__":
    main()
