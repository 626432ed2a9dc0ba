"""Prometheus metrics under vLLM's names with the prefix ``engine:``.

Each app (and each ``LLM``) owns a :class:`prometheus_client.CollectorRegistry`, so two
servers in one process (tests) never share counters. Gauges and the engine's cumulative
counters (preemptions, prefix-cache queries and hits) are read from
``engine.statistics()`` at scrape time; the latency histograms and the token and success
counters are fed by the HTTP handlers (and ``LLM``'s batches) through one
:class:`RequestTimer` per request. :func:`snapshot` reads them as vLLM's
``LLM.get_metrics()`` gives them (``vllm.v1.metrics.reader``'s classes).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from engine.actors.scheduler import ITERATION_TOKEN_BUCKETS
from engine.structured.backend import COMPILE_BUCKETS
from engine.structured.spec import KINDS

if TYPE_CHECKING:
    from engine.actors.system import EngineStatistics
    from engine.api import EngineLike

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket edges follow vLLM's: CPU serving spans milliseconds to minutes.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# Token counts per request: vLLM's 1-2-5 series up to a long context.
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000)

# Every metric name this module exports, for the docs and the tests.
METRIC_NAMES = (
    "engine:num_requests_running",
    "engine:num_requests_waiting",
    "engine:kv_cache_usage_perc",
    "engine:num_preemptions_total",
    "engine:prefix_cache_queries_total",
    "engine:prefix_cache_hits_total",
    "engine:external_prefix_cache_queries_total",
    "engine:external_prefix_cache_hits_total",
    "engine:prompt_tokens_total",
    "engine:generation_tokens_total",
    "engine:request_success_total",
    "engine:time_to_first_token_seconds",
    "engine:inter_token_latency_seconds",
    "engine:e2e_request_latency_seconds",
    "engine:engine_restarts_total",
    "engine:time_per_output_token_seconds",
    "engine:request_queue_time_seconds",
    "engine:request_prefill_time_seconds",
    "engine:request_decode_time_seconds",
    "engine:request_inference_time_seconds",
    "engine:request_prompt_tokens",
    "engine:request_generation_tokens",
    "engine:iteration_tokens_total",
    "engine:cache_config_info",
    "engine:structured_output_requests_total",
    "engine:structured_output_compile_seconds",
    "engine:num_requests_waiting_by_reason",
    "engine:request_params_n",
    "engine:request_params_max_tokens",
    "engine:spec_decode_num_drafts_total",
    "engine:spec_decode_num_draft_tokens_total",
    "engine:spec_decode_num_accepted_tokens_total",
    "engine:spec_decode_num_accepted_tokens_per_pos_total",
    "engine:spec_decode_draft_acceptance_rate",
    "engine:spec_decode_mean_acceptance_length",
    "engine:lora_requests_info",
    "engine:engine_sleep_state",
)
# --metrics-prefix: "engine" (the default) or "vllm", the prefix vLLM's own series, its
# Grafana dashboard and its metric tests use.
METRIC_PREFIXES = ("engine", "vllm")
_PREFIX_AT_LINE_START = re.compile(rb"^(# (?:HELP|TYPE) )?engine:", re.MULTILINE)
# vLLM's buckets for the n request parameter.
_N_BUCKETS = (1, 2, 5, 10, 20)


class _EngineCollector(Collector):
    """Reads the engine's statistics snapshot on every scrape."""

    def __init__(self, engine: EngineLike, model_name: str) -> None:
        self._engine = engine
        self._labels = [model_name]

    def collect(self) -> Iterator[Metric]:
        # One sample per engine core, labelled engine="i" as vLLM's are (one core, "0",
        # when it runs in the server's process); the engine-wide totals are their sums.
        cores = self._engine.core_statistics()
        stats = self._engine.statistics()

        def family(kind: type, name: str, doc: str, value: Any) -> Metric:
            metric = kind(name, doc, labels=["model_name", "engine"])
            for index, core in cores:
                metric.add_metric([*self._labels, str(index)], value(core))
            return metric

        yield family(GaugeMetricFamily, "engine:num_requests_running",
                     "Requests in the running batch.", lambda c: c.running)
        yield family(GaugeMetricFamily, "engine:num_requests_waiting",
                     "Requests waiting to be scheduled.", lambda c: c.waiting)
        # vLLM's split of the waiting requests: "capacity" (for KV blocks or a batch slot)
        # and "deferred" (for something else, such as a remote KV transfer). Every waiting
        # request here waits for capacity: grammars compile before a request is queued.
        by_reason = GaugeMetricFamily("engine:num_requests_waiting_by_reason",
                                      "Requests waiting to be scheduled, by reason.",
                                      labels=["model_name", "engine", "reason"])
        for index, core in cores:
            by_reason.add_metric([*self._labels, str(index), "capacity"], core.waiting)
            by_reason.add_metric([*self._labels, str(index), "deferred"], 0)
        yield by_reason

        def usage(c: EngineStatistics) -> float:
            used = c.kv_blocks_total - c.kv_blocks_free
            return used / c.kv_blocks_total if c.kv_blocks_total else 0.0

        yield family(GaugeMetricFamily, "engine:kv_cache_usage_perc",
                     "Fraction of KV-cache blocks held by requests (1 = full).", usage)
        yield family(CounterMetricFamily, "engine:num_preemptions",
                     "Preemptions (requests evicted and later recomputed).",
                     lambda c: c.preemptions)
        yield family(CounterMetricFamily, "engine:prefix_cache_queries",
                     "Prompt tokens looked up in the prefix cache.",
                     lambda c: c.prefix_cache_queries)
        yield family(CounterMetricFamily, "engine:prefix_cache_hits",
                     "Prompt tokens found in the prefix cache.", lambda c: c.prefix_cache_hits)
        yield family(CounterMetricFamily, "engine:external_prefix_cache_queries",
                     "Prompt tokens of the requests looked up in the KV store (--kv-transfer-config).",
                     lambda c: c.external_prefix_cache_queries)
        yield family(CounterMetricFamily, "engine:external_prefix_cache_hits",
                     "Prompt tokens read from the KV store instead of computed.",
                     lambda c: c.external_prefix_cache_hits)
        yield from self._iteration_tokens(stats)
        yield from self._spec_decode(stats)
        yield self._cache_config(stats)
        yield self._lora_info(stats)
        yield self._sleep_state([index for index, _ in cores])
        yield self._counter("engine:engine_restarts",
                            "Times the engine's actors restarted in place after a crash.",
                            self._engine.restarts)

    def _iteration_tokens(self, stats: EngineStatistics) -> Iterator[Metric]:
        counts = stats.iteration_token_counts
        if not counts:
            return
        buckets, total = [], 0
        for edge, count in zip((*ITERATION_TOKEN_BUCKETS, float("inf")), counts, strict=True):
            total += count
            buckets.append(("+Inf" if edge == float("inf") else str(edge), total))
        family = HistogramMetricFamily("engine:iteration_tokens_total",
                                       "Tokens computed per engine step.", labels=["model_name"])
        family.add_metric(self._labels, buckets, stats.iteration_tokens_sum)
        yield family

    def _spec_decode(self, stats: EngineStatistics) -> Iterator[Metric]:
        """Speculative decoding (prompt lookup, Predicted Outputs), vLLM's counters, and the
        two figures vLLM logs from them: accepted / drafted tokens, and the tokens a
        verification step yields on average (1 + accepted / drafts)."""
        yield self._counter("engine:spec_decode_num_drafts",
                            "Verification steps of a request with a proposal.", stats.spec_drafts)
        yield self._counter("engine:spec_decode_num_draft_tokens",
                            "Tokens proposed.", stats.spec_draft_tokens)
        yield self._counter("engine:spec_decode_num_accepted_tokens",
                            "Proposed tokens accepted.", stats.spec_accepted_tokens)
        family = CounterMetricFamily("engine:spec_decode_num_accepted_tokens_per_pos",
                                     "Proposed tokens accepted, by their place in the proposal.",
                                     labels=["model_name", "position"])
        for position, count in enumerate(stats.spec_accepted_per_pos):
            family.add_metric([*self._labels, str(position)], count)
        yield family
        drafted, drafts = stats.spec_draft_tokens, stats.spec_drafts
        yield self._gauge("engine:spec_decode_draft_acceptance_rate",
                          "Accepted over proposed tokens since start (0 before any).",
                          stats.spec_accepted_tokens / drafted if drafted else 0.0)
        yield self._gauge("engine:spec_decode_mean_acceptance_length",
                          "Tokens output per verification step since start: 1 + accepted / "
                          "drafts (0 before any).",
                          1 + stats.spec_accepted_tokens / drafts if drafts else 0.0)

    def _cache_config(self, stats: EngineStatistics) -> Metric:
        """vLLM's cache_config_info: the KV cache's configuration as labels, value 1."""
        config = self._engine.config
        labels = {
            "block_size": str(config.block_size),
            "num_gpu_blocks": str(stats.kv_blocks_total),
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "cache_dtype": str(config.dtype),
        }
        family = GaugeMetricFamily("engine:cache_config_info", "The KV cache's configuration.",
                                   labels=["model_name", *labels])
        family.add_metric([*self._labels, *labels.values()], 1.0)
        return family

    def _lora_info(self, stats: EngineStatistics) -> Metric:
        """vLLM's lora_requests_info: the adapters of the running and of the waiting
        requests (comma-separated names) and --max-loras as labels; the value is the time
        of the scrape (vLLM's: the time of the last change)."""
        config = self._engine.config
        family = GaugeMetricFamily(
            "engine:lora_requests_info", "LoRA adapters of the running and waiting requests.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        family.add_metric([str(config.max_loras if config.enable_lora else 0), ",".join(stats.running_loras),
                           ",".join(stats.waiting_loras)], time.time())
        return family

    def _sleep_state(self, cores: list[int]) -> Metric:
        """vLLM's engine_sleep_state: 1 for the state each core is in, 0 for the others
        ("weights_offloaded": vLLM's level 1, here the KV cache given back; "discard_all":
        level 2)."""
        tags = getattr(self._engine, "sleeping_tags", tuple)()
        now = "discard_all" if "weights" in tags else "weights_offloaded" if tags else "awake"
        family = GaugeMetricFamily("engine:engine_sleep_state", "The engine's sleep state.",
                                   labels=["model_name", "engine", "sleep_state"])
        for index in cores:
            for state in ("awake", "weights_offloaded", "discard_all"):
                family.add_metric([*self._labels, str(index), state], float(state == now))
        return family

    def _gauge(self, name: str, doc: str, value: float) -> Metric:
        family = GaugeMetricFamily(name, doc, labels=["model_name"])
        family.add_metric(self._labels, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric(self._labels, value)
        return family


class _StructuredCollector(Collector):
    """Structured output: requests by kind and grammar compile times, read from the
    engine's grammar backend at scrape time (``Engine.structured_statistics()``; an engine
    without one, such as the HTTP tests' fake, returns None and reports zeros)."""

    def __init__(self, engine: EngineLike, model_name: str) -> None:
        self._engine = engine
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.structured_statistics()
        requests = CounterMetricFamily(
            "engine:structured_output_requests",
            "Requests with a structured output constraint (response_format, "
            "structured_outputs, guided_*, tool calls), by kind.",
            labels=["model_name", "kind"])
        for kind in KINDS:
            count = stats.requests.get(kind, 0) if stats is not None else 0
            requests.add_metric([self._model_name, kind], count)
        yield requests
        family = HistogramMetricFamily(
            "engine:structured_output_compile_seconds",
            "Time to compile a structured output grammar (cache misses only; a cached "
            "spec costs nothing).", labels=["model_name"])
        cumulative = stats.compile_buckets if stats is not None else (0,) * (len(COMPILE_BUCKETS) + 1)
        bounds = [*(str(b) for b in COMPILE_BUCKETS), "+Inf"]
        family.add_metric([self._model_name], list(zip(bounds, cumulative, strict=True)),
                          stats.compile_seconds_sum if stats is not None else 0.0)
        yield family


class Metrics:
    """The metrics of one server: a registry, its histograms and counters."""

    def __init__(self, engine: EngineLike, model_name: str, prefix: str = "engine") -> None:
        if prefix not in METRIC_PREFIXES:
            raise ValueError(f"metrics prefix must be one of {', '.join(METRIC_PREFIXES)}, "
                             f"got {prefix!r}")
        self.model_name = model_name
        self.prefix = prefix
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, labels, registry=reg, buckets=buckets).labels(model_name)

        self.ttft = histogram("engine:time_to_first_token_seconds",
                              "Time from request arrival to its first output token.", _TTFT_BUCKETS)
        self.itl = histogram("engine:inter_token_latency_seconds",
                             "Time between successive output tokens of one sample.", _ITL_BUCKETS)
        self.e2e = histogram("engine:e2e_request_latency_seconds",
                             "Time from request arrival to its last output token.", _E2E_BUCKETS)
        self.tpot = histogram("engine:time_per_output_token_seconds",
                              "Per request: (last token - first token) / (tokens - 1).",
                              _TPOT_BUCKETS)
        self.queue_time = histogram("engine:request_queue_time_seconds",
                                    "Arrival to the first engine step that computes the "
                                    "request.", _TTFT_BUCKETS)
        self.prefill_time = histogram("engine:request_prefill_time_seconds",
                                      "First engine step to first output token.", _E2E_BUCKETS)
        self.decode_time = histogram("engine:request_decode_time_seconds",
                                     "First output token to last.", _E2E_BUCKETS)
        self.inference_time = histogram("engine:request_inference_time_seconds",
                                        "First engine step to last output token.", _E2E_BUCKETS)
        self.request_prompt_tokens = histogram("engine:request_prompt_tokens",
                                               "Prompt tokens per request.", _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("engine:request_generation_tokens",
                                                   "Output tokens per request.", _TOKEN_BUCKETS)
        self.request_params_n = histogram("engine:request_params_n",
                                          "The n request parameter (samples per prompt), "
                                          "per prompt.", _N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "engine:request_params_max_tokens", "The max_tokens request parameter, per prompt "
            "(the room left in the context where the request sets none).", _TOKEN_BUCKETS)
        self.prompt_tokens = Counter("engine:prompt_tokens", "Prompt tokens submitted.",
                                     labels, registry=reg).labels(model_name)
        self.generation_tokens = Counter("engine:generation_tokens", "Output tokens generated.",
                                         labels, registry=reg).labels(model_name)
        # The same two counts as plain numbers, for the periodic stats line (stats_log.py).
        self.prompt_token_count = 0
        self.generation_token_count = 0
        self._success = Counter("engine:request_success",
                                "Finished samples by finish reason (stop, length, abort).",
                                ["model_name", "finished_reason"], registry=reg)
        reg.register(_EngineCollector(engine, model_name))
        reg.register(_StructuredCollector(engine, model_name))

    def success(self, finished_reason: str) -> None:
        self._success.labels(self.model_name, finished_reason).inc()

    def render(self) -> bytes:
        text = generate_latest(self.registry)
        if self.prefix == "engine":
            return text
        # Only metric names start a line (after "# HELP " or "# TYPE " on those lines);
        # label values never do, so this renames series and nothing else.
        return _PREFIX_AT_LINE_START.sub(rb"\1" + self.prefix.encode() + b":", text)

    def timer(self) -> RequestTimer:
        """Start timing one HTTP request now (its arrival)."""
        return RequestTimer(self)


class RequestTimer:
    """Feeds one request's token timings into the histograms.

    TTFT and end-to-end latency are per HTTP request (the first token of any sample, the
    last token of all); inter-token latency is per sample, one observation per output.
    """

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._arrival = time.monotonic()
        self._first = True
        self._last: dict[int, float] = {}
        self._prompt_tokens = 0
        self._generated = 0
        self._scheduled: float | None = None  # the first engine step of any of its samples
        self._first_token: float | None = None
        self._last_token: float | None = None

    def params(self, n: int, max_tokens: int) -> None:
        """One prompt's ``n`` and ``max_tokens`` (the effective one)."""
        self._metrics.request_params_n.observe(n)
        self._metrics.request_params_max_tokens.observe(max_tokens)

    def prompt(self, num_tokens: int) -> None:
        self._metrics.prompt_tokens.inc(num_tokens)
        self._metrics.prompt_token_count += num_tokens
        self._prompt_tokens += num_tokens

    def output(self, index: int, num_tokens: int, finish_reason: str | None,
               scheduled_time: float | None = None) -> None:
        t = time.monotonic()
        if scheduled_time is not None and (self._scheduled is None or scheduled_time < self._scheduled):
            self._scheduled = scheduled_time
        if num_tokens:
            self._metrics.generation_tokens.inc(num_tokens)
            self._metrics.generation_token_count += num_tokens
            self._generated += num_tokens
            if self._first:
                self._metrics.ttft.observe(t - self._arrival)
                self._first = False
                self._first_token = t
            elif index in self._last:
                self._metrics.itl.observe(t - self._last[index])
            self._last[index] = t
            self._last_token = t
        if finish_reason is not None:
            self._metrics.success(finish_reason)

    def done(self) -> None:
        m = self._metrics
        m.e2e.observe(time.monotonic() - self._arrival)
        m.request_prompt_tokens.observe(self._prompt_tokens)
        m.request_generation_tokens.observe(self._generated)
        first, last, scheduled = self._first_token, self._last_token, self._scheduled
        if scheduled is not None:
            # vLLM's queue time starts at the engine's arrival; here at the HTTP arrival
            # (tokenization included), on the same monotonic clock.
            m.queue_time.observe(max(0.0, scheduled - self._arrival))
        if first is None or last is None:
            return
        m.decode_time.observe(last - first)
        if self._generated > 1:
            m.tpot.observe((last - first) / (self._generated - 1))
        if scheduled is not None:
            m.prefill_time.observe(max(0.0, first - scheduled))
            m.inference_time.observe(max(0.0, last - scheduled))


# -- vLLM's reader (LLM.get_metrics) ---------------------------------------------------------


@dataclasses.dataclass
class ReadMetric:
    """One series as ``LLM.get_metrics()`` gives it (vLLM's ``Metric``): its name and labels."""

    name: str
    labels: dict[str, str]


@dataclasses.dataclass
class CounterValue(ReadMetric):
    """vLLM's ``Counter``: a count that only grows."""

    value: int


@dataclasses.dataclass
class GaugeValue(ReadMetric):
    """vLLM's ``Gauge``."""

    value: float


@dataclasses.dataclass
class HistogramValue(ReadMetric):
    """vLLM's ``Histogram``: ``buckets`` maps each upper bound (as Prometheus writes it,
    ``"+Inf"`` last) to the observations at or below it; ``count`` and ``sum`` of all."""

    count: int
    sum: float
    buckets: dict[str, int]


@dataclasses.dataclass
class VectorValue(ReadMetric):
    """vLLM's ``Vector``: the accepted speculative tokens by position (0 first)."""

    values: list[int]


_PER_POSITION = "engine:spec_decode_num_accepted_tokens_per_pos"


def snapshot(metrics: Metrics) -> list[ReadMetric]:
    """Every series of ``metrics`` now, named with its prefix, as vLLM's reader gives
    them: gauges, counters (the accepted-per-position counter as one vector),
    histograms."""
    out: list[ReadMetric] = []
    for family in metrics.registry.collect():
        name = metrics.prefix + family.name[family.name.index(":"):]

        def samples(suffix: str, family: Any = family) -> list[Any]:
            return [s for s in family.samples if s.name == family.name + suffix]

        if family.type == "gauge":
            out.extend(GaugeValue(name, dict(s.labels), s.value) for s in samples(""))
        elif family.type == "counter" and family.name == _PER_POSITION:
            by_labels: dict[tuple[tuple[str, str], ...], dict[int, int]] = {}
            for s in samples("_total"):
                rest = tuple(sorted((k, v) for k, v in s.labels.items() if k != "position"))
                by_labels.setdefault(rest, {})[int(s.labels["position"])] = int(s.value)
            for rest, counts in by_labels.items():
                values = [counts.get(i, 0) for i in range(max(counts) + 1)]
                out.append(VectorValue(name, dict(rest), values))
        elif family.type == "counter":
            out.extend(CounterValue(name, dict(s.labels), int(s.value)) for s in samples("_total"))
        elif family.type == "histogram":
            for total in samples("_count"):
                labels = dict(total.labels)
                buckets = {s.labels["le"]: int(s.value) for s in samples("_bucket")
                           if {k: v for k, v in s.labels.items() if k != "le"} == labels}
                (summed,) = (s.value for s in samples("_sum") if dict(s.labels) == labels)
                out.append(HistogramValue(name, labels, int(total.value), summed, buckets))
    return out
