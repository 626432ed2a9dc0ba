"""The served path against the engine under it (issue 42): each comparison's two sides run
in turn, round after round, in this one process and the same minutes.

    python bench/served.py --rounds 3                      # every section, the issue's sizes
    python bench/served.py --sections chat --rounds 3
    python bench/served.py --rounds 1 --quick              # a smoke run: tiny loads

Sections (``--sections``, comma-separated; default all):

* ``chat``: ``python -m engine serve`` (SmolLM2 Q4_1, its GGUF blocks kept) streaming
  ``/v1/completions`` at each of ``--concurrencies`` (1 and 32) against the embedded engine
  (``open_engine``, the same GGUF) running the same token prompts from the same number of
  closed-loop tasks: ``--num-prompts`` prompts of ``--input-len`` (128) random token ids,
  ``--output-len`` (256) tokens each, EOS ignored. Reported: output tokens/s and mean time
  between tokens (TPOT) for both, and served / embedded.
* ``embed``: ``serve --model all-MiniLM-L6-v2 --dtype float32`` (``--embed-dtype``:
  bfloat16 runs the encoder's matmuls in bf16 against sentence-transformers' fp32, the
  cosine check below still at 0.999), ``--num-sentences`` (512)
  sentences from 32 clients: one sentence a request with keep-alive, one a request on a new
  connection each (``Connection: close``), and 16 a request; then, with the server
  stopped, sentence-transformers' ``encode`` of the same sentences at batch 32. Reported:
  sentences/s and each row / sentence-transformers, the CPU the server's event loop (its
  main thread) spent a request in each load, and the smallest cosine between the
  server's vectors and sentence-transformers' (a check, not a figure).
* ``requests``: what a request that does nothing costs: ``--num-requests`` (3,000)
  ``GET /health`` from 32 clients to the embeddings server, with keep-alive and with a
  new connection each; the server process's CPU a request (every thread, from
  ``/proc/PID/task/*/stat``) and the load generator's; then the same loads against
  bench/bare_app.py (quart-trio on hypercorn, one route: the stack alone), the baseline
  of what the server adds, and against its bare ASGI callable (hypercorn without quart),
  which splits the stack's cost between the two. Linux only.
* ``core``: serve with the engine core in its process (``--engine-core process``) against
  in-process at each of ``--core-concurrencies`` (1, 8, 32), the chat section's load
  (``--core-modes`` adds ``coreasync``, the core process planning step N+1 while step N
  runs); odd rounds serve the modes in order, even rounds in reverse. Both servers inherit
  ``OMP_NUM_THREADS``: with fewer threads than CPUs, serve's default (``auto``) is the
  core process.
* ``spec``: a chat request asking to rename one variable in a 15-line function (bench/spec.py's
  ``code`` workload), through ``/v1/chat/completions`` without streaming, greedy, against
  a server with ``--speculative-config`` ngram and one without; end-to-end seconds of each
  of ``--spec-repeat`` requests (the first is cold, the others hit the prefix cache), and
  whether both answered the same text (greedy must).

Servers start outside the clock; each side of a row runs while the other is stopped, so
they never share the cores. Every round prints its rows; the end prints the median of
each row over the rounds and the ratio of its two sides. Run it on an idle machine: the
figures are only as good as the machine is quiet.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import trio

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import embed as embed_bench  # noqa: E402
import serve as serve_bench  # noqa: E402
import spec as spec_bench  # noqa: E402

import engine  # noqa: E402
from engine.cli.loadclient import Exchange, LoadClient  # noqa: E402
from engine.params import SamplingParams  # noqa: E402

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                    "prompt_lookup_min": 1})


@contextlib.contextmanager
def served(args: argparse.Namespace, kind: str = "engine-gguf", extra: tuple[str, ...] = (),
           model_args: tuple[str, ...] | None = None) -> Iterator[str]:
    """A server of ``kind`` (bench/serve.py's names) on a free port; its URL once ready."""
    with served_process(args, kind, extra, model_args) as (url, _):
        yield url


@contextlib.contextmanager
def served_process(args: argparse.Namespace, kind: str = "engine-gguf", extra: tuple[str, ...] = (),
                   model_args: tuple[str, ...] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """:func:`served`, with the server's process."""
    port = serve_bench._free_port()
    if model_args is None:
        cmd = serve_bench._server_command(kind, port, args)
        assert cmd is not None
    else:
        cmd = [sys.executable, "-m", "engine", "serve", "--port", str(port), "--log-level",
               "warning", *model_args]
    with _running([*cmd, *extra], port) as running:
        yield running


@contextlib.contextmanager
def _running(cmd: list[str], port: int) -> Iterator[tuple[str, subprocess.Popen]]:
    """``cmd`` (a server on ``port``) started, its URL once ``/health`` answers; stopped
    on exit."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    url = f"http://127.0.0.1:{port}"
    try:
        serve_bench._wait_ready(url, proc)
        yield url, proc
    finally:
        serve_bench.stop_server(proc)


def load_args(args: argparse.Namespace, url: str, concurrency: int) -> argparse.Namespace:
    """bench/serve.py's arguments for one load at ``concurrency``."""
    return argparse.Namespace(
        base_url=url, model=None, warmup=True, request_rate=0.0, concurrency=concurrency,
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        random_range_ratio=0.0, random_token_range=serve_bench.DEFAULT_TOKEN_RANGE,
        prefix_len=0, shared_prefixes=0, seed=args.seed, baseline_model=None)


def http_load(url: str, args: argparse.Namespace, concurrency: int) -> dict[str, float]:
    run_args = load_args(args, url, concurrency)
    rng = random.Random(args.seed)
    s = serve_bench.run(run_args, serve_bench.make_jobs(run_args, rng), rng)
    if s["failed"]:
        raise SystemExit(f"{s['failed']} requests failed: {s.get('errors')}")
    return {"tok_s": s["output_tokens_per_s"], "tpot_ms": s["mean_tpot_s"] * 1e3}


async def embedded_load(args: argparse.Namespace, concurrencies: list[int]) -> dict[int, dict]:
    """The same token prompts through ``open_engine`` from ``c`` closed-loop tasks."""
    run_args = load_args(args, "", 1)
    jobs = serve_bench.make_jobs(run_args, random.Random(args.seed))
    rows = {}
    async with engine.open_engine(None, quantization="gguf") as eng:

        async def one(prompt: list[int], n: int, tpots: list[float]) -> None:
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            first = last = None
            count = 0
            async with await eng.submit(prompt, params) as stream:
                async for out in stream:
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                    count += len(out.token_ids)
            if count > 1 and first is not None and last is not None:
                tpots.append((last - first) / (count - 1))

        await one(jobs[0][0], 4, [])  # warm-up, as bench/serve.py's
        for c in concurrencies:
            queue = iter(jobs)
            tpots: list[float] = []

            async def client(queue: Iterator[tuple[list[int], int]] = queue,
                             tpots: list[float] = tpots) -> None:
                for prompt, n in queue:
                    await one(prompt, n, tpots)

            t0 = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for _ in range(c):
                    nursery.start_soon(client)
            wall = time.perf_counter() - t0
            rows[c] = {"tok_s": sum(n for _, n in jobs) / wall,
                       "tpot_ms": statistics.mean(tpots) * 1e3}
    return rows


def section_chat(args: argparse.Namespace) -> dict[str, float]:
    out = {}
    with served(args) as url:
        for c in args.concurrencies:
            row = http_load(url, args, c)
            out[f"chat c={c} served tok/s"] = row["tok_s"]
            out[f"chat c={c} served TPOT ms"] = row["tpot_ms"]
    for c, row in trio.run(embedded_load, args, args.concurrencies).items():
        out[f"chat c={c} embedded tok/s"] = row["tok_s"]
        out[f"chat c={c} embedded TPOT ms"] = row["tpot_ms"]
    return out


def section_embed(args: argparse.Namespace) -> dict[str, float]:
    sentences = embed_bench.corpus(args.num_sentences)
    out, vectors = {}, {}
    with served_process(args, model_args=("--model", embed_bench.MODEL, "--dtype", args.embed_dtype,
                                          "--engine-core", args.embed_engine_core)) as (url, proc):
        embed_bench.run_load(url, sentences[:32], 4)  # warm-up
        for label, per, fresh in (("1/request keep-alive", 1, False),
                                  ("1/request new connection", 1, True),
                                  ("16/request", 16, False)):
            loop0 = _thread_cpu_seconds(proc.pid, proc.pid)
            secs, vecs = embed_bench.run_load(url, sentences, 32, per, fresh)
            loop = _thread_cpu_seconds(proc.pid, proc.pid) - loop0
            out[f"embed c=32 {label} sentences/s"] = len(sentences) / secs
            out[f"embed c=32 {label} event loop CPU us a request"] = loop / len(vecs) * per * 1e6
            vectors[label] = vecs
    secs, reference = embed_bench.offline(sentences, 32)
    out["embed sentence-transformers batch 32 sentences/s"] = len(sentences) / secs
    b = reference.astype(np.float64)
    for label, vecs in vectors.items():
        a = vecs.astype(np.float64)
        cos = ((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min()
        if cos < 0.999:
            raise SystemExit(f"embed {label}: min cosine {cos:.6f} against sentence-transformers")
    return out


def _process_cpu_seconds(pid: int) -> float:
    """User and system CPU of every thread of ``pid`` so far (``/proc/PID/task/*/stat``)."""
    return sum(_thread_cpu_seconds(pid, int(task)) for task in os.listdir(f"/proc/{pid}/task"))


def _thread_cpu_seconds(pid: int, tid: int) -> float:
    """User and system CPU of thread ``tid`` of ``pid`` so far (the main thread: ``tid`` =
    ``pid``; serve's event loop runs there)."""
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def section_requests(args: argparse.Namespace) -> dict[str, float]:
    out = {}
    model = ("--model", embed_bench.MODEL, "--dtype", args.embed_dtype)
    with served_process(args, model_args=model) as (url, proc):
        out |= _health_load(args, url, proc.pid, "requests")
    with bare_app() as (url, pid):
        out |= _health_load(args, url, pid, "requests bare stack")
    with bare_app("asgi") as (url, pid):
        out |= _health_load(args, url, pid, "requests bare hypercorn")
    return out


def _health_load(args: argparse.Namespace, url: str, pid: int, prefix: str) -> dict[str, float]:
    out = {}
    for label, headers in (("keep-alive", {}), ("new connection", {"Connection": "close"})):
        exchanges = [Exchange("GET", "/health", headers=headers) for _ in range(args.num_requests)]
        server0, client0 = _process_cpu_seconds(pid), time.process_time()
        with LoadClient(url, timeout=60.0) as http:
            http.run(exchanges, max_concurrency=32)
        server, client = _process_cpu_seconds(pid) - server0, time.process_time() - client0
        if failed := [e for e in exchanges if e.status != 200]:
            raise SystemExit(f"GET /health ({prefix}): {len(failed)} requests failed")
        out[f"{prefix} {label} server CPU us"] = server / len(exchanges) * 1e6
        out[f"{prefix} {label} load generator CPU us"] = client / len(exchanges) * 1e6
    return out


@contextlib.contextmanager
def bare_app(kind: str = "quart") -> Iterator[tuple[str, int]]:
    """bench/bare_app.py on a free port: ``quart`` (quart-trio and hypercorn, one route) or
    ``asgi`` (a bare ASGI callable on hypercorn)."""
    port = serve_bench._free_port()
    with _running([sys.executable, str(REPO / "bench" / "bare_app.py"), str(port), kind],
                  port) as (url, proc):
        yield url, proc.pid


def section_core(args: argparse.Namespace) -> dict[str, float]:
    out = {}
    # Odd rounds serve the modes in the order given, even rounds in reverse.
    for mode in args.core_modes[::1 if args.round % 2 else -1]:
        with served(args, f"engine-gguf:{mode}", extra=tuple(args.core_server_args.split())) as url:
            for c in args.core_concurrencies:
                out[f"core c={c} {mode} tok/s"] = http_load(url, args, c)["tok_s"]
    return out


def section_spec(args: argparse.Namespace) -> dict[str, float]:
    messages, _ = spec_bench.WORKLOADS["code"]
    out, texts = {}, {}
    for label, extra in (("plain", ()), ("ngram", ("--speculative-config", NGRAM))):
        with served(args, extra=extra) as url:
            seconds = []
            for _ in range(args.spec_repeat):
                t0 = time.perf_counter()
                r = httpx.post(url + "/v1/chat/completions", timeout=600, json={
                    "messages": messages, "temperature": 0, "max_tokens": args.spec_max_tokens})
                r.raise_for_status()
                seconds.append(time.perf_counter() - t0)
                texts.setdefault(label, r.json()["choices"][0]["message"]["content"])
            out[f"spec {label} first s"] = seconds[0]
            out[f"spec {label} warm s (median)"] = statistics.median(seconds[1:] or seconds)
    if texts["plain"] != texts["ngram"]:
        print("spec: the ngram server's answer differs from the plain one's", file=sys.stderr)
    return out


SECTIONS = {"chat": section_chat, "embed": section_embed, "requests": section_requests,
            "core": section_core, "spec": section_spec}
# Each row's pair: (numerator, denominator) of the ratio printed at the end.
RATIOS = [
    ("chat c={c} served tok/s", "chat c={c} embedded tok/s"),
    ("chat c={c} embedded TPOT ms", "chat c={c} served TPOT ms"),
    ("embed c=32 1/request keep-alive sentences/s", "embed sentence-transformers batch 32 sentences/s"),
    ("embed c=32 1/request new connection sentences/s", "embed sentence-transformers batch 32 sentences/s"),
    ("embed c=32 16/request sentences/s", "embed sentence-transformers batch 32 sentences/s"),
    ("requests new connection server CPU us", "requests keep-alive server CPU us"),
    ("requests keep-alive server CPU us", "requests bare stack keep-alive server CPU us"),
    ("requests new connection server CPU us", "requests bare stack new connection server CPU us"),
    ("requests bare stack keep-alive server CPU us", "requests bare hypercorn keep-alive server CPU us"),
    ("requests bare stack new connection server CPU us",
     "requests bare hypercorn new connection server CPU us"),
    ("core c={c} core tok/s", "core c={c} inproc tok/s"),
    ("core c={c} coreasync tok/s", "core c={c} inproc tok/s"),
    ("spec plain warm s (median)", "spec ngram warm s (median)"),
    ("spec plain first s", "spec ngram first s"),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default="chat,embed,requests,core,spec")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrencies", default="1,32")
    p.add_argument("--core-concurrencies", default="1,8,32")
    p.add_argument("--core-server-args", default="",
                   help="more serve flags for the core section's servers (--stream-interval 4)")
    p.add_argument("--core-modes", default="inproc,core",
                   help="the core section's servers (bench/serve.py's engine modes: inproc, "
                   "core, coreasync)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-sentences", type=int, default=512)
    p.add_argument("--num-requests", type=int, default=3000,
                   help="the requests section's GET /health requests per row")
    p.add_argument("--embed-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the embeddings server's --dtype")
    p.add_argument("--embed-engine-core", default="auto", choices=("auto", "inprocess", "process"),
                   help="the embeddings server's --engine-core")
    p.add_argument("--spec-repeat", type=int, default=3)
    p.add_argument("--spec-max-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 8 prompts of 16 tokens, 8 output tokens, 64 sentences")
    p.add_argument("--json", type=Path, default=None, help="also write every round's rows here")
    args = p.parse_args(argv)
    args.baseline_model = None  # bench/serve.py's server command reads it
    args.llama_cpp = None
    if args.quick:
        args.num_prompts, args.input_len, args.output_len = 8, 16, 8
        args.num_sentences, args.spec_repeat, args.spec_max_tokens = 64, 2, 64
        args.num_requests = 200
    args.concurrencies = [int(c) for c in args.concurrencies.split(",")]
    args.core_concurrencies = [int(c) for c in args.core_concurrencies.split(",")]
    args.core_modes = args.core_modes.split(",")
    names = args.sections.split(",")
    if unknown := set(names) - set(SECTIONS):
        p.error(f"unknown sections {sorted(unknown)}: {', '.join(SECTIONS)}")
    rounds: list[dict[str, float]] = []
    for i in range(1, args.rounds + 1):
        args.round = i
        row: dict[str, float] = {}
        for name in names:
            row.update(SECTIONS[name](args))
        rounds.append(row)
        print(f"=== round {i}")
        for key, value in row.items():
            print(f"  {key:55} {value:10.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rounds, indent=1))
    medians = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(f"=== median of {len(rounds)} round(s)")
    for key, value in medians.items():
        print(f"  {key:55} {value:10.2f}")
    print("=== ratios (of the medians)")
    for num, den in RATIOS:
        for c in sorted(set(args.concurrencies) | set(args.core_concurrencies)):
            a, b = num.format(c=c), den.format(c=c)
            if a in medians and b in medians and b != a:
                print(f"  {a} / {b}: {medians[a] / medians[b]:.3f}")
            if "{c}" not in num:
                break
    return 0


if __name__ == "__main__":
    sys.exit(main())
