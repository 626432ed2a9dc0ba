"""Load generator for an OpenAI-compatible server, in the manner of vLLM's serving benchmark.

    python bench/serve.py --base-url http://127.0.0.1:8000 --concurrency 8 \\
        --num-prompts 64 --input-len 64 --output-len 128

Each request streams /v1/completions with ``ignore_eos`` so it produces exactly
``--output-len`` tokens. Arrivals are either a fixed number of clients in a closed loop
(``--concurrency``) or a Poisson process (``--request-rate`` per second). Prompts are
``--input-len`` token ids, random per request (``--random-range-ratio`` widens input and
output lengths around their means) so the prefix cache cannot help. Reports request
throughput, output tokens/s, TTFT and inter-token latency percentiles; with
``--baseline transformers`` it then times transformers' ``generate`` on the same prompts in
static batches of the same size, and prints the ratio.

``--workload tools`` measures tool calling instead: the same chat questions, each asked
twice in one run at the same concurrency, first as free chat (no tools, ``ignore_eos``,
``--output-len`` tokens), then with two function tools and ``tool_choice`` naming one
(the output constrained to its schema, ending when the call is complete). It reports both
rows and checks every returned call's arguments against its schema with ``jsonschema``.

``--shared-prefixes K`` starts every prompt with one of K fixed prefixes of ``--prefix-len``
tokens (system prompts), so the prefix cache and data-parallel routing by cache affinity
matter; the table then reports the server's prefix-cache hit rate over the run.

``--launch engine-gguf,engine-none,llama`` starts each server in turn on a free port (the
engine with its GGUF blocks kept, the engine dequantized to bf16, and llama.cpp's
``llama-server`` from ``--llama-cpp DIR`` with the anchors' fair settings; skipped when
absent), runs the same load at each of ``--concurrencies``, reads the server's resident
memory (VmRSS) after the load, stops it, and prints one table:

    python bench/serve.py --launch engine-gguf,engine-none,llama --llama-cpp /work/llama.cpp \
        --concurrencies 1,32 --num-prompts 64

An engine kind takes a mode after a colon: ``engine-gguf:inproc`` and ``engine-gguf:core``
(the engine core in the server's process, or in one of its own; ``engine-gguf:coreasync``
plans step N+1 while step N runs there), ``engine-gguf:dp2`` and
``engine-gguf:dp2rr`` (two data-parallel cores, routed by cache affinity or round-robin):

    python bench/serve.py --launch engine-gguf:inproc,engine-gguf:core --concurrencies 1,8,32
    python bench/serve.py --launch engine-gguf:dp2,engine-gguf:dp2rr --shared-prefixes 8 \
        --concurrencies 8 --num-prompts 128 --output-len 16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The load, the prompts and the report are `python -m engine bench serve`'s; this script
# adds the project's comparisons (tool calling, launching servers, a transformers baseline).
from engine.cli.bench import (  # noqa: E402
    DEFAULT_TOKEN_RANGE,
    RequestResult,
    StreamExchange,
    first_model,
    parse_token_range,
    random_requests,
    run_load,
    stream_completion,
    summarize,
)
from engine.cli.bench import print_summary as print_report  # noqa: E402
from engine.cli.loadclient import LoadClient  # noqa: E402

Result = RequestResult


# The tool-calling workload's tools: small, typical agent functions.
BENCH_TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 24},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search_flights", "description": "Flights between two airports on a day.",
        "parameters": {"type": "object", "properties": {
            "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"},
            "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["origin", "destination", "date", "passengers"],
            "additionalProperties": False}}},
]
_CITIES = ["Paris", "Lima", "Osaka", "Nairobi", "Oslo", "Quito", "Hanoi", "Perth"]


class ChatExchange(StreamExchange):
    """One streamed chat completion; its calls' arguments failing their schema count as
    an error."""

    def __init__(self, model: str, body: dict) -> None:
        body = {**body, "model": model, "stream": True,
                "stream_options": {"include_usage": True}}
        super().__init__("/v1/chat/completions", body)
        self.request = body
        self.args: dict[int, str] = {}

    def on_event(self, data: bytes, now: float) -> None:
        chunk = self.chunk(data)
        if chunk is None:
            return
        if chunk.get("usage"):
            self.result.output_tokens = chunk["usage"]["completion_tokens"]
        if not chunk["choices"]:
            return
        delta = chunk["choices"][0]["delta"]
        for part in delta.get("tool_calls", ()):
            self.args[part["index"]] = self.args.get(part["index"], "") + part["function"][
                "arguments"]
        if delta.get("content") or delta.get("tool_calls"):
            self.tick(now)

    def on_end(self, now: float, error: str) -> None:
        import jsonschema

        result = self.result
        result.error = result.error or error
        if result.error:
            return
        if "tool_choice" in self.request:
            name = self.request["tool_choice"]["function"]["name"]
            schema = next(t["function"]["parameters"] for t in BENCH_TOOLS
                          if t["function"]["name"] == name)
            try:
                jsonschema.validate(json.loads(self.args.get(0, "")), schema)
            except (ValueError, jsonschema.ValidationError) as exc:
                result.error = f"invalid call: {exc}"[:200]
                return
        result.latency = now - self.started
        result.ok = True


def tool_jobs(args: argparse.Namespace, rng: random.Random) -> list[tuple[dict, dict]]:
    """(free chat body, forced call body) per question: the same messages in both."""
    jobs = []
    for i in range(args.num_prompts):
        city = rng.choice(_CITIES)
        if i % 2:
            question, name = f"What is the weather like in {city} right now?", "get_weather"
        else:
            question, name = (f"Find flights from {city} to Tokyo for {1 + i % 4} people "
                              "next Friday.", "search_flights")
        messages = [{"role": "user", "content": question}]
        free = {"messages": messages, "max_tokens": args.output_len, "ignore_eos": True,
                "temperature": 0}
        forced = {"messages": messages, "max_tokens": args.output_len, "temperature": 0,
                  "tools": BENCH_TOOLS,
                  "tool_choice": {"type": "function", "function": {"name": name}}}
        jobs.append((free, forced))
    return jobs


def run_tools(args: argparse.Namespace, jobs: list[tuple[dict, dict]]) -> dict:
    with LoadClient(args.base_url) as http:
        model = args.model or first_model(http)
        if args.warmup:
            http.run([ChatExchange(model, {**jobs[0][1], "max_tokens": 8})])
        rows = {}
        for label, which in (("free chat", 0), ("forced tool call", 1)):
            exchanges = [ChatExchange(model, job[which]) for job in jobs]
            duration = http.run(exchanges, max_concurrency=args.concurrency)
            rows[label] = _summary([e.result for e in exchanges], duration, args)
    return rows


def make_jobs(args: argparse.Namespace, rng: random.Random) -> list[tuple[list[int], int]]:
    # --shared-prefixes K: each prompt is one of K fixed "system prompts" of --prefix-len
    # tokens, then --input-len random tokens of its own.
    return random_requests(
        rng, num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.random_range_ratio, tokens=args.random_token_range,
        prefix_len=args.prefix_len if args.shared_prefixes else 0,
        num_prefixes=args.shared_prefixes)


def run(args: argparse.Namespace, jobs: list[tuple[list[int], int]], rng: random.Random) -> dict:
    with LoadClient(args.base_url) as http:
        model = args.model or first_model(http)
        if args.warmup:
            stream_completion(http, model, jobs[0][0], 4, ignore_eos=True)
        # --request-rate: Poisson arrivals, no cap; else --concurrency clients in a closed
        # loop, which is every request at once with that many in flight.
        results, duration = run_load(
            http, model, jobs, request_rate=args.request_rate or math.inf,
            max_concurrency=None if args.request_rate else args.concurrency, rng=rng)
    return _summary(results, duration, args)


def _summary(results: list[Result], duration: float, args: argparse.Namespace) -> dict:
    return {"concurrency": None if args.request_rate else args.concurrency,
            "request_rate": args.request_rate or None,
            **summarize(results, duration, percentiles=(50, 90, 99))}


def print_summary(s: dict) -> None:
    print_report(s)
    base = s.get("baseline")
    if base:
        print(f"{'baseline':28} {base['name']}: {base['output_tokens_per_s']:.1f} output tok/s "
              f"({base['duration_s']:.2f} s); engine / baseline = "
              f"{s['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _server_command(kind: str, port: int, args: argparse.Namespace) -> list[str] | None:
    from engine.models.loader import resolve_model

    model = resolve_model(args.baseline_model)
    if kind.startswith("engine-"):
        # engine-QUANT[:MODE]: MODE "core" runs the engine core in a process of its own
        # ("coreasync": planning step N+1 while step N runs),
        # "dp2" two data-parallel cores, "dp2rr" two cores routed round-robin.
        quant, _, mode = kind.removeprefix("engine-").partition(":")
        extra = {"": [], "inproc": ["--engine-core", "inprocess"],
                 "core": ["--engine-core", "process"],
                 "coreasync": ["--engine-core", "process", "--async-scheduling"],
                 "dp2": ["--data-parallel-size", "2"],
                 "dp2rr": ["--data-parallel-size", "2", "--data-parallel-routing", "round-robin"]}
        if mode not in extra:
            raise SystemExit(f"unknown engine mode {mode!r}: inproc, core, coreasync, dp2 or dp2rr")
        return [sys.executable, "-m", "engine", "serve", "--model", str(model), "--port", str(port),
                "--quantization", quant, "--log-level", "warning", *extra[mode]]
    if kind == "llama":
        exe = None if args.llama_cpp is None else args.llama_cpp / "bin" / "llama-server"
        if exe is None or not exe.is_file():
            print(f"llama-server not found under {args.llama_cpp}; skipped", file=sys.stderr)
            return None
        # The anchors' fair settings for this 2-core machine (../shared/anchors/).
        return [str(exe), "-m", str(model), "-t", "2", "-tb", "2", "-c", "16384", "-np", "32",
                "-b", "512", "-ub", "512", "--host", "127.0.0.1", "--port", str(port),
                *([] if args.llama_repack else ["--no-repack"])]
    raise SystemExit(f"unknown server {kind!r}: engine-gguf, engine-none or llama")


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server at {url} not ready after {timeout} s")


def stop_server(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGINT (a server's graceful shutdown), then SIGKILL after ``timeout`` seconds."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants (engine cores, compile workers)."""
    total = 0.0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) / 1024
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                total += _rss_mib(int(child))
    except (FileNotFoundError, ProcessLookupError):
        pass
    return total


