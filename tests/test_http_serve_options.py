"""`python -m engine serve` with what users bring from vLLM: its flags (taken, mapped or
refused with a message naming them), a Unix socket, and a flood of connections past the
open-file limit."""

from __future__ import annotations

import os
import queue
import re
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from engine_helpers import tiny_model

from engine.cli.args import VLLM_SERVE_FLAGS

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs" / "serving.md"
START_TIMEOUT = 120.0  # a hang guard: loading the tiny model takes seconds


def _serve_parser() -> Any:
    from engine.cli import build_parser

    return build_parser(["serve"])


def _usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        _serve_parser().parse_args(["serve", *argv])
    assert info.value.code == 2
    return capsys.readouterr().err


# -- vLLM's flags ---------------------------------------------------------------------------


@pytest.mark.parametrize("option", [o for o, f in VLLM_SERVE_FLAGS.items()
                                    if f.action == "refuse"])
def test_a_refused_vllm_flag_is_a_usage_error_naming_it_and_why(capsys, option) -> None:
    flag = VLLM_SERVE_FLAGS[option]
    argv = [option] if not flag.takes_value else [option, "1"]
    err = _usage_error(capsys, *argv)
    assert f"{option} is a vLLM flag this server does not support: {flag.reason}" in err
    assert "Traceback" not in err


def test_vllm_flags_that_map_or_do_nothing_are_taken(capsys) -> None:
    args = _serve_parser().parse_args([
        "serve", "some/model", "--guided-decoding-backend", "guidance", "--trust-remote-code",
        "-tp", "3", "--enforce-eager", "--uvicorn-log-level", "warning",
        "--disable-log-requests"])
    assert (args.model_tag, args.structured_outputs_backend, args.log_level,
            args.tensor_parallel_size) == ("some/model", "guidance", "warning", 3)
    assert [n.split(":")[0] for n in args.vllm_no_ops] == \
        ["--trust-remote-code", "--enforce-eager", "--disable-log-requests"]
    err = _usage_error(capsys, "--pipeline-parallel-size", "2")
    assert "--pipeline-parallel-size 2 (a vLLM flag) is not supported" in err
    # An unknown flag is still argparse's own error, naming it.
    assert "--frobnicate" in _usage_error(capsys, "--frobnicate")


def test_every_vllm_flag_is_in_the_docs() -> None:
    rows = [line for line in DOCS.read_text().splitlines() if line.startswith("| `")]
    for option in VLLM_SERVE_FLAGS:
        assert any(f"`{option}`" in row for row in rows), option


def test_the_model_as_a_positional_argument_is_the_model(tmp_path) -> None:
    from engine.cli.serve import model_from_tag

    args = _serve_parser().parse_args(["serve", "a/b"])
    model_from_tag(args)
    assert args.model == "a/b"
    args = _serve_parser().parse_args(["serve", "a/b", "--model", "c/d"])
    with pytest.raises(ValueError, match="given twice"):
        model_from_tag(args)


# -- a server in a subprocess -------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory)


@contextmanager
def _serve(*flags: str, nofile: tuple[int, int] | None = None
           ) -> Iterator[tuple[subprocess.Popen[str], str, list[str]]]:
    """`python -m engine serve ...`; yields it, where it listens and its log lines so far
    (the list grows as it logs)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def limits() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "serve", "--max-model-len", "256",
         "--kv-cache-memory", "16MiB", "--log-level", "info", *flags],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=REPO, env=env,
        preexec_fn=limits)
    lines: queue.Queue[str | None] = queue.Queue()
    log: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line)
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while True:
            line = lines.get(timeout=START_TIMEOUT)
            assert line is not None, "".join(log)
            match = re.search(r"listening on (\S+)", line)
            if match:
                break
        yield proc, match.group(1), log
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(START_TIMEOUT)
        assert proc.stderr is not None
        proc.stderr.close()


def test_serve_on_a_unix_socket_with_a_root_path(model: Path, tmp_path: Path) -> None:
    path = str(tmp_path / "engine.sock")
    with _serve(str(model), "--uds", path, "--root-path", "/llm") as (_, where, _log):
        assert path in where
        transport = httpx.HTTPTransport(uds=path)
        with httpx.Client(transport=transport, base_url="http://engine") as http, \
                openai.OpenAI(base_url="http://engine/llm/v1", api_key="x", max_retries=0,
                              http_client=http) as client:
            assert http.get("/health").status_code == 200
            name = client.models.list().data[0].id
            reply = client.completions.create(model=name, prompt="Hello", max_tokens=3)
            assert reply.choices[0].finish_reason == "length"
    assert not os.path.exists(path)  # removed on shutdown


def _open_file_limit(pid: int) -> tuple[int, int]:
    """The process's open-file limits (soft, hard), from /proc."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open-file limit in /proc")


def _hold_connections(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` connections, each holding the server with a request head whose body never
    comes (so it stays open for the body timeout, not the 5 s keep-alive one). Connects are
    non-blocking: past the server's accept queue a connect stays pending, retried by the
    kernel."""
    import select

    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
    conns, pending = [], {}
    poller = select.poll()
    for _ in range(count):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.connect_ex((host, port))
        conns.append(s)
        pending[s.fileno()] = s
        poller.register(s, select.POLLOUT)
    deadline = time.monotonic() + 20
    while pending and time.monotonic() < deadline:
        for fd, _ in poller.poll(100):
            s = pending.pop(fd)
            poller.unregister(fd)
            try:
                s.send(head)
            except OSError:
                pass  # refused: the server is out of descriptors or its queue is full
    return conns


def test_a_flood_past_the_open_file_limit_logs_little_and_the_server_recovers(model) -> None:
    # A soft limit of 256 stands in for a distribution's default (1024) to keep the test
    # cheap; serve raises it to the hard limit (600), and the flood goes past that too.
    soft, hard, count = 256, 600, 800
    with _serve(str(model), "--port", "0", nofile=(soft, hard)) as (proc, url, log):
        assert _open_file_limit(proc.pid) == (hard, hard)
        host, port = re.match(r"http://([^:]+):(\d+)", url).groups()  # type: ignore[union-attr]
        before = len(log)
        started = time.monotonic()
        conns = _hold_connections(host, int(port), count)
        try:
            # The server accepts until it has no descriptor left, then retries every 0.1 s.
            deadline = time.monotonic() + 60
            while not any("accept returned" in line for line in log[before:]):
                assert time.monotonic() < deadline, "".join(log[before:])
                time.sleep(0.1)
            time.sleep(1.0)  # ten more retries, none of them logged
        finally:
            for s in conns:
                s.close()
        elapsed = time.monotonic() - started
        # The descriptors come back; the server answers again.
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "".join(log[before:])
            time.sleep(0.2)
        flood_log = log[before:]
        accept_lines = [line for line in flood_log if "accept returned" in line]
        # One line per 10 s at most (trio logs one with a traceback every 0.1 s).
        assert 1 <= len(accept_lines) <= 1 + elapsed / 10, flood_log
        assert "EMFILE" in accept_lines[0] and "WARNING" in accept_lines[0]
        assert not any("Traceback" in line for line in flood_log), flood_log
        assert len(flood_log) <= 2 * len(accept_lines), flood_log
        assert proc.poll() is None
