"""The self-healing engine over HTTP: a crash fails the streams in flight with an error
chunk at once, /health says 503 while the actors restart, the next request succeeds, and
past --max-engine-restarts `serve` exits non-zero for its supervisor."""

from __future__ import annotations

import argparse
import json
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from engine_helpers import tiny_model
from http_server import ServerThread

import engine
from engine.cli import serve as cli
from engine.runner.model_runner import ModelRunner

OPTIONS: dict[str, Any] = dict(dtype="float32", max_model_len=256, kv_cache_memory=4 * 1024 * 1024)
# An error chunk must follow a crash this fast (the bound).
ERROR_CHUNK_SECONDS = 1.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory)


@pytest.fixture
def crash_switch(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """While set, every model step raises out of the runner: the executor actor crashes."""
    switch = threading.Event()
    original = ModelRunner.execute

    def execute(self: ModelRunner, plan: Any) -> Any:
        if switch.is_set() and plan.chunks:
            switch.clear()
            raise RuntimeError("injected actor crash")
        return original(self, plan)

    monkeypatch.setattr(ModelRunner, "execute", execute)
    return switch


def _body(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"prompt": "Hello there", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": stream}


def test_a_crash_ends_streams_with_an_error_chunk_and_the_next_request_succeeds(
    model: Path, crash_switch: threading.Event
) -> None:
    opener = lambda: engine.open_engine(str(model), max_engine_restarts=2, **OPTIONS)  # noqa: E731
    with ServerThread(opener) as server, httpx.Client(base_url=server.base_url, timeout=60) as client:
        healthy = client.post("/v1/completions", json=_body(8, False)).json()["choices"][0]["text"]
        with client.stream("POST", "/v1/completions", json=_body(200, True)) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
            crash_switch.set()
            t0 = time.monotonic()
            events = [line for line in lines if line]
            elapsed = time.monotonic() - t0
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == "engine_dead" and "injected" not in error["message"]
        assert elapsed < ERROR_CHUNK_SECONDS
        deadline = time.monotonic() + 30
        while client.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        again = client.post("/v1/completions", json=_body(8, False))
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == healthy
        assert server.metric("engine:engine_restarts_total") == 1.0
        # While the actors restart, /health answers 503 without internal text.
        server.call(setattr, server.engine, "restarting", True)
        try:
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
            assert client.post("/v1/completions", json=_body(2, False)).status_code == 503
        finally:
            server.call(setattr, server.engine, "restarting", False)


def _counters(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every counter and histogram sample of a /metrics text, read by Prometheus's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            if family.type in ("counter", "histogram") for sample in family.samples}


def test_an_in_place_restart_never_sets_a_counter_back(
    model: Path, crash_switch: threading.Event
) -> None:
    """The engine's counters (steps, prefix-cache lookups, preemptions, ...) live in its
    scheduler and KV pool, which a restart builds afresh: /metrics must still never go
    back, as Prometheus reads a drop as a counter reset."""
    opener = lambda: engine.open_engine(str(model), max_engine_restarts=1, **OPTIONS)  # noqa: E731
    with ServerThread(opener) as server, httpx.Client(base_url=server.base_url, timeout=60) as client:
        for _ in range(2):
            assert client.post("/v1/completions", json=_body(8, False)).status_code == 200
        before = _counters(client.get("/metrics").text)
        crash_switch.set()
        assert client.post("/v1/completions", json=_body(8, False)).status_code == 503
        deadline = time.monotonic() + 30
        while client.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        restarted = _counters(client.get("/metrics").text)
        assert client.post("/v1/completions", json=_body(8, False)).status_code == 200
        after = _counters(client.get("/metrics").text)
    for earlier, later in ((before, restarted), (restarted, after)):
        assert [(k, v, later.get(k)) for k, v in earlier.items() if later.get(k, -1.0) < v] == []
    queries = ("engine:prefix_cache_queries_total",
               (("engine", "0"), ("model_name", server.engine.model_name)))
    assert after[queries] > restarted[queries] >= before[queries] > 0


async def test_serve_exits_non_zero_past_its_restart_limit(
    model: Path, crash_switch: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    parser = argparse.ArgumentParser()
    cli.add_serve_arguments(parser)
    # In this process: the crash switch reaches this process's model runner only (serve's
    # default would run the core apart where a CPU is free, as in a test worker).
    args = parser.parse_args(["--model", str(model), "--port", "0", "--dtype", "float32",
                              "--max-model-len", "256", "--kv-cache-memory", "4MiB",
                              "--max-engine-restarts", "1", "--engine-core", "inprocess"])
    caplog.set_level(logging.INFO, logger="engine.http")
    status: list[int] = []

    async def serve() -> None:
        status.append(await cli._serve(args))

    with trio.fail_after(120):  # hang guard: serve must return by itself
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            while not (match := re.search(r"listening on (http://\S+)", caplog.text)):  # noqa: ASYNC110 - a log line has no event
                await trio.sleep(0.01)
            async with httpx.AsyncClient(base_url=match.group(1), timeout=60) as client:
                for attempt in range(2):  # the first crash restarts, the second is past the limit
                    if attempt:
                        # Wait out the restart: a request that comes while the actors
                        # restart is a 503 with no step run, which would not crash again.
                        while (await client.get("/health")).status_code != 200:  # noqa: ASYNC110 - polled over HTTP
                            await trio.sleep(0.01)
                    crash_switch.set()
                    response = await client.post("/v1/completions", json=_body(4, False))
                    assert response.status_code == 503, response.text
    assert status == [cli.EXIT_ENGINE_DEAD]
    assert "restart limit (1) reached" in caplog.text or "dead after 1 restart" in caplog.text
