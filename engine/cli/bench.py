"""``python -m engine bench serve|throughput|latency``: the benchmarks users run, with
vLLM's ``vllm bench`` flags and report.

* ``serve``: a load generator against a running server (``--base-url``, or ``--host`` and
  ``--port``). Each request streams ``/v1/completions`` with a random prompt of token ids;
  arrivals are a Poisson process at ``--request-rate`` per second (``inf``: all at once),
  at most ``--max-concurrency`` in flight. Reports request throughput, output and total
  tokens/s, and TTFT, TPOT (time per output token after the first), ITL (the gaps between
  streamed chunks) and, with ``--percentile-metrics``, end-to-end latency (E2EL): their
  mean, median and ``--metric-percentiles``.
* ``throughput``: the engine in this process (the engine flags: ``--model`` ...) given
  ``--num-prompts`` random prompts at once, each making exactly its output length
  (``ignore_eos``); reports requests/s, total tokens/s and output tokens/s.
* ``latency``: one batch of ``--batch-size`` prompts, end to end, ``--num-iters`` times
  after ``--num-iters-warmup``; reports the mean and percentiles of a batch's latency.

Prompts are token ids drawn uniformly from a band of ordinary tokens (no specials), random
per request so the prefix cache cannot help, with lengths ``--random-input-len`` and
``--random-output-len`` (widened by ``--random-range-ratio``); ``--random-prefix-len``
starts every prompt with one shared prefix. ``bench/serve.py`` and ``bench/throughput.py``
(the project's own comparisons: transformers baselines, launching several servers, the
per-step overhead) build on the pieces here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson
import trio
from tqdm import tqdm

from engine.api import open_engine
from engine.cli.args import add_engine_arguments, config_from_args
from engine.cli.help import HelpFormatter
from engine.cli.loadclient import Exchange, LoadClient, LoadClientError, request_json
from engine.config import EngineConfig
from engine.params import SamplingParams

# Token ids of a served model are not known to a client: this band is ordinary text tokens
# of SmolLM2's 49,152-token vocabulary (the default model) and of Llama's, above their
# special and byte tokens; --random-token-range sets another for a smaller vocabulary.
DEFAULT_TOKEN_RANGE = (1000, 20000)
METRICS = ("ttft", "tpot", "itl", "e2el")
_METRIC_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                  "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
EXIT_FAILED = 1  # some request failed


# -- prompts --------------------------------------------------------------------------------


def token_range(vocab_size: int) -> tuple[int, int]:
    """Ids of ordinary tokens in a vocabulary of ``vocab_size``: above the first 1,000 (the
    specials and bytes of the common tokenizers; a quarter of a tiny test vocabulary) and
    below 40,000 (the rarest merges of the large ones). The upper bound is exclusive."""
    return min(1000, vocab_size // 4), min(vocab_size, 40000)


def lengths(mean: int, ratio: float, rng: random.Random) -> int:
    """A length drawn uniformly from ``mean * (1 - ratio) .. mean * (1 + ratio)``, at least 1."""
    return max(1, rng.randint(int(mean * (1 - ratio)), int(mean * (1 + ratio))))


def random_requests(rng: random.Random, *, num_prompts: int, input_len: int, output_len: int,
                    range_ratio: float = 0.0, tokens: tuple[int, int] = DEFAULT_TOKEN_RANGE,
                    prefix_len: int = 0, num_prefixes: int = 1) -> list[tuple[list[int], int]]:
    """``(prompt ids, output length)`` per request. With ``prefix_len``, every prompt starts
    with one of ``num_prefixes`` fixed prefixes of that many tokens (system prompts), then
    ``input_len`` tokens of its own."""
    lo, hi = tokens

    def ids(n: int) -> list[int]:
        return [rng.randint(lo, hi - 1) for _ in range(n)]

    if prefix_len:
        prefixes = [ids(prefix_len) for _ in range(num_prefixes)]
        return [(rng.choice(prefixes) + ids(input_len), lengths(output_len, range_ratio, rng))
                for _ in range(num_prompts)]
    return [(ids(lengths(input_len, range_ratio, rng)), lengths(output_len, range_ratio, rng))
            for _ in range(num_prompts)]


# -- serve: the client side -----------------------------------------------------------------


@dataclasses.dataclass
class RequestResult:
    """One streamed request, timed on the client (seconds)."""

    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    itls: list[float] = dataclasses.field(default_factory=list)

    def failed(self, error: str) -> bool:
        """Whether the request failed: ``error`` (the exchange's, "" when it completed)
        recorded, or an error its answer gave before."""
        if error:
            self.error = error
        return bool(self.error)

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for a one-token answer."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


class StreamExchange(Exchange):
    """A streamed request timed as it arrives: ``result`` gets the time of its first
    chunk with output and the gaps between the later ones."""

    def __init__(self, path: str, body: dict[str, Any], prompt_tokens: int = 0) -> None:
        super().__init__("POST", path, body)
        self.result = RequestResult(prompt_tokens=prompt_tokens)
        self.last = 0.0

    def chunk(self, data: bytes) -> dict[str, Any] | None:
        """An event's JSON; None for ``[DONE]``, for an error chunk (recorded) and for
        anything after an error."""
        if data == b"[DONE]" or self.result.error:
            return None
        chunk = orjson.loads(data)
        if "error" in chunk:
            self.result.error = chunk["error"]["message"]
            return None
        return chunk

    def tick(self, now: float) -> None:
        """A chunk with output arrived at ``now``."""
        result = self.result
        if result.ttft == 0.0:
            result.ttft = now - self.started
        else:
            result.itls.append(now - self.last)
        self.last = now

    def on_body(self, body: bytes) -> None:
        if self.status != 200:
            self.result.error = f"HTTP {self.status}: {body[:200]!r}"
        else:
            self.result.error = f"not a stream of events: {body[:200]!r}"


class CompletionExchange(StreamExchange):
    """One streamed ``/v1/completions`` request (``ignore_eos``, greedy); a chunk with
    text is one with output."""

    def __init__(self, model: str, prompt: list[int], output_len: int, *,
                 ignore_eos: bool = True) -> None:
        super().__init__("/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": output_len, "stream": True,
            "ignore_eos": ignore_eos, "temperature": 0,
            "stream_options": {"include_usage": True}}, prompt_tokens=len(prompt))
        self.usage_tokens: int | None = None  # a server without streamed usage: a token a chunk
        self.chunks = 0

    def on_event(self, data: bytes, now: float) -> None:
        chunk = self.chunk(data)
        if chunk is None:
            return
        if chunk.get("usage"):
            self.usage_tokens = chunk["usage"]["completion_tokens"]
            self.result.prompt_tokens = chunk["usage"]["prompt_tokens"]
        if not chunk["choices"] or not self.has_output(chunk["choices"][0]):
            return
        self.chunks += 1
        self.tick(now)

    @staticmethod
    def has_output(choice: dict[str, Any]) -> bool:
        return bool(choice["text"])

    def on_end(self, now: float, error: str) -> None:
        result = self.result
        if result.failed(error):
            return
        result.latency = now - self.started
        result.output_tokens = self.usage_tokens if self.usage_tokens is not None else self.chunks
        result.ok = True


class ChatExchange(CompletionExchange):
    """One streamed ``/v1/chat/completions`` request (vLLM's ``openai-chat`` backend): the
    prompt is one user message of ``text`` (its token count is the server's, read from the
    streamed usage); a chunk with content (or reasoning) is one with output."""

    def __init__(self, model: str, text: str, output_len: int, *, ignore_eos: bool = True) -> None:
        StreamExchange.__init__(self, "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": text}], "max_completion_tokens": output_len,
            "stream": True, "ignore_eos": ignore_eos, "temperature": 0,
            "stream_options": {"include_usage": True}})
        self.usage_tokens = None
        self.chunks = 0

    @staticmethod
    def has_output(choice: dict[str, Any]) -> bool:
        delta = choice.get("delta") or {}
        return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"))


class EmbeddingExchange(Exchange):
    """One ``/v1/embeddings`` request (vLLM's ``openai-embeddings`` backend), answered whole:
    its latency, and the prompt tokens the server counted."""

    def __init__(self, model: str, prompt: list[int]) -> None:
        super().__init__("POST", "/v1/embeddings", {"model": model, "input": prompt})
        self.result = RequestResult(prompt_tokens=len(prompt))

    def on_body(self, body: bytes) -> None:
        if self.status != 200:
            self.result.error = f"HTTP {self.status}: {body[:200]!r}"
            return
        try:
            usage = orjson.loads(body).get("usage") or {}
        except orjson.JSONDecodeError:
            self.result.error = f"not JSON: {body[:200]!r}"
            return
        self.result.prompt_tokens = int(usage.get("prompt_tokens", self.result.prompt_tokens))

    def on_end(self, now: float, error: str) -> None:
        result = self.result
        if result.failed(error):
            return
        result.latency = result.ttft = now - self.started
        result.ok = True


def stream_completion(http: LoadClient, model: str, prompt: list[int], output_len: int, *,
                      ignore_eos: bool = True) -> RequestResult:
    """Stream one ``/v1/completions`` request on its own (see :class:`CompletionExchange`)."""
    exchange = CompletionExchange(model, prompt, output_len, ignore_eos=ignore_eos)
    http.run([exchange])
    return exchange.result


# vLLM's backends of `bench serve` this one speaks, and the endpoint each speaks to.
BACKENDS = {"openai": "/v1/completions", "vllm": "/v1/completions", "openai-chat": "/v1/chat/completions",
            "openai-embeddings": "/v1/embeddings"}


def serve_endpoint(backend: str, endpoint: str | None) -> str:
    """The endpoint ``backend`` sends to (``endpoint`` when given, which must be that one)."""
    want = BACKENDS[backend]
    if endpoint is not None and endpoint != want:
        raise ValueError(f"--backend {backend} sends to {want}, not --endpoint {endpoint}")
    return want


def detokenize(http: LoadClient, model: str, prompt: list[int]) -> str:
    """``prompt``'s text, by the server's own ``/detokenize`` (a chat prompt is text; the
    server then counts its tokens, which may differ from ``len(prompt)`` by a few)."""
    status, body = request_json(http, "POST", "/detokenize", {"model": model, "tokens": prompt})
    if status != 200 or not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
        raise RuntimeError(f"POST /detokenize: HTTP {status}: {body!r}"[:300])
    return body["prompt"]


def first_model(http: LoadClient) -> str:
    """The first model the server lists (GET /v1/models)."""
    status, body = request_json(http, "GET", "/v1/models")
    if status != 200:
        raise RuntimeError(f"GET /v1/models: HTTP {status}: {body!r}"[:300])
    return str(body["data"][0]["id"])


def run_load(http: LoadClient, model: str, jobs: Sequence[tuple[Any, int]], *,
             request_rate: float = math.inf, max_concurrency: int | None = None,
             rng: random.Random, ignore_eos: bool = True, progress: Any = None,
             endpoint: str = "/v1/completions") -> tuple[list[RequestResult], float]:
    """Send ``jobs`` to ``endpoint`` (Poisson arrivals at ``request_rate`` a second, at
    most ``max_concurrency`` in flight); every result, and the seconds it took. A job's
    prompt is token ids, or text for chat."""
    exchanges = [_exchange(endpoint, model, prompt, n, ignore_eos) for prompt, n in jobs]
    duration = http.run(exchanges, max_concurrency=max_concurrency, request_rate=request_rate,
                        rng=rng, on_done=None if progress is None else lambda _: progress.update(1))
    return [e.result for e in exchanges], duration


def _exchange(endpoint: str, model: str, prompt: Any, n: int, ignore_eos: bool) -> Any:
    if endpoint == "/v1/chat/completions":
        return ChatExchange(model, prompt, n, ignore_eos=ignore_eos)
    if endpoint == "/v1/embeddings":
        return EmbeddingExchange(model, prompt)
    return CompletionExchange(model, prompt, n, ignore_eos=ignore_eos)


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def summarize(results: Sequence[RequestResult], duration: float,
              percentiles: Sequence[float] = (99,)) -> dict[str, Any]:
    """The report's numbers (seconds): counts, throughputs, and for each metric its mean,
    median and the percentiles asked for (p50, p90 and p99 always)."""
    ok = [r for r in results if r.ok]
    samples = {"ttft": [r.ttft for r in ok], "tpot": [t for r in ok if (t := r.tpot) is not None],
               "itl": [x for r in ok for x in r.itls], "e2el": [r.latency for r in ok]}
    inputs, outputs = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": inputs, "total_output_tokens": outputs,
        "request_throughput": len(ok) / duration,
        "output_tokens_per_s": outputs / duration,
        "total_tokens_per_s": (inputs + outputs) / duration,
        "percentiles": sorted(set(percentiles)),
    }
    for metric, values in samples.items():
        summary[f"mean_{metric}_s"] = float(np.mean(values)) if values else math.nan
        summary[f"median_{metric}_s"] = _percentile(values, 50)
        for q in sorted({50, 90, 99, *percentiles}):
            summary[f"p{q:g}_{metric}_s"] = _percentile(values, q)
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def print_summary(summary: dict[str, Any], metrics: Sequence[str] = ("ttft", "tpot", "itl"),
                  out: Any = None) -> None:
    """``summary`` as vLLM's serving benchmark prints its result."""
    out = out or sys.stdout
    width = 50

    def row(label: str, value: Any) -> None:
        print(f"{label:<40} {value}", file=out)

    print(" Serving Benchmark Result ".center(width, "="), file=out)
    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Benchmark duration (s):", f"{summary['duration_s']:.2f}")
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", f"{summary['request_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{summary['output_tokens_per_s']:.2f}")
    row("Total token throughput (tok/s):", f"{summary['total_tokens_per_s']:.2f}")
    for metric in metrics:
        name = metric.upper()
        print(_METRIC_TITLES[metric].center(width, "-"), file=out)
        row(f"Mean {name} (ms):", f"{summary[f'mean_{metric}_s'] * 1e3:.2f}")
        row(f"Median {name} (ms):", f"{summary[f'median_{metric}_s'] * 1e3:.2f}")
        for q in summary["percentiles"]:
            row(f"P{q:g} {name} (ms):", f"{summary[f'p{q:g}_{metric}_s'] * 1e3:.2f}")
    print("=" * width, file=out)
    for error in summary.get("errors", []):
        print("error:", error, file=sys.stderr)


def _bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    jobs = random_requests(rng, num_prompts=args.num_prompts, input_len=args.random_input_len,
                           output_len=args.random_output_len, range_ratio=args.random_range_ratio,
                           tokens=args.random_token_range, prefix_len=args.random_prefix_len)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.base_url or f"http://{args.host}:{args.port}"
    endpoint = serve_endpoint(args.backend, args.endpoint)
    with LoadClient(url, headers) as http:
        model = args.model or first_model(http)
        if endpoint == "/v1/chat/completions":  # a chat message is text: the server's own
            jobs = [(detokenize(http, model, prompt), n) for prompt, n in jobs]
        if args.warmup:
            warm = _exchange(endpoint, model, jobs[0][0], 4, True)
            http.run([warm])
            if not warm.result.ok:
                raise RuntimeError(f"the warm-up request failed: {warm.result.error}")
        print(f"Traffic request rate: {args.request_rate}\nMaximum request concurrency: "
              f"{args.max_concurrency}", file=sys.stderr)
        with tqdm(total=len(jobs), disable=args.disable_tqdm or None, file=sys.stderr) as bar:
            results, duration = run_load(
                http, model, jobs, request_rate=args.request_rate,
                max_concurrency=args.max_concurrency, rng=rng, ignore_eos=args.ignore_eos,
                progress=bar, endpoint=endpoint)
    summary = summarize(results, duration, args.metric_percentiles)
    return {"model": model, "backend": args.backend, "endpoint": endpoint, "request_rate": args.request_rate,
            "max_concurrency": args.max_concurrency, "num_prompts": args.num_prompts, **summary}


# -- offline: throughput and latency --------------------------------------------------------


async def drain(eng: Any, prompt: Any, max_tokens: int, params: SamplingParams | None = None
                ) -> int:
    """Generate ``max_tokens`` tokens of ``prompt`` (greedy, ``ignore_eos``); how many came."""
    params = params or SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    count = 0
    async for out in eng.generate(prompt, params):
        count += len(out.token_ids)
    return count


async def generate_all(eng: Any, jobs: Sequence[tuple[list[int], int]]) -> tuple[int, float]:
    """Every job at once; (output tokens, seconds)."""
    counts: list[int] = []

    async def one(prompt: list[int], n: int) -> None:
        counts.append(await drain(eng, prompt, n))

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for prompt, n in jobs:
            nursery.start_soon(one, prompt, n)
    return sum(counts), time.perf_counter() - start


async def _bench_throughput(args: argparse.Namespace, config: EngineConfig) -> dict[str, Any]:
    async with open_engine(config=config) as eng:
        rng = random.Random(args.seed)
        jobs = random_requests(rng, num_prompts=args.num_prompts, input_len=args.input_len,
                               output_len=args.output_len, range_ratio=args.random_range_ratio,
                               tokens=token_range(eng.tokenizer.vocab_size))
        await drain(eng, jobs[0][0][:16], 4)  # warm-up: the first forwards fill torch's caches
        outputs, elapsed = await generate_all(eng, jobs)
    prompts = sum(len(p) for p, _ in jobs)
    return {"elapsed_time": elapsed, "num_requests": len(jobs),
            "total_num_tokens": prompts + outputs, "total_prompt_tokens": prompts,
            "total_output_tokens": outputs, "requests_per_second": len(jobs) / elapsed,
            "tokens_per_second": (prompts + outputs) / elapsed,
            "output_tokens_per_second": outputs / elapsed}


async def _bench_latency(args: argparse.Namespace, config: EngineConfig) -> dict[str, Any]:
    async with open_engine(config=config) as eng:
        rng = random.Random(args.seed)
        jobs = random_requests(rng, num_prompts=args.batch_size, input_len=args.input_len,
                               output_len=args.output_len,
                               tokens=token_range(eng.tokenizer.vocab_size))
        latencies = []
        total = args.num_iters_warmup + args.num_iters
        with tqdm(total=total, desc="iterations", disable=args.disable_tqdm or None,
                  file=sys.stderr) as bar:
            for i in range(total):
                _, elapsed = await generate_all(eng, jobs)
                if i >= args.num_iters_warmup:
                    latencies.append(elapsed)
                bar.update(1)
    return {"avg_latency": float(np.mean(latencies)), "latencies": latencies,
            "percentiles": {str(q): _percentile(latencies, q) for q in (10, 25, 50, 75, 90, 99)}}


def _json_safe(value: Any) -> Any:
    """``value`` with infinities and NaNs (an unlimited rate, a metric with no sample) as
    strings: strict JSON has neither."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def run_bench(args: argparse.Namespace) -> int:
    """The ``bench`` command; returns the exit status."""
    if args.bench_command == "serve":
        try:
            result = _bench_serve(args)
        except (LoadClientError, RuntimeError, ValueError) as exc:
            print(f"error: {args.base_url or f'http://{args.host}:{args.port}'}: {exc}",
                  file=sys.stderr)
            return EXIT_FAILED
        metrics = args.percentile_metrics or (["e2el"] if result["endpoint"] == "/v1/embeddings"
                                              else ["ttft", "tpot", "itl"])
        print_summary(result, [m for m in metrics if m in METRICS])
        status = EXIT_FAILED if result["failed"] else 0
        path = args.result_filename if args.save_result else args.output_json
    elif args.bench_command == "throughput":
        result = trio.run(_bench_throughput, args, config_from_args(args))
        print(f"Throughput: {result['requests_per_second']:.2f} requests/s, "
              f"{result['tokens_per_second']:.2f} total tokens/s, "
              f"{result['output_tokens_per_second']:.2f} output tokens/s")
        print(f"Total num prompt tokens:  {result['total_prompt_tokens']}")
        print(f"Total num output tokens:  {result['total_output_tokens']}")
        status, path = 0, args.output_json
    else:
        result = trio.run(_bench_latency, args, config_from_args(args))
        print(f"Avg latency: {result['avg_latency']:.4f} seconds")
        for q, value in result["percentiles"].items():
            print(f"{q}% percentile latency: {value:.4f} seconds")
        status, path = 0, args.output_json
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(_json_safe(result), f, indent=2)
    return status


# -- flags ----------------------------------------------------------------------------------


def parse_token_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    if not sep or not lo.isdigit() or not hi.isdigit() or int(lo) >= int(hi):
        raise argparse.ArgumentTypeError(f"{text!r} is not LO:HI with LO < HI")
    return int(lo), int(hi)


def _csv(kind: type) -> Any:
    def parse(text: str) -> list[Any]:
        try:
            return [kind(item) for item in text.split(",") if item.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list") from None
    return parse


def _metrics(text: str) -> list[str]:
    names = _csv(str)(text)
    unknown = [n for n in names if n not in METRICS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown metric(s) {', '.join(unknown)}: "
                                         f"{', '.join(METRICS)}")
    return names


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not at least 1")
    return value


def _add_serve(sub: Any) -> None:
    p = sub.add_parser(
        "serve", help="load a running server with streamed completions",
        formatter_class=HelpFormatter,
        description="Send --num-prompts streamed /v1/completions requests of random token ids "
                    "to a running server and report throughput and TTFT, TPOT and ITL "
                    "percentiles, as `vllm bench serve` (see docs/serving.md).")
    add = p.add_argument
    add("--base-url", default=None, help="the server (default: http://HOST:PORT)")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000)
    add("--backend", choices=tuple(BACKENDS), default="openai",
        help="the API spoken (vLLM's names): openai and vllm stream /v1/completions, openai-chat "
             "streams /v1/chat/completions (the prompt's ids made text by the server's /detokenize), "
             "openai-embeddings posts /v1/embeddings (latency only)")
    add("--endpoint", choices=tuple(sorted(set(BACKENDS.values()))), default=None,
        help="the backend's endpoint (default: the one it speaks to)")
    add("--model", default=None, help="default: the server's first (GET /v1/models)")
    add("--api-key", default=None, metavar="KEY", help="sent as 'Authorization: Bearer KEY'")
    add("--dataset-name", choices=("random",), default="random")
    add("--num-prompts", type=_positive, default=64)
    add("--random-input-len", "--input-len", type=_positive, default=64, metavar="N")
    add("--random-output-len", "--output-len", type=_positive, default=128, metavar="N")
    add("--random-range-ratio", type=float, default=0.0, metavar="R",
        help="lengths drawn uniformly from len*(1-R)..len*(1+R)")
    add("--random-prefix-len", type=int, default=0, metavar="N",
        help="a prefix of N random tokens every prompt shares")
    add("--random-token-range", type=parse_token_range, default=DEFAULT_TOKEN_RANGE, metavar="LO:HI",
        help="prompt token ids are drawn from [LO, HI) (default: 1000:20000, ordinary tokens "
             "of SmolLM2's and Llama's vocabularies)")
    add("--request-rate", type=float, default=math.inf,
        help="Poisson arrivals per second; inf sends every request at once")
    add("--max-concurrency", type=_positive, default=None, metavar="N",
        help="most requests in flight (default: no limit)")
    add("--ignore-eos", action="store_true", help="every request makes its whole output length")
    add("--percentile-metrics", type=_metrics, default=None,
        help=f"the metrics reported: some of {','.join(METRICS)} (default: ttft,tpot,itl; e2el for "
             "openai-embeddings)")
    add("--metric-percentiles", type=_csv(float), default=[99.0],
        help="the percentiles reported, as 25,50,99")
    add("--seed", type=int, default=0)
    add("--no-warmup", dest="warmup", action="store_false",
        help="no short request before the timed ones")
    add("--disable-tqdm", action="store_true", help="no progress bar")
    add("--save-result", action="store_true", help="write the result as JSON to --result-filename")
    add("--result-filename", default="bench-serve.json", metavar="PATH")
    add("--output-json", default=None, metavar="PATH", help="write the result as JSON here")


def _add_offline(sub: Any, name: str, help: str) -> None:
    p = sub.add_parser(name, help=help, formatter_class=HelpFormatter,
                       description=f"{help[0].upper()}{help[1:]}, as `vllm bench {name}`, "
                                   "with the engine in this process (see docs/serving.md).")
    group = p.add_argument_group(name)
    add = group.add_argument
    add("--input-len", type=_positive, default=32 if name == "latency" else 64, metavar="N")
    add("--output-len", type=_positive, default=128, metavar="N")
    if name == "throughput":
        add("--num-prompts", type=_positive, default=64)
        add("--random-range-ratio", type=float, default=0.0, metavar="R")
    else:
        add("--batch-size", type=_positive, default=8)
        # vLLM's defaults are 10 and 30, sized for a GPU; a CPU batch takes seconds.
        add("--num-iters-warmup", type=int, default=2, metavar="N")
        add("--num-iters", type=_positive, default=10, metavar="N")
        add("--disable-tqdm", action="store_true", help="no progress bar")
    # The prompts are drawn with the engine's --seed.
    add("--output-json", default=None, metavar="PATH", help="write the result as JSON here")
    add_engine_arguments(p)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmark a server (serve) or the engine (throughput, "
                       "latency)", formatter_class=HelpFormatter,
                       description="The benchmarks of `vllm bench`: serve (a running "
                                   "server under load), throughput and latency (the engine "
                                   "offline), on random prompts.")
    benches = p.add_subparsers(dest="bench_command", required=True)
    _add_serve(benches)
    _add_offline(benches, "throughput", "the engine's offline throughput on random prompts")
    _add_offline(benches, "latency", "the latency of one batch, end to end, offline")