def _prefix_cache(url: str) -> tuple[float, float]:
    """(hits, queries) of the server's prefix cache, in tokens, from /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    # The engine's own names, or vLLM's where the server serves only those.
    prefix = "engine:" if "\nengine:prefix_cache_hits_total" in text else "vllm:"
    values = {"hits": 0.0, "queries": 0.0}
    for line in text.splitlines():
        for key in values:
            if line.startswith(f"{prefix}prefix_cache_{key}_total"):
                values[key] += float(line.rsplit(" ", 1)[1])
    return values["hits"], values["queries"]


def launch_and_compare(args: argparse.Namespace) -> int:
    """Each server of --launch in turn, the same load at each concurrency, one table."""
    rows = []
    for kind in args.launch.split(","):
        port = _free_port()
        cmd = _server_command(kind, port, args)
        if cmd is None:
            continue
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_ready(url, proc)
            for concurrency in (int(c) for c in args.concurrencies.split(",")):
                run_args = argparse.Namespace(**{**vars(args), "base_url": url, "concurrency": concurrency,
                                                 "request_rate": 0.0})
                rng = random.Random(args.seed)
                hits0, queries0 = _prefix_cache(url)
                summary = run(run_args, make_jobs(run_args, rng), rng)
                hits1, queries1 = _prefix_cache(url)
                summary["prefix_cache_hit_rate"] = (
                    (hits1 - hits0) / (queries1 - queries0) if queries1 > queries0 else 0.0)
                rows.append((kind, concurrency, summary, _rss_mib(proc.pid)))
                print(f"{kind} c={concurrency}: {summary['output_tokens_per_s']:.1f} tok/s", file=sys.stderr)
                for error in summary.get("errors", []):  # the first few, as a single run prints them
                    print(f"{kind} c={concurrency} error: {error}", file=sys.stderr)
        finally:
            stop_server(proc)
    print("| server | concurrency | output tok/s | TTFT p50 / p90 ms | ITL p50 / p90 ms | failed "
          "| prefix-cache hit rate | RSS after MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, c, s_, rss in rows:
        print(f"| {kind} | {c} | {s_['output_tokens_per_s']:.1f} | {s_['p50_ttft_s'] * 1e3:.0f} / "
              f"{s_['p90_ttft_s'] * 1e3:.0f} | {s_['p50_itl_s'] * 1e3:.1f} / {s_['p90_itl_s'] * 1e3:.1f} | "
              f"{s_['failed']} | {s_['prefix_cache_hit_rate']:.1%} | {rss:.0f} |")
    return 0 if all(r[2]["failed"] == 0 for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=1, help="closed-loop clients")
    p.add_argument("--request-rate", type=float, default=0.0,
                   help="Poisson arrivals per second instead of --concurrency")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from mean*(1-r)..mean*(1+r); 0 = fixed")
    p.add_argument("--shared-prefixes", type=int, default=0, metavar="K",
                   help="prompts start with one of K shared prefixes of --prefix-len tokens")
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--random-token-range", type=parse_token_range, default=DEFAULT_TOKEN_RANGE,
                   metavar="LO:HI", help="prompt token ids are drawn from [LO, HI)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--workload", choices=("completions", "tools"), default="completions",
                   help="tools: free chat vs forced tool calls on the same questions")
    p.add_argument("--baseline", choices=("none", "transformers"), default="none",
                   help="after the run, time transformers' generate on the same prompts in "
                        "static batches of --concurrency (the server should be idle by then)")
    p.add_argument("--baseline-model", default=None,
                   help="the model the server runs (default: the engine's default model)")
    p.add_argument("--baseline-dtype", default="auto",
                   help="as the server's --dtype (auto resolves as the engine does)")
    p.add_argument("--launch", default=None,
                   help="start and compare servers in turn: engine-gguf,engine-none,llama")
    p.add_argument("--concurrencies", default="1,32", help="with --launch: the loads to run")
    p.add_argument("--llama-cpp", type=Path, default=None,
                   help="with --launch llama: a llama.cpp build (DIR/bin/llama-server)")
    p.add_argument("--llama-no-repack", dest="llama_repack", action="store_false",
                   help="llama-server --no-repack: its repacked (AMX) weights crashed prompt "
                        "processing on the Xeon dev host (docs/benchmarks.md)")
    args = p.parse_args(argv)
    if args.launch:
        return launch_and_compare(args)
    rng = random.Random(args.seed)
    if args.workload == "tools":
        rows = run_tools(args, tool_jobs(args, rng))
        for label, row in rows.items():
            print(json.dumps({"workload": label, **row}) if args.json else f"== {label}")
            if not args.json:
                print_summary(row)
        return 0 if all(row["failed"] == 0 for row in rows.values()) else 1
    jobs = make_jobs(args, rng)
    summary = run(args, jobs, rng)
    if args.baseline == "transformers":
        summary["baseline"] = run_transformers(args, jobs)
    print(json.dumps(summary) if args.json else "", end="\n" if args.json else "")
    if not args.json:
        print_summary(summary)
    return 0 if summary["failed"] == 0 else 1


def run_transformers(args: argparse.Namespace, jobs: list[tuple[list[int], int]]) -> dict:
    """transformers' greedy ``generate`` over the same prompts, ``--concurrency`` at a time,
    left-padded, each batch running to its longest output; only requested tokens count."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.models.loader import load_model, resolve_model

    loaded = load_model(resolve_model(args.baseline_model), dtype=args.baseline_dtype)
    hf = AutoModelForCausalLM.from_pretrained(loaded.folder, dtype=loaded.dtype)
    hf.generation_config.eos_token_id = None  # ignore_eos, as the requests ask
    batch = max(1, args.concurrency)
    start = time.perf_counter()
    for i in range(0, len(jobs), batch):
        group = jobs[i : i + batch]
        width = max(len(prompt) for prompt, _ in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(group):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, max_new_tokens=max(n for _, n in group),
                        do_sample=False, pad_token_id=0)
    duration = time.perf_counter() - start
    return {"name": f"transformers generate, static batches of {batch} ({loaded.dtype})",
            "duration_s": duration,
            "output_tokens_per_s": sum(n for _, n in jobs) / duration}


if __name__ == "__main__":
    sys.exit(main())
