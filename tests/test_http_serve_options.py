"""`python -m engine serve` with what users bring from vLLM: its flags (taken, mapped or
refused with a message naming them), a Unix socket, and connections past the open-file
limit."""

from __future__ import annotations

import contextlib
import json
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
            args.tensor_parallel_size, args.enforce_eager) == ("some/model", "guidance", "warning", 3, True)
    assert [n.split(":")[0] for n in args.vllm_no_ops] == ["--trust-remote-code"]
    # vLLM's older --disable-log-requests is the request log's default: off.
    assert args.enable_log_requests is False
    assert _serve_parser().parse_args(["serve", "m", "--enable-log-requests"]).enable_log_requests
    # -pp is vLLM's short name of the pipeline's stage count.
    assert _serve_parser().parse_args(["serve", "m", "-pp", "3"]).pipeline_parallel_size == 3
    # An unknown flag is still argparse's own error, naming it.
    assert "--frobnicate" in _usage_error(capsys, "--frobnicate")


def test_vllm_flags_taken_at_the_value_that_is_this_servers_and_refused_at_others(capsys) -> None:
    from engine.cli.args import config_from_args

    args = _serve_parser().parse_args([
        "serve", "m", "--swap-space", "16", "--tokenizer-mode", "auto", "--load-format", "auto",
        "--api-server-count", "1",
        "--hf-overrides", '{"rope_theta": 500.0}', "--num-gpu-blocks-override", "64"])
    assert [n.split(":")[0] for n in args.vllm_no_ops] == ["--swap-space", "--tokenizer-mode",
                                                           "--load-format", "--api-server-count"]
    config = config_from_args(args)
    assert (json.loads(config.hf_overrides), config.num_gpu_blocks_override) == ({"rope_theta": 500.0}, 64)
    for option, value, only in (("--tokenizer-mode", "mistral", "auto"), ("--load-format", "pt", "auto"),
                                ("--api-server-count", "4", "1")):
        err = _usage_error(capsys, option, value)
        assert f"{option} {value} (a vLLM flag) is not supported" in err and f"only {only}" in err
    err = _usage_error(capsys, "--rope-scaling", '{"rope_type": "linear", "factor": 2}')
    assert "--hf-overrides" in err
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="hf_overrides must be a non-empty JSON object"):
        config_from_args(_serve_parser().parse_args(["serve", "m", "--hf-overrides", "[1, 2]"]))


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


_HEALTH = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
# The figure a refused connection must meet: answered (or closed) within this, where one
# left in the listen backlog waited for a descriptor to come back (seconds at best).
REFUSED_WITHIN_SECONDS = 1.0


def _answer(sock: socket.socket) -> bytes:
    """All the server sends until the head of a response (b"" if it closed first)."""
    data = b""
    while b"\r\n\r\n" not in data:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return data
        data += chunk
    return data


def _check_refused(sock: socket.socket, started: float) -> None:
    """``sock`` is answered with a 503 in OpenAI's error shape, or closed, at once."""
    data = _answer(sock)
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    assert time.monotonic() - started < REFUSED_WITHIN_SECONDS
    if data:  # a close alone is allowed too
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower(), head
        assert json.loads(body)["error"]["code"] == "too_many_connections"


def _refused_burst(host: str, port: int, count: int) -> None:
    """``count`` connections at once, each sending a request: every one is refused within
    :data:`REFUSED_WITHIN_SECONDS` (non-blocking, so none waits on another)."""
    import select

    started = time.monotonic()
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        poller = select.poll()
        for s in socks:
            s.setblocking(False)
            s.connect_ex((host, port))
            poller.register(s, select.POLLOUT)
        waiting = {s.fileno(): s for s in socks}
        sent: dict[int, socket.socket] = {}
        deadline = started + REFUSED_WITHIN_SECONDS
        while (waiting or sent) and time.monotonic() < deadline:
            for fd, _ in poller.poll(50):
                if fd in waiting:  # connected (or refused by the kernel): send the request
                    s = waiting.pop(fd)
                    with contextlib.suppress(OSError):
                        s.send(_HEALTH)
                    poller.modify(s, select.POLLIN)
                    sent[fd] = s
                elif fd in sent:  # the answer (or the close) is there
                    s = sent.pop(fd)
                    poller.unregister(s)
                    s.setblocking(True)
                    s.settimeout(REFUSED_WITHIN_SECONDS)
                    _check_refused(s, started)
        assert not waiting and not sent, (
            f"{len(waiting) + len(sent)} of {count} connections not refused within "
            f"{REFUSED_WITHIN_SECONDS} s")
    finally:
        for s in socks:
            s.close()


def test_out_of_descriptors_new_connections_are_refused_at_once_and_service_resumes(
        model) -> None:
    # Regression: with every descriptor taken, new connections waited in the listen
    # backlog (trio retried accept every 0.1 s) until a descriptor came back; and a
    # connection the client closed kept its descriptor until its keep-alive timer ran out.
    # A soft limit of 64 stands in for a distribution's default (1024) to keep the test
    # cheap; serve raises it to the hard limit (128), which the connections then use up.
    soft, hard = 64, 128
    with _serve(str(model), "--port", "0", nofile=(soft, hard)) as (proc, url, log):
        assert _open_file_limit(proc.pid) == (hard, hard)
        host, port = re.match(r"http://([^:]+):(\d+)", url).groups()  # type: ignore[union-attr]
        before = len(log)
        held: list[socket.socket] = []
        try:
            # Idle keep-alive connections, each answered at once, until one is not answered
            # 200: the server is out of descriptors. All within the keep-alive timeout (5 s),
            # which would close the first ones. (A connection left in the backlog fails
            # here, on the read's timeout.)
            for _ in range(hard):
                sock = socket.create_connection((host, int(port)), timeout=START_TIMEOUT)
                held.append(sock)
                sock.settimeout(REFUSED_WITHIN_SECONDS)
                sock.sendall(_HEALTH)
                if not _answer(sock).startswith(b"HTTP/1.1 200"):
                    break
            else:
                pytest.fail(f"{hard} connections did not use up {hard} descriptors")
            sock.close()  # it was refused: a 503 or a close (checked below, anew)
            with socket.create_connection((host, int(port)), timeout=START_TIMEOUT) as sock:
                started = time.monotonic()
                sock.sendall(_HEALTH)
                _check_refused(sock, started)
            # A flood is refused as fast, while the held connections stay open.
            _refused_burst(host, int(port), 100)
        finally:
            for sock in held:
                sock.close()
        # The closed connections' descriptors come back at once (not after the keep-alive
        # timeout): the server answers again.
        deadline = time.monotonic() + REFUSED_WITHIN_SECONDS
        while True:
            with socket.create_connection((host, int(port)), timeout=START_TIMEOUT) as sock:
                sock.sendall(_HEALTH)
                if _answer(sock).startswith(b"HTTP/1.1 200"):
                    break
            assert time.monotonic() < deadline, "".join(log[before:])
            time.sleep(0.05)
        flood_log = log[before:]
        # One line for the whole flood (at most one per 10 s), and no traceback.
        assert len([line for line in flood_log if "out of file descriptors" in line]) == 1, \
            flood_log
        assert not any("Traceback" in line or "EMFILE" in line for line in flood_log), flood_log
        assert proc.poll() is None
