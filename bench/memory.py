"""Resident memory of the engine's server against llama-server, after the same workload
with the same context capacity.

    python bench/memory.py --llama-server /work/llama.cpp/bin/llama-server \\
        --context 16384 --kv-cache-dtype auto int8

For each configuration it starts the server on the default model's GGUF (SmolLM2-135M
Q4_1, or ``--model``), waits until ``/health`` answers, reads the process's RSS (idle),
runs the workload (``--num-prompts`` text completions, ``--concurrency`` at a time, each
``--input-words`` words of prompt and ``--output-len`` tokens with ``ignore_eos``), reads RSS
and peak RSS (VmHWM) again and stops the server. The engine's KV pool is sized to hold
``--context`` tokens (``--kv-cache-memory`` = context x bytes per token in its KV dtype),
llama-server gets ``-c CONTEXT`` split over ``-np CONCURRENCY`` slots. llama-server is
skipped when its path does not exist.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import trio

REPO = Path(__file__).resolve().parents[1]
WORDS = ("the of and to in is was for on that with as by at from his her an which are this "
         "be had it not were but have one all their new more when there time after first "
         "river city music house water people story world north small light").split()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in bytes."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(rest.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def _prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


async def _workload(url: str, model: str, prompts: list[str], output_len: int, concurrency: int) -> int:
    """Run every prompt, ``concurrency`` at a time; returns the completion tokens served."""
    limiter = trio.CapacityLimiter(concurrency)
    served = 0

    async def one(http: httpx.AsyncClient, prompt: str) -> None:
        nonlocal served
        async with limiter:
            body = {"model": model, "prompt": prompt, "max_tokens": output_len,
                    "temperature": 0, "ignore_eos": True}
            r = await http.post("/v1/completions", json=body)
            r.raise_for_status()
            served += r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        async with trio.open_nursery() as nursery:
            for p in prompts:
                nursery.start_soon(one, http, p)
    return served


def _wait_healthy(url: str, proc: subprocess.Popen, limit: float = 600) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server not healthy in time")


def measure(name: str, cmd: list[str], port: int, args: argparse.Namespace) -> dict[str, float]:
    url = f"http://127.0.0.1:{port}"
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-memory-{name}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        _wait_healthy(url, proc)
        idle, _ = _rss(proc.pid)
        prompts = _prompts(args.num_prompts, args.input_words, seed=0)
        t0 = time.perf_counter()
        served = trio.run(_workload, url, "default", prompts, args.output_len, args.concurrency)
        seconds = time.perf_counter() - t0
        after, peak = _rss(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    return {"idle": idle, "after": after, "peak": peak, "tok_s": served / seconds}


def _engine_kv_bytes(model: str | None, context: int, kv_dtype: str) -> int:
    from engine.models.loader import load_model, resolve_model
    from engine.runner.kv_cache import bytes_per_block

    loaded = load_model(resolve_model(model), dtype="auto")
    return context * bytes_per_block(loaded.config, loaded.dtype, 1, kv_cache_dtype=kv_dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a .gguf (default: the bundled SmolLM2 Q4_1)")
    p.add_argument("--context", type=int, default=16384, help="tokens of KV capacity for both")
    p.add_argument("--kv-cache-dtype", nargs="+", default=["auto", "int8"])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--input-words", type=int, default=300)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--llama-server", default="/work/llama.cpp/bin/llama-server")
    p.add_argument("--engine-flag", action="append", default=[],
                   help="extra flag for python -m engine serve (repeatable, e.g. --engine-flag=--quantization=none)")
    args = p.parse_args()

    from engine.models.loader import resolve_model

    gguf = str(resolve_model(args.model))
    rows = []
    for kv in args.kv_cache_dtype:
        port = _free_port()
        budget = _engine_kv_bytes(args.model, args.context, kv)
        cmd = [sys.executable, "-m", "engine", "serve", "--model", gguf, "--port", str(port),
               "--served-model-name", "default", "--kv-cache-memory", str(budget),
               "--kv-cache-dtype", kv, "--max-num-seqs", str(args.concurrency), *args.engine_flag]
        rows.append((f"engine kv={kv}", measure(f"engine-{kv}", cmd, port, args)))
    if Path(args.llama_server).exists():
        port = _free_port()
        cmd = [args.llama_server, "-m", gguf, "--port", str(port), "-c", str(args.context),
               "-np", str(args.concurrency), "-t", str(os.cpu_count() or 1), "--alias", "default"]
        try:
            rows.append(("llama-server", measure("llama", cmd, port, args)))
        except RuntimeError as exc:  # e.g. a crash at start: still print the engine's rows
            print(f"(llama-server failed: {exc}; see its log under $TMPDIR)")
    else:
        print(f"(llama-server not found at {args.llama_server}: skipped)")

    print(f"workload: {args.num_prompts} completions of ~{args.input_words} words in, "
          f"{args.output_len} tokens out, {args.concurrency} at a time; context {args.context} tokens")
    mib = 2**20
    base = rows[-1][1]["after"] if rows[-1][0] == "llama-server" else None
    print(f"{'server':<18} {'idle MiB':>9} {'after MiB':>10} {'peak MiB':>9} {'tok/s':>7} {'after / llama':>14}")
    for name, r in rows:
        ratio = f"{r['after'] / base:.2f}x" if base else "-"
        print(f"{name:<18} {r['idle'] / mib:>9.0f} {r['after'] / mib:>10.0f} {r['peak'] / mib:>9.0f} "
              f"{r['tok_s']:>7.1f} {ratio:>14}")


if __name__ == "__main__":
    main()
