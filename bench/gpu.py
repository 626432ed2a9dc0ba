"""End-to-end decode and serving on a GPU: a random-weight model of Llama-3.2-1B's shape.

    python3 bench/gpu.py [--batches 1,32,256] [--steps 64] [--prompt-len 128] [--serve]
    .venv/bin/python bench/gpu.py --smoke --serve      # no GPU: tiny shapes, proves it runs

Writes the model (hidden 2048, 16 layers, 32 query / 8 KV heads of 64, MLP 8192, vocab
128256, tied head; bf16, weights drawn on the device at std 0.02) with a
word-level tokenizer of the whole vocabulary, then:

* **decode**: the engine's model runner (Triton kernels) at each batch size, one prefill
  of ``--prompt-len`` tokens a request and ``--steps`` timed greedy decode steps, with
  CUDA graphs and with ``--enforce-eager``'s eager steps, beside transformers' greedy
  ``generate`` on the same weights and prompts (decode time: ``generate(steps + 1) -
  generate(1)``), in the same process;
* **roofline**: the batch-1 step against the bytes it must read (every weight once, the
  tied head's matrix included, and the context's K/V) over the device-to-device copy
  bandwidth measured here;
* ``--serve``: ``python -m engine serve --device cuda`` on that folder, loaded by
  ``bench/serve.py`` at concurrency 1, 32 and 128 (128-token prompts, 128 output tokens):
  output tok/s, TTFT and ITL percentiles.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import types
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.messages import NewRequest, ScheduledChunk, StepPlan  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from engine.models.testing import write_tiny_model  # noqa: E402
from engine.ops import get_ops  # noqa: E402
from engine.params import SamplingParams  # noqa: E402
from engine.runner.model_runner import ModelRunner  # noqa: E402

BLOCK_SIZE = 16
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
                max_position_embeddings=4096, tie_word_embeddings=True, torch_dtype="bfloat16")
SMOKE = dict(LLAMA_1B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=32000, max_position_embeddings=1024)


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer of ``vocab_size`` tokens (``w3`` .. and three specials), so
    that every id a random model samples decodes to text and the server's streamed
    chunks each carry one (the tiny BPE's 384 tokens leave most of 128k ids textless)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials)} | {f"w{i}": i for i in range(len(specials), vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    tok.save(str(folder / "tokenizer.json"))


def write_model(folder: Path, shape: dict, device: torch.device) -> Path:
    """The tiny model's files with a word-level tokenizer of the model's vocabulary, then
    ``shape``'s config and bf16 weights drawn on ``device`` (a 1B model's weights take
    seconds there, minutes on one CPU thread)."""
    write_tiny_model(folder, "llama")
    write_word_tokenizer(folder, shape["vocab_size"])
    config = json.loads((folder / "config.json").read_text()) | shape
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    from safetensors.torch import save_file

    gen = torch.Generator(device=device).manual_seed(0)
    h, inter, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d

    def rand(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()

    w = {"model.embed_tokens.weight": rand(shape["vocab_size"], h),
         "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
              p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
              p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
              p + "mlp.down_proj.weight": rand(h, inter),
              p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
              p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy GB/s (bytes read plus written), median of 20 after warm-up."""
    if device.type != "cuda":
        return float("nan")
    a = torch.empty(2 * 2**30 // 4, dtype=torch.float32, device=device).normal_()
    b = torch.empty_like(a)
    times = []
    for i in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end))
    times.sort()
    return 2 * a.numel() * 4 / (times[len(times) // 2] * 1e-3) / 1e9


class Decode:
    """The model runner driven directly: a prefill step, then timed decode steps."""

    def __init__(self, folder: Path, device: torch.device, max_batch: int, max_len: int, graphs: bool) -> None:
        from engine.models.loader import load_model

        base = load_model(folder, dtype="bfloat16", device=device, ops_backend="triton" if device.type == "cuda" else "auto")
        loaded = types.SimpleNamespace(config=base.config, weights=base.weights, dtype=base.dtype)
        self.blocks = -(-max_len // BLOCK_SIZE)
        self.device = device
        self.runner = ModelRunner(
            loaded, device=device, ops=get_ops("auto", device), num_blocks=max_batch * self.blocks,
            block_size=BLOCK_SIZE, max_num_batched_tokens=max(2048, max_len), max_num_seqs=max_batch,
            decode_graphs=graphs, max_model_len=max_len)
        self.runner.warm_up()
        self.step = 0

    def plan(self, new, chunks, finished=()) -> StepPlan:
        self.step += 1
        return StepPlan(self.step, tuple(new), tuple(chunks), tuple(finished))

    def run(self, prompts: list[list[int]], steps: int) -> float:
        """Seconds for ``steps`` decode steps of the batch after its prefill."""
        params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
        ids = [f"r{self.step}-{i}" for i in range(len(prompts))]
        tables = [tuple(range(i * self.blocks, (i + 1) * self.blocks)) for i in range(len(prompts))]
        new = [NewRequest(r, tuple(p), params, ()) for r, p in zip(ids, prompts, strict=True)]
        plen = len(prompts[0])
        # Prefill in chunks of at most 2048 tokens (the runner's step budget).
        per = max(1, 2048 // plen)
        for lo in range(0, len(prompts), per):
            chunk = [ScheduledChunk(r, 0, plen, t, True) for r, t in zip(ids[lo:lo + per], tables[lo:lo + per], strict=True)]
            self.runner.execute(self.plan(new[lo:lo + per], chunk))
        self._sync()
        t0 = time.perf_counter()
        for k in range(steps):
            chunks = [ScheduledChunk(r, plen + k, 1, t, True) for r, t in zip(ids, tables, strict=True)]
            result = self.runner.execute(self.plan((), chunks))
            assert not result.failed, result.failed[:1]
        self._sync()
        elapsed = time.perf_counter() - t0
        self.runner.execute(self.plan((), (), ids))
        return elapsed

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def hf_decode_seconds(folder: Path, device: torch.device, prompts: list[list[int]], steps: int) -> float:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    ids = torch.tensor(prompts, device=device)

    def timed(n: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    timed(2)  # warm-up
    return timed(steps + 1) - timed(1)


def replay_ms(graphs, size: int) -> float:
    """Device time of one replay of the captured forward of ``size`` rows (median of 50,
    CUDA events), on the buffers as the last step left them."""
    graph, _ = graphs._graphs[size]
    times = []
    for i in range(60):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        if i >= 10:
            times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def step_bytes(config: ModelConfig, ctx: int) -> int:
    """What a batch-1 decode step must read: every weight once (bf16; the tied head's
    matrix is read by the head, the embedding row is negligible) and the K/V of ``ctx``."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    return 2 * (layers * per_layer + config.vocab_size * h) + 2 * 2 * layers * ctx * kv


def serve(folder: Path, device: torch.device, concurrencies: list[int], smoke: bool, extra: list[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "engine", "serve", "--model", str(folder), "--port", str(port),
           "--device", device.type, "--max-num-seqs", str(max(concurrencies)), "--max-model-len", "1024",
           "--served-model-name", "llama-1b", *extra]
    log = open(os.environ.get("OUT", "/tmp") + f"/serve{'-'.join(extra) or ''}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        t0 = time.time()
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() - t0 > 300:
                    raise RuntimeError(f"server did not start (see {log.name})") from None
                time.sleep(1)
        print(f"serve {' '.join(extra)}: up in {time.time() - t0:.1f} s", flush=True)
        print(f"{'c':>4} {'out tok/s':>10} {'TTFT p50':>9} {'p99 ms':>8} {'ITL p50':>8} {'p99 ms':>8}")
        for c in concurrencies:
            n = max(8, 4 * c) if not smoke else 2 * c
            out = subprocess.run(
                [sys.executable, str(Path(__file__).parent / "serve.py"), "--base-url", f"http://127.0.0.1:{port}",
                 "--concurrency", str(c), "--num-prompts", str(n), "--input-len", "128",
                 "--output-len", "128" if not smoke else "8", "--json"],
                capture_output=True, text=True, timeout=300)
            if out.returncode:
                print(f"{c:>4} failed: {out.stderr[-800:]}", flush=True)
                continue
            row = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{c:>4} {row['output_tokens_per_s']:>10.1f} {row['p50_ttft_s'] * 1e3:>9.1f} "
                  f"{row['p99_ttft_s'] * 1e3:>8.1f} {row['p50_itl_s'] * 1e3:>8.2f} {row['p99_itl_s'] * 1e3:>8.2f}"
                  f"{'' if not row['failed'] else ' failed ' + str(row['failed'])}", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--folder", type=Path, default=Path("/tmp/llama-1b-random"))
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--serve-only", action="store_true")
    ap.add_argument("--concurrencies", default="1,32,128")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: proves the script runs")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        ap.error("no CUDA device: only --smoke runs")
    device = torch.device("cuda" if cuda else "cpu")
    shape = SMOKE if args.smoke else LLAMA_1B
    batches = [int(b) for b in args.batches.split(",")]
    steps = 4 if args.smoke else args.steps
    t0 = time.perf_counter()
    folder = write_model(args.folder, shape, device)
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu'}; torch {torch.__version__}; "
          f"model written in {time.perf_counter() - t0:.1f} s", flush=True)
    if not args.serve_only:
        bw = copy_bandwidth(device)
        print(f"copy bandwidth: {bw:.0f} GB/s (read + write)", flush=True)
        max_len = args.prompt_len + steps + 16
        g = torch.Generator().manual_seed(0)
        rows: dict[tuple[str, int], float] = {}
        for graphs in (True, False):
            dec = Decode(folder, device, max(batches), max_len, graphs)
            if graphs and dec.runner.graphs is not None:
                print(f"graphs: {len(dec.runner.graphs.sizes)} sizes in {dec.runner.graphs.capture_seconds:.2f} s, "
                      f"{dec.runner.graphs.capture_bytes / 2**20:.0f} MiB", flush=True)
            for b in batches:
                prompts = torch.randint(1000, 20000, (b, args.prompt_len), generator=g).tolist()
                dec.run(prompts, 4)  # warm this batch size
                sec = dec.run(prompts, steps)
                rows[("graphs" if graphs else "eager", b)] = b * steps / sec
                print(f"engine {'graphs' if graphs else 'eager ':<6} B={b:<4} {b * steps / sec:10.1f} tok/s "
                      f"{sec / steps * 1e3:8.3f} ms/step", flush=True)
                if b == 1 and cuda:
                    floor = step_bytes(dec.runner.config, args.prompt_len + steps // 2) / (bw * 1e9)
                    print(f"  roofline B=1: {floor * 1e3:.3f} ms/step floor; measured {sec / steps / floor:.2f}x it",
                          flush=True)
                    if graphs and dec.runner.graphs is not None and dec.runner.graphs.captured:
                        ms = replay_ms(dec.runner.graphs, 1)
                        print(f"  B=1 forward alone (graph replay, device time): {ms:.3f} ms = {ms / 1e3 / floor:.2f}x "
                              f"the floor; the rest of the step (head, sampling, host) "
                              f"{sec / steps * 1e3 - ms:.3f} ms", flush=True)
            del dec
            if cuda:
                torch.cuda.empty_cache()
        if not args.no_hf:
            for b in batches:
                prompts = torch.randint(1000, 20000, (b, args.prompt_len), generator=g).tolist()
                sec = hf_decode_seconds(folder, device, prompts, steps)
                hf = b * steps / sec
                print(f"transformers B={b:<4} {hf:10.1f} tok/s; engine graphs {rows[('graphs', b)] / hf:.2f}x, "
                      f"eager {rows[('eager', b)] / hf:.2f}x", flush=True)
    if args.serve or args.serve_only:
        concurrencies = [int(c) for c in args.concurrencies.split(",")]
        serve(folder, device, concurrencies, args.smoke, [])


if __name__ == "__main__":
    main()
