"""`python -m engine serve` as users run it: every flag and metric is documented, and a
signal drains in-flight requests under the deadline, then the process exits 0."""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from engine_helpers import tiny_model

from engine.http.cli import add_serve_arguments
from engine.http.metrics import METRIC_NAMES

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs" / "serving.md"

# The flags issue 5 lists for `serve`.
REQUIRED_FLAGS = (
    "--model", "--served-model-name", "--host", "--port", "--api-key", "--max-model-len",
    "--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--kv-cache-memory",
    "--max-queued-requests", "--max-request-bytes", "--dtype", "--device", "--log-level",
)
# Loading the tiny model takes a few seconds (mostly importing torch); this is a hang guard.
START_TIMEOUT = 120.0


def _serve_flags() -> list[str]:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return [opt for action in parser._actions for opt in action.option_strings
            if opt.startswith("--") and opt != "--help"]


def test_every_serve_flag_exists_and_is_documented() -> None:
    flags = _serve_flags()
    assert set(REQUIRED_FLAGS) <= set(flags)
    docs = DOCS.read_text()
    for flag in flags:
        assert f"| `{flag}" in docs, f"{flag} missing from the flag table of {DOCS.name}"


def test_engine_flags_become_engine_config_fields() -> None:
    from engine.http.cli import engine_options

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args([
        "--no-prefix-caching", "--scheduling-policy", "priority", "--no-async-scheduling",
        "--ops-backend", "torch", "--max-num-seqs", "8", "--kv-cache-memory", "64MiB",
    ])
    assert engine_options(args) == {
        "enable_prefix_caching": False, "scheduling_policy": "priority",
        "async_scheduling": False, "ops_backend": "torch", "max_num_seqs": 8,
        "kv_cache_memory": 64 * 2**20, "max_engine_restarts": 5,
    }
    # Unset flags keep the config's defaults, but for serve's own restart default (the
    # embedded API's is 0: a crash there is the caller's to see).
    assert engine_options(parser.parse_args([])) == {"max_engine_restarts": 5}


def test_every_metric_is_documented() -> None:
    docs = DOCS.read_text()
    for name in METRIC_NAMES:
        assert f"| `{name}" in docs, f"{name} missing from the metric table of {DOCS.name}"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory)


@contextmanager
def _server(model: Path, *flags: str) -> Iterator[tuple[subprocess.Popen[str], str, list[str]]]:
    """Start `python -m engine serve` on a free port; yield it, its URL and its log lines."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "serve", "--model", str(model), "--port", "0",
         "--max-model-len", "512", "--kv-cache-memory", "64MiB", "--log-level", "info",
         *flags],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=REPO, env=env,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    log: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while True:
            line = lines.get(timeout=START_TIMEOUT)
            assert line is not None, "".join(log)
            log.append(line)
            match = re.search(r"listening on (http://\S+)", line)
            if match:
                break
        yield proc, match.group(1), log
        proc.wait(timeout=START_TIMEOUT)
        while (line := lines.get(timeout=START_TIMEOUT)) is not None:
            log.append(line)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(START_TIMEOUT)
        assert proc.stderr is not None
        proc.stderr.close()


def _stream_body(max_tokens: int) -> dict[str, object]:
    return {"prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_lets_in_flight_streams_finish_then_exits_0(model: Path, signum: int) -> None:
    # A deadline far above the stream's length: on a shared 2-core machine under load the
    # 480 tokens took over the default 30 s, which cut the stream this test wants whole.
    with _server(model, "--shutdown-timeout", "300") as (proc, url, log):
        with httpx.stream("POST", url + "/v1/completions", json=_stream_body(480),
                          timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
            proc.send_signal(signum)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"] \
            == "length"
    assert proc.returncode == 0, "".join(log)
    text = "".join(log)
    assert f"{signal.Signals(signum).name}: draining" in text
    assert "shut down cleanly" in text


def test_the_drain_deadline_cuts_what_is_left_and_still_exits_0(model: Path) -> None:
    with _server(model, "--shutdown-timeout", "0.05") as (proc, url, log):
        with httpx.stream("POST", url + "/v1/completions", json=_stream_body(480),
                          timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
            proc.send_signal(signal.SIGTERM)
            received: list[str] = []
            with pytest.raises(httpx.HTTPError):  # the connection closes mid-body
                received.extend(line for line in lines if line)
        assert "data: [DONE]" not in received
    assert proc.returncode == 0, "".join(log)
