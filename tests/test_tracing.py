"""vLLM's ``--otlp-traces-endpoint``: a ``llm_request`` span per finished request, sent
over OTLP to a collector, a child of the caller's W3C trace context when the HTTP request
carried one.

The collector here is a plain HTTP server that reads the OTLP/HTTP protobuf bodies with
OpenTelemetry's own protobuf classes; the expected counts come from the answers the
official ``openai`` client read."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import openai
import pytest
from http_server import ServerThread
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

import engine
from engine.errors import ConfigError
from engine.models.testing import write_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Collector:
    """An OTLP/HTTP trace receiver: every span it was sent, with its attributes."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        spans.extend(scope.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def attributes(span: Any) -> dict[str, Any]:
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


def pooled_usage(base_url: str, model: str) -> int:
    """The prompt tokens of one embeddings request (token ids) to the server at ``base_url``."""
    answer = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none").embeddings.create(
        model=model, input=[11, 12, 13, 14, 15, 16])
    return answer.usage.prompt_tokens


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tracing") / "llama", "llama")


def test_each_request_is_a_span_in_the_callers_trace(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    collector = Collector()
    try:
        with ServerThread(lambda: engine.open_engine(model=str(folder), otlp_traces_endpoint=collector.url)) as server:
            client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
            model = server.engine.model_name
            traced = client.completions.create(
                model=model, prompt=[5, 6, 7, 8], max_tokens=5, temperature=0.5, top_p=0.9, n=2,
                seed=1, extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
            streamed = client.completions.create(model=model, prompt=[9, 10], max_tokens=3,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True})
            usage = [c.usage for c in streamed if c.usage is not None][0]

        # A pooling request is a span too (no completion tokens): the same model served
        # as an embedder.
        with ServerThread(lambda: engine.open_engine(model=str(folder), runner="pooling",
                                                     otlp_traces_endpoint=collector.url)) as server:
            embedded = pooled_usage(server.base_url, server.engine.model_name)
        # Each engine's close flushed its batched spans.
    finally:
        collector.server.shutdown()
        collector.server.server_close()
    first, second, third = sorted(collector.spans, key=lambda s: s.start_time_unix_nano)
    c = attributes(third)
    assert (c["gen_ai.usage.prompt_tokens"], c["gen_ai.usage.completion_tokens"]) == (embedded, 0)
    assert first.name == second.name == "llm_request"
    assert first.kind == second.kind == 2  # SPAN_KIND_SERVER
    assert (first.trace_id.hex(), first.parent_span_id.hex()) == (TRACE_ID, PARENT_ID)
    assert second.parent_span_id == b"" and second.trace_id.hex() != TRACE_ID  # a new trace
    a, b = attributes(first), attributes(second)
    assert (a["gen_ai.usage.prompt_tokens"], a["gen_ai.usage.completion_tokens"]) == (
        traced.usage.prompt_tokens, traced.usage.completion_tokens)
    assert (b["gen_ai.usage.prompt_tokens"], b["gen_ai.usage.completion_tokens"]) == (
        usage.prompt_tokens, usage.completion_tokens)
    assert (a["gen_ai.request.n"], a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"],
            a["gen_ai.request.top_p"]) == (2, 5, 0.5, pytest.approx(0.9))
    assert a["gen_ai.response.model"] == model and a["gen_ai.request.id"]
    for span, attrs in ((first, a), (second, b)):
        e2e = attrs["gen_ai.latency.e2e"]
        assert 0 < attrs["gen_ai.latency.time_to_first_token"] <= e2e
        assert 0 <= attrs["gen_ai.latency.time_in_queue"] <= attrs["gen_ai.latency.time_to_first_token"]
        assert attrs["gen_ai.latency.time_in_model_inference"] <= e2e
        assert span.end_time_unix_nano - span.start_time_unix_nano == pytest.approx(e2e * 1e9, rel=1e-3)


async def test_an_unknown_protocol_is_refused_when_the_engine_opens(
        folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "carrier-pigeon")
    with pytest.raises(ConfigError, match="carrier-pigeon"):
        async with engine.open_engine(model=str(folder), otlp_traces_endpoint="http://127.0.0.1:9"):
            pass
