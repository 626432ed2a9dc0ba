"""Prometheus metrics under vLLM's names with the prefix ``engine:``.

Each app owns a :class:`prometheus_client.CollectorRegistry`, so two servers in one process
(tests) never share counters. Gauges and the engine's cumulative counters (preemptions,
prefix-cache queries and hits) are read from ``engine.statistics()`` at scrape time; the
latency histograms and the token and success counters are fed by the HTTP handlers through
one :class:`RequestTimer` per request.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket edges follow vLLM's: CPU serving spans milliseconds to minutes.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# Every metric name this module exports, for the docs and the tests.
METRIC_NAMES = (
    "engine:num_requests_running",
    "engine:num_requests_waiting",
    "engine:kv_cache_usage_perc",
    "engine:num_preemptions_total",
    "engine:prefix_cache_queries_total",
    "engine:prefix_cache_hits_total",
    "engine:prompt_tokens_total",
    "engine:generation_tokens_total",
    "engine:request_success_total",
    "engine:time_to_first_token_seconds",
    "engine:inter_token_latency_seconds",
    "engine:e2e_request_latency_seconds",
)


class _EngineCollector(Collector):
    """Reads the engine's statistics snapshot on every scrape."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self._engine = engine
        self._labels = [model_name]

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.statistics()
        yield self._gauge("engine:num_requests_running",
                          "Requests in the running batch.", stats.running)
        yield self._gauge("engine:num_requests_waiting",
                          "Requests waiting to be scheduled.", stats.waiting)
        used = stats.kv_blocks_total - stats.kv_blocks_free
        usage = used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
        yield self._gauge("engine:kv_cache_usage_perc",
                          "Fraction of KV-cache blocks held by requests (1 = full).", usage)
        yield self._counter("engine:num_preemptions",
                            "Preemptions (requests evicted and later recomputed).",
                            stats.preemptions)
        yield self._counter("engine:prefix_cache_queries",
                            "Prompt tokens looked up in the prefix cache.",
                            stats.prefix_cache_queries)
        yield self._counter("engine:prefix_cache_hits",
                            "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits)

    def _gauge(self, name: str, doc: str, value: float) -> Metric:
        family = GaugeMetricFamily(name, doc, labels=["model_name"])
        family.add_metric(self._labels, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric(self._labels, value)
        return family


class Metrics:
    """The metrics of one server: a registry, its histograms and counters."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry
        self.ttft = Histogram("engine:time_to_first_token_seconds",
                              "Time from request arrival to its first output token.",
                              labels, registry=reg, buckets=_TTFT_BUCKETS).labels(model_name)
        self.itl = Histogram("engine:inter_token_latency_seconds",
                             "Time between successive output tokens of one sample.",
                             labels, registry=reg, buckets=_ITL_BUCKETS).labels(model_name)
        self.e2e = Histogram("engine:e2e_request_latency_seconds",
                             "Time from request arrival to its last output token.",
                             labels, registry=reg, buckets=_E2E_BUCKETS).labels(model_name)
        self.prompt_tokens = Counter("engine:prompt_tokens", "Prompt tokens submitted.",
                                     labels, registry=reg).labels(model_name)
        self.generation_tokens = Counter("engine:generation_tokens", "Output tokens generated.",
                                         labels, registry=reg).labels(model_name)
        self._success = Counter("engine:request_success",
                                "Finished samples by finish reason (stop, length, abort).",
                                ["model_name", "finished_reason"], registry=reg)
        reg.register(_EngineCollector(engine, model_name))

    def success(self, finished_reason: str) -> None:
        self._success.labels(self.model_name, finished_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

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

    def prompt(self, num_tokens: int) -> None:
        self._metrics.prompt_tokens.inc(num_tokens)

    def output(self, index: int, num_tokens: int, finish_reason: str | None) -> None:
        t = time.monotonic()
        if num_tokens:
            self._metrics.generation_tokens.inc(num_tokens)
            if self._first:
                self._metrics.ttft.observe(t - self._arrival)
                self._first = False
            elif index in self._last:
                self._metrics.itl.observe(t - self._last[index])
            self._last[index] = t
        if finish_reason is not None:
            self._metrics.success(finish_reason)

    def done(self) -> None:
        self._metrics.e2e.observe(time.monotonic() - self._arrival)
