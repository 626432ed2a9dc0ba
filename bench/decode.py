"""Decode throughput of the engine's model runner beside transformers' ``generate``.

    .venv/bin/python bench/decode.py [--dtypes float32,bfloat16] [--batches 1,32]
                                      [--new-tokens 128] [--prompt-len 64] [--profile]
                                      [--quantization gguf] [--llama-cpp /work/llama.cpp]

Loads SmolLM2-135M-Instruct's GGUF with the engine's loader (fp32, dequantized into a
cached Hugging Face folder), loads transformers from that same folder, and for each dtype
and batch size times
the decode phase only: prefill runs first (one step), then ``new_tokens - 1`` decode steps.
For transformers, decode time is ``generate(new_tokens) - generate(1)`` on the same prompts.
``--profile`` prints where one engine decode step's time goes (torch profiler, by op).
Threads default to 2: the machine's core count, and the setting the targets were set under.

``--quantization gguf`` adds rows for the engine with the GGUF's blocks kept (activations
in each of ``--dtypes``) beside the dequantized engine of the same dtypes, in the same
run; ``--llama-cpp DIR`` (a build of ``../shared/anchors/build_llama_cpp.sh``) adds
``llama-bench``'s tg128 on the same file with the same threads (skipped when absent).
``--fused-ab`` runs each row twice more, alternating the fused CPU decode step
(``engine/ops/cpu/fused.c``, the default) with the unfused layers
(``ENGINE_FUSED_DECODE=0``) in the same process: "gguf+fused" and "gguf-unfused" rows, and
for the dense weights also "dense-oneDNN": unfused with every projection on oneDNN's packed
GEMM (the path before dense weights took quant.c's small-batch kernel and the fused step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
import types
from pathlib import Path

import torch

from engine.messages import NewRequest, ScheduledChunk, StepPlan
from engine.models.loader import default_model_path, load_model
from engine.ops import get_ops
from engine.ops.cpu import qmatmul as cq
from engine.params import SamplingParams
from engine.runner.model_runner import ModelRunner

BLOCK_SIZE = 16  # EngineConfig's default


def load_hf(folder: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # always generate the full length
    model.generation_config.pad_token_id = 0
    return model.eval()


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(100, vocab, (batch, length), generator=g).tolist()


class EngineDecode:
    """Drives a ModelRunner directly: one prefill step, then timed decode steps."""

    def __init__(self, base, dtype: torch.dtype, max_batch: int, max_len: int, ops: str = "auto") -> None:
        weights = {k: v.to(dtype) for k, v in base.weights.items()}
        loaded = types.SimpleNamespace(config=base.config, weights=weights, dtype=dtype)
        self.blocks_per_req = -(-max_len // BLOCK_SIZE)
        self.runner = ModelRunner(
            loaded,
            device="cpu",
            ops=get_ops(ops),
            num_blocks=max_batch * self.blocks_per_req,
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=max_batch * max_len,
            max_num_seqs=max_batch,
        )
        self.step = 0

    def _plan(self, new, chunks, finished=()):
        self.step += 1
        return StepPlan(self.step, tuple(new), tuple(chunks), tuple(finished))

    def run(self, batch_prompts: list[list[int]], new_tokens: int, profile: bool = False) -> float:
        """Decode seconds for ``new_tokens - 1`` steps after the prefill step."""
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        ids = [f"r{i}" for i in range(len(batch_prompts))]
        tables = [
            tuple(range(i * self.blocks_per_req, (i + 1) * self.blocks_per_req))
            for i in range(len(batch_prompts))
        ]
        new = [NewRequest(r, tuple(p), params, ()) for r, p in zip(ids, batch_prompts, strict=True)]
        plen = len(batch_prompts[0])
        chunks = [ScheduledChunk(r, 0, plen, t, True) for r, t in zip(ids, tables, strict=True)]
        self.runner.execute(self._plan(new, chunks))
        t0 = time.perf_counter()
        for k in range(new_tokens - 1):
            chunks = [ScheduledChunk(r, plen + k, 1, t, True) for r, t in zip(ids, tables, strict=True)]
            if profile and k == new_tokens // 2:
                self._profile(chunks)
            else:
                self.runner.execute(self._plan((), chunks))
        elapsed = time.perf_counter() - t0
        self.runner.execute(self._plan((), (), ids))
        return elapsed

    def _profile(self, chunks) -> None:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            self.runner.execute(self._plan((), chunks))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def hf_decode_seconds(hf, batch_prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(batch_prompts)
    mask = torch.ones_like(ids)

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t0

    return timed(new_tokens) - timed(1)


def llama_bench_tg(llama_cpp: Path, model: Path, threads: int, new_tokens: int) -> float | None:
    """llama-bench's text-generation tok/s (tg``new_tokens``), or None without a build."""
    exe = llama_cpp / "bin" / "llama-bench"
    if not exe.is_file():
        print(f"llama-bench not found under {llama_cpp}; skipped")
        return None
    # The anchors' settings are -t threads -p 64 -n 128 -r 5; the -p 64 prompt test died
    # with SIGILL in this llama.cpp build on the AMX dev machine, so only tg runs (-p 0).
    out = subprocess.run(
        [str(exe), "-m", str(model), "-t", str(threads), "-p", "0", "-n", str(new_tokens),
         "-r", "5", "-o", "json"],
        capture_output=True, text=True, check=True,
    ).stdout
    runs = [r for r in json.loads(out) if r.get("n_gen") == new_tokens and r.get("n_prompt") == 0]
    return float(runs[0]["avg_ts"]) if runs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' generate timings")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (2: this machine's cores)")
    ap.add_argument("--ops", default="auto", choices=("auto", "torch", "cpu"),
                    help="op set (auto: the C kernels where built, as the engine runs)")
    ap.add_argument("--quantization", default="none", choices=("none", "gguf"),
                    help="gguf: also run the engine with the GGUF's quantized blocks kept")
    ap.add_argument("--fused-ab", action="store_true",
                    help="with --quantization gguf: alternate the fused decode step and the unfused layers")
    ap.add_argument("--llama-cpp", type=Path, default=None,
                    help="a llama.cpp build (DIR/bin/llama-bench) to time on the same file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    model_path = default_model_path()
    base = load_model(model_path, dtype="float32", quantization="none")
    hf = None if args.no_hf else load_hf(base.folder)
    max_len = args.prompt_len + args.new_tokens
    print(f"ops: {get_ops(args.ops).name}; torch threads {torch.get_num_threads()}; model {model_path.name}")
    if args.llama_cpp is not None:
        tg = llama_bench_tg(args.llama_cpp, model_path, args.threads, args.new_tokens)
        if tg is not None:
            print(f"llama.cpp llama-bench tg{args.new_tokens} (-t {args.threads}): {tg:.1f} tok/s")
    if args.quantization == "gguf":
        quant = load_model(model_path, dtype="float32", quantization="gguf")
        print(f"{'weights':>13} {'batch':>5} {'engine tok/s':>13}")
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            for label, source in ((f"gguf/{name}", quant), (f"dense/{name}", base)):
                engine = EngineDecode(source, dtype, max(batches), max_len, args.ops)
                for b in batches:
                    ps = prompts(b, args.prompt_len, base.config.vocab_size)
                    engine.run(ps[:1], 4)
                    secs = engine.run(ps, args.new_tokens, profile=args.profile)
                    print(f"{label:>13} {b:>5} {b * (args.new_tokens - 1) / secs:>13.1f}", flush=True)
                    if args.fused_ab:
                        # (fused step, dense kernel rows, tag); the dense rows add the path
                        # before the fused step took dense weights: unfused, oneDNN at every size
                        small = dict(cq.DENSE_MAX_ROWS)
                        arms = [("0", small, "unfused"), ("1", small, "+fused")]
                        if source is base:
                            arms.insert(0, ("0", {}, "oneDNN"))
                        for _ in range(2):
                            for flag, rows, tag in arms:
                                os.environ["ENGINE_FUSED_DECODE"], cq.DENSE_MAX_ROWS = flag, rows
                                engine.run(ps[:1], 4)
                                secs = engine.run(ps, args.new_tokens)
                                tag = label.split("/")[0] + ("" if tag.startswith("+") else "-") + tag
                                print(f"{tag:>13} {b:>5} {b * (args.new_tokens - 1) / secs:>13.1f}", flush=True)
                        os.environ.pop("ENGINE_FUSED_DECODE")
                        cq.DENSE_MAX_ROWS = small
                del engine
        if args.no_hf:
            return
    print(f"{'dtype':>9} {'batch':>5} {'engine tok/s':>13} {'transformers tok/s':>19}")
    # float32 first: casting the transformers model to bf16 is not undone by casting back.
    names = sorted(args.dtypes.split(","), key=lambda n: n != "float32")
    for name in names:
        dtype = getattr(torch, name)
        engine = EngineDecode(base, dtype, max(batches), max_len, args.ops)
        model = None if hf is None else hf.to(dtype)
        for b in batches:
            ps = prompts(b, args.prompt_len, base.config.vocab_size)
            engine.run(ps[:1], 4)  # warm-up: first-call allocations and kernel dispatch
            secs = engine.run(ps, args.new_tokens, profile=args.profile)
            ours = b * (args.new_tokens - 1) / secs
            theirs = float("nan")
            if model is not None:
                theirs = b * (args.new_tokens - 1) / hf_decode_seconds(model, ps, args.new_tokens)
            print(f"{name:>9} {b:>5} {ours:>13.1f} {theirs:>19.1f}", flush=True)


if __name__ == "__main__":
    main()
