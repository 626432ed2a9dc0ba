"""The state-space families, and Qwen3-MoE (``qwen3_moe``), from
GGUFs written by llama.cpp's own converter: read as transformers runs the model they came
from, then timed beside llama.cpp on the same file.

    .venv/bin/python bench/recurrent_gguf.py --llama-cpp /work/llama
        [--families falcon_h1,mamba2,mamba,jamba,granite4h,nemotron_h,nemotron3,qwen3_moe]
        [--outtype q8_0]
        [--new-tokens 64]
        [--prompt-len 512] [--rounds 3] [--dtypes float32,bfloat16] [--check-only]

For each family (Granite 4's hybrid is ``granite4h``, Nemotron 3's ``nemotron3``; the
converter writes both Nemotron-H families as ``nemotron_h_moe``, since transformers 5 writes
``num_experts_per_tok`` into every Nemotron-H config), ``moe_families.SHAPES[family]``'s
random-weight model is written by transformers and converted by llama.cpp's
``convert_hf_to_gguf.py`` (the source tree ``../shared/anchors/build_llama_cpp.sh`` leaves
under ``DIR/src``; see ``qwen35_gguf``'s driver), twice:

* ``--outtype f32``: the file (Falcon-H1's with its shape's multipliers, away from 1, which
  the converter folds into the weights) through ``engine.LLM``, greedy, against transformers'
  ``generate`` on the folder it came from (fp32, 16 tokens after a 32-token prompt): the
  tokens agreeing, and the largest difference of their logprobs;
* ``--outtype`` (unless ``--check-only``): decode at batch 1 after a 64-token prompt and
  the one-step prefill of ``--prompt-len`` tokens, the engine's runner (blocks kept) against
  ``llama-bench`` (tg and pp) on that file, alternated in each round, 2 threads each
  (``build_llama_cpp.sh``'s fair settings). The best of ``--rounds``.

Granite 4's config is written as IBM's are before it is converted (see
``released_layer_names``). The converter's tokenizer step is given the BPE pre-tokenizer's
name (the tiny tokenizer's hash is not one it knows) and, for Jamba and the Llama family
(Granite's), told to read the tokenizer as GPT-2's (their own paths want a
sentencepiece-style vocabulary the tiny tokenizer is not); the weights and the layout are
the converter's own.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import prompts  # noqa: E402
from moe_families import write  # noqa: E402
from qwen35_gguf import table_cells, time_beside_llama  # noqa: E402

import engine  # noqa: E402
from engine.models.loader import load_model  # noqa: E402

DRIVER = """
import runpy, sys
root = sys.argv.pop(1)
sys.path[:0] = [root + "/gguf-py", root]
import conversion.base as base
import conversion.jamba as jamba
import conversion.llama as llama
if sys.argv[1] == "--raw-hparams":  # config.json as written, not through transformers' AutoConfig
    import json, pathlib
    sys.argv.pop(1)
    base.ModelBase.load_hparams = staticmethod(lambda d, *a, **k: json.loads((pathlib.Path(d) / "config.json").read_text()))
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
jamba.JambaModel.set_vocab = lambda self: self._set_vocab_gpt2()
llama.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv[0] = root + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def released_layer_names(folder: Path) -> None:
    """Granite 4's ``layer_types`` as IBM's configs name them ("mamba", "attention"):
    transformers 5 saves "linear_attention" / "full_attention", which this converter does
    not know (it would take every layer for Mamba); and a dense model's
    ``num_experts_per_tok`` 0 and ``intermediate_size`` its MLP's width, as IBM's
    (transformers' defaults, 2 and 11,008, make llama.cpp abort or refuse the file)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    names = {"linear_attention": "mamba", "full_attention": "attention"}
    config["layer_types"] = [names.get(t, t) for t in config["layer_types"]]
    if not config.get("num_local_experts"):  # IBM's dense configs: no expert routed, one MLP width
        config["num_experts_per_tok"] = 0
        config["intermediate_size"] = config["shared_intermediate_size"]
    path.write_text(json.dumps(config, indent=2))


def released_dense_nemotron_h(folder: Path) -> None:
    """A dense Nemotron-H's config.json as NVIDIA's are (Nano 9B v2's): no expert keys, the
    blocks' kinds as ``hybrid_override_pattern``.
    transformers 5 writes its defaults for them (``num_experts_per_tok`` among them), which
    make the converter write the file as ``nemotron_h_moe`` with the MLP blocks' widths 0,
    a file llama.cpp itself refuses (the engine reads either). The converter reads the
    config through transformers' AutoConfig, which puts them back, so this family is
    converted with ``--raw-hparams`` (DRIVER: config.json as written)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    experts = ("n_routed_experts", "n_shared_experts", "n_group", "topk_group", "num_experts_per_tok",
               "routed_scaling_factor", "norm_topk_prob")
    for key in [k for k in config if k in experts or k.startswith("moe_")]:
        del config[key]
    # and the blocks as a pattern, as released (the converter reads a list's "mlp" as no MLP)
    kinds = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-"}
    config["hybrid_override_pattern"] = "".join(kinds[t] for t in config.pop("layers_block_type"))
    config["num_hidden_layers"] = len(config["hybrid_override_pattern"])
    path.write_text(json.dumps(config, indent=2))


def convert(llama_cpp: Path, folder: Path, out: Path, outtype: str, *, raw_hparams: bool = False) -> None:
    roots = sorted(llama_cpp.glob("src/llama_cpp_python-*/vendor/llama.cpp"))
    if not roots:
        raise SystemExit(f"no llama.cpp source under {llama_cpp}/src (run ../shared/anchors/build_llama_cpp.sh)")
    done = subprocess.run([sys.executable, "-c", DRIVER, str(roots[-1]), *(["--raw-hparams"] if raw_hparams else []),
                           str(folder), "--outfile", str(out), "--outtype", outtype], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"convert_hf_to_gguf.py failed on {folder.name}:\n{done.stderr[-3000:]}")


def check(folder: Path, path: Path) -> tuple[int, int, float]:
    """Greedy tokens from the f32 file through engine.LLM and from transformers on the
    folder: (tokens agreeing before the first difference, tokens, largest |logprob
    difference| over the agreeing ones)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    prompt = prompts(1, 32, hf.config.vocab_size)[0]
    new = 16
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, output_scores=True,
                          return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    want = out.sequences[0, len(prompt):].tolist()
    want_lp = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, want, strict=True)]
    llm = engine.LLM(str(path), dtype="float32", max_model_len=256)
    try:
        got = llm.generate({"prompt_token_ids": prompt}, engine.SamplingParams(
            temperature=0.0, max_tokens=new, logprobs=0, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    finally:
        llm.close()
    agree = next((i for i, (a, b) in enumerate(zip(got.token_ids, want, strict=True)) if a != b), new)
    diffs = [abs(got.logprobs[i][t].logprob - want_lp[i]) for i, t in enumerate(want[:agree])]
    return agree, new, max(diffs, default=float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, required=True)
    ap.add_argument("--families", default="falcon_h1,mamba2,mamba,jamba,granite4h,nemotron_h,nemotron3")
    ap.add_argument("--outtype", default="q8_0")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--check-only", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    dtypes = args.dtypes.split(",")
    rows: list[str] = []
    for family in args.families.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / family
            write(family, folder)
            if family == "granite4h":
                released_layer_names(folder)
            if family == "nemotron_h":
                released_dense_nemotron_h(folder)
            f32 = Path(tmp) / f"{family}-f32.gguf"
            convert(args.llama_cpp, folder, f32, "f32", raw_hparams=family == "nemotron_h")
            agree, new, diff = check(folder, f32)
            print(f"{family}: llama.cpp's f32 file, greedy against transformers: {agree}/{new} tokens agree, "
                  f"largest logprob difference {diff:.2e}", flush=True)
            if args.check_only:
                continue
            path = Path(tmp) / f"{family}-{args.outtype}.gguf"
            convert(args.llama_cpp, folder, path, args.outtype, raw_hparams=family == "nemotron_h")
            loaded = load_model(path, dtype="float32")
            print(f"{path.name}: {path.stat().st_size / 2**20:.1f} MiB, quantization {loaded.quantization}",
                  flush=True)
            best = time_beside_llama(args.llama_cpp, path, loaded, dtypes, args.prompt_len, args.new_tokens,
                                     args.rounds)
            for kind, label in (("decode", f"tg{args.new_tokens}"), ("prefill", f"pp{args.prompt_len}")):
                rows.append(f"| {family} | {label} | " + table_cells(best, kind, dtypes))
    if rows:
        print("\n| family | run | " + " | ".join(f"engine ({d})" for d in dtypes) + " | llama.cpp | "
              + " | ".join(f"engine ({d}) / llama.cpp" for d in dtypes) + " |")
        print("|---" * (3 + 2 * len(dtypes)) + "|")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
