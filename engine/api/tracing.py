"""vLLM's ``--otlp-traces-endpoint``: one OpenTelemetry span per finished request
(generating, or each input of a pooling call), exported over OTLP, with vLLM's span name
and attributes.

Each request's span is ``llm_request`` (kind SERVER), from the request's arrival at the
engine to its last output, a child of the caller's trace where the HTTP request carried
W3C trace context (``traceparent``, ``tracestate``), else the root of a new trace. Its
attributes are vLLM's (``gen_ai.*``): the request id, the model, ``n``,
``max_tokens``, ``temperature`` and ``top_p``; the prompt and completion token counts;
and the latencies in seconds: time to first token, end to end, in the queue (arrival to
the first step that computes it), and the model's prefill, decode and inference times.

The exporter follows ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` as vLLM's does: ``grpc`` (the
default) or ``http/protobuf``, to the endpoint given. Spans leave in batches on the
OpenTelemetry SDK's own thread; the engine's close flushes them. The packages
(``opentelemetry-sdk``, ``opentelemetry-exporter-otlp``; ``pip install engine[otel]``) are
imported only when tracing is on.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from engine.errors import ConfigError
from engine.messages import RequestOutput
from engine.params import SamplingParams

TRACE_HEADERS = ("traceparent", "tracestate")
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


def trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The W3C trace context among an HTTP request's ``headers`` (case-insensitive ones,
    as quart's)."""
    return {name: headers[name] for name in TRACE_HEADERS if name in headers}


class Tracer:
    """The engine's OTLP tracer (the front end's process: where requests arrive and end)."""

    def __init__(self, endpoint: str, model_name: str) -> None:
        try:
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise ConfigError(f"otlp_traces_endpoint needs OpenTelemetry: pip install "
                              f"opentelemetry-sdk opentelemetry-exporter-otlp ({exc})",
                              field="otlp_traces_endpoint") from None
        protocol = os.environ.get(PROTOCOL_ENV, "grpc")
        try:
            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            elif protocol == "http/protobuf":
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
                    OTLPSpanExporter,
                )
            else:
                raise ConfigError(f"{PROTOCOL_ENV}={protocol!r}: grpc or http/protobuf",
                                  field="otlp_traces_endpoint")
        except ImportError as exc:
            raise ConfigError(f"otlp_traces_endpoint over {protocol} needs its OTLP exporter: "
                              f"pip install opentelemetry-exporter-otlp ({exc})",
                              field="otlp_traces_endpoint") from None
        self.model_name = model_name
        self._kind = SpanKind.SERVER
        self._propagator = TraceContextTextMapPropagator()
        # A provider of its own (not the process's global one): two engines in a process
        # trace to their own endpoints.
        self._provider = TracerProvider()
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("engine")

    def request(self, request_id: str, prompt_tokens: int, samples: int,
                params: SamplingParams | None, headers: Mapping[str, str] | None) -> RequestTrace:
        """Start timing one request now (its arrival at the engine)."""
        return RequestTrace(self, request_id, prompt_tokens, samples, params, headers or {})

    def close(self) -> None:
        """Export what is left (blocking: call it off the event loop)."""
        self._provider.shutdown()

    def _emit(self, trace: RequestTrace, end: float) -> None:
        def ns(t: float) -> int:  # a monotonic time as the wall clock's nanoseconds
            return trace.start_ns + int((t - trace.arrival) * 1e9)

        span = self._tracer.start_span("llm_request", context=self._propagator.extract(trace.headers),
                                       kind=self._kind, start_time=trace.start_ns)
        p = trace.params
        attributes: dict[str, Any] = {
            "gen_ai.request.id": trace.request_id,
            "gen_ai.response.model": self.model_name,
            "gen_ai.request.n": trace.samples,
            "gen_ai.usage.prompt_tokens": trace.prompt_tokens,
            "gen_ai.usage.completion_tokens": trace.completion_tokens,
            "gen_ai.latency.e2e": end - trace.arrival,
        }
        if p is not None:
            if p.max_tokens is not None:
                attributes["gen_ai.request.max_tokens"] = p.max_tokens
            attributes["gen_ai.request.temperature"] = p.temperature
            attributes["gen_ai.request.top_p"] = p.top_p
        first, last, scheduled = trace.first_token, trace.last_token, trace.scheduled
        if first is not None and last is not None:
            attributes["gen_ai.latency.time_to_first_token"] = first - trace.arrival
            attributes["gen_ai.latency.time_in_model_decode"] = last - first
        if scheduled is not None:
            attributes["gen_ai.latency.time_in_queue"] = max(0.0, scheduled - trace.arrival)
            if first is not None and last is not None:
                attributes["gen_ai.latency.time_in_model_prefill"] = max(0.0, first - scheduled)
                attributes["gen_ai.latency.time_in_model_inference"] = max(0.0, last - scheduled)
        span.set_attributes(attributes)
        span.end(end_time=ns(end))


class RequestTrace:
    """One request's times and counts, fed with its outputs; its span is emitted when
    every sample has finished."""

    __slots__ = ("_tracer", "arrival", "completion_tokens", "first_token", "headers",
                 "last_token", "params", "prompt_tokens", "request_id", "samples",
                 "scheduled", "start_ns", "_open")

    def __init__(self, tracer: Tracer, request_id: str, prompt_tokens: int, samples: int,
                 params: SamplingParams | None, headers: Mapping[str, str]) -> None:
        self._tracer = tracer
        self.arrival = time.monotonic()
        self.start_ns = time.time_ns()
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.samples = samples
        self.params = params
        self.headers = dict(headers)
        self.completion_tokens = 0
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.scheduled: float | None = None
        self._open = samples  # samples not yet finished

    def seen(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if out.scheduled_time is not None and (self.scheduled is None or out.scheduled_time < self.scheduled):
            self.scheduled = out.scheduled_time
        if out.token_ids:
            self.completion_tokens += len(out.token_ids)
            if self.first_token is None:
                self.first_token = now
            self.last_token = now
        if out.finished:
            self._open -= 1
            if self._open == 0:
                self._tracer._emit(self, now)
