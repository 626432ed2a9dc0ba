"""`python -m engine serve` as users run it: every flag and metric is documented, and a
signal drains in-flight requests under the deadline, then the process exits 0."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import io
import json
import logging
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from engine_helpers import tiny_model

from engine.api.metrics import METRIC_NAMES
from engine.cli.serve import add_serve_arguments

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
    from engine.cli.args import config_from_args
    from engine.config import EngineConfig

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args([
        "--no-prefix-caching", "--scheduling-policy", "priority", "--no-async-scheduling",
        "--ops-backend", "torch", "--max-num-seqs", "8", "--kv-cache-memory", "64MiB",
        "--structured-outputs-backend", "guidance",
    ])
    assert config_from_args(args) == dataclasses.replace(
        EngineConfig(), enable_prefix_caching=False, scheduling_policy="priority",
        async_scheduling=False, ops_backend="torch", max_num_seqs=8,
        kv_cache_memory=64 * 2**20, max_engine_restarts=5, structured_outputs_backend="guidance",
        grammar_compile_workers=2, engine_core="auto",
    )
    # Unset flags keep the config's defaults, but for serve's own restart default (the
    # embedded API's is 0: a crash there is the caller's to see), its grammar compile
    # processes (the embedded API compiles in threads) and its engine core's place (the
    # embedded API's stays in the caller's process).
    assert config_from_args(parser.parse_args([])) == EngineConfig(
        max_engine_restarts=5, grammar_compile_workers=2, engine_core="auto")


def test_every_metric_is_documented() -> None:
    docs = DOCS.read_text()
    for name in METRIC_NAMES:
        assert f"| `{name}" in docs, f"{name} missing from the metric table of {DOCS.name}"


def _parser(command: str) -> argparse.ArgumentParser:
    from engine.cli import build_parser

    argv = [command]
    return build_parser(argv)._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_engine_config_field_is_a_flag_of_generate_and_serve(command: str) -> None:
    # Regression: generate and serve had two hand-written flag tables with different
    # defaults (--dtype "auto" in one, None in the other) and generate lacked --seed,
    # --scheduling-policy, --generation-config, ...
    from engine.cli.args import config_from_args
    from engine.config import EngineConfig

    parser = _parser(command)
    options = {opt for action in parser._actions for opt in action.option_strings}
    for field in dataclasses.fields(EngineConfig):
        assert "--" + field.name.replace("_", "-") in options, field.name
    argv = ["--prompt", "Hi"] if command == "generate" else []
    restarts = 5 if command == "serve" else 0  # serve restarts a crashed engine
    workers = 2 if command == "serve" else 0  # serve compiles grammars in processes
    core = "auto" if command == "serve" else "inprocess"  # serve's core may run apart
    assert config_from_args(parser.parse_args(argv)) == EngineConfig(
        max_engine_restarts=restarts, grammar_compile_workers=workers, engine_core=core)
    config = config_from_args(parser.parse_args([*argv, "--structured-outputs-backend", "xgrammar",
                                                  "--seed", "7", "--no-enable-prefix-caching"]))
    assert (config.structured_outputs_backend, config.seed, config.enable_prefix_caching) == \
        ("xgrammar", 7, False)
    with pytest.raises(SystemExit):  # argparse's usage error: not one of the choices
        parser.parse_args([*argv, "--structured-outputs-backend", "outlines"])


def test_a_bad_engine_option_is_a_config_error_naming_the_field() -> None:
    from engine.config import EngineConfig
    from engine.errors import ConfigError, InvalidParamError

    with pytest.raises(ConfigError) as info:
        EngineConfig(block_size=12)
    assert info.value.field == "block_size" and isinstance(info.value, ValueError)
    assert not isinstance(info.value, InvalidParamError)  # that one is a request's own
    with pytest.raises(ConfigError, match="structured_outputs_backend"):
        EngineConfig(structured_outputs_backend="outlines")


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_help_shows_every_default(command: str) -> None:
    from engine.cli.help import HelpFormatter

    formatter = HelpFormatter("python -m engine")
    for action in _parser(command)._actions:
        if isinstance(action, argparse._HelpAction) or action.default == argparse.SUPPRESS:
            continue  # --help, and aliases (--no-prefix-caching) whose flag shows the default
        text = formatter._get_help_string(action) or ""
        assert "(default" in text or action.required, action.option_strings


def test_version_comes_from_the_package_metadata() -> None:
    import importlib.metadata

    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-m", "engine", "--version"], capture_output=True,
                            text=True, cwd=REPO, env=env, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["python", "-m", "engine", importlib.metadata.version("engine")]


def test_a_port_in_use_is_one_line_and_a_non_zero_exit_before_the_model_loads() -> None:
    # Regression: a port clash used to cost a full model load and then a 70-line traceback.
    # The model does not exist: had loading started first, the error would name it.
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "engine", "serve", "--port", str(port), "--model",
             "/no/such/model"], capture_output=True, text=True, cwd=REPO, env=env,
            timeout=START_TIMEOUT, check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in lines[0]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _terminal_rows(text: str) -> list[str]:
    """The rows a terminal shows for ``text``: a carriage return goes back to column 0 and
    what follows overwrites the row (the way tqdm redraws and clears its bar)."""
    rows = []
    for line in text.split("\n"):
        row: list[str] = []
        column = 0
        for char in line:
            if char == "\r":
                column = 0
                continue
            row[column:column + 1] = [char]
            column += 1
        rows.append("".join(row).rstrip())
    return [row for row in rows if row]


def test_startup_log_lines_do_not_garble_the_load_progress_bar(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    # Regression: on a terminal each startup log line was written into the middle of the
    # progress bar's row ("loading model:  25%|##5 ...INFO engine: weights loaded").
    from engine.cli import serve as cli

    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [handler])
    caplog.set_level(logging.INFO)  # setLevel, which also clears the loggers' level caches
    phases = ["weights loaded", "tokenizer loaded", "KV pool sized", "warmed up"]
    with cli._LoadProgress() as progress:
        for phase in phases:
            logging.getLogger("engine").info(phase)
        progress.close()
        logging.getLogger("engine.http").info("engine ready")
    assert "loading model" in terminal.getvalue()  # the bar did show
    assert _terminal_rows(terminal.getvalue()) == [
        *(f"engine: {phase}" for phase in phases), "engine.http: engine ready"]
    assert root.handlers == [handler]  # the console handler is back as it was


def _examples() -> tuple[list[str], str]:
    """The shell commands and the Python program of docs/serving.md's "Examples"."""
    section = DOCS.read_text().split("\n## Examples\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.DOTALL)
    (shell,) = [body for lang, body in blocks if lang == "sh"]
    (python,) = [body for lang, body in blocks if lang == "python"]
    return [command for command in shell.split("\n\n") if command.strip()], python


@pytest.mark.slow
def test_the_docs_examples_run_against_the_default_model() -> None:
    # Regression: the docs' first curl example answered 404, the default model being
    # served as SmolLM2-135M-Instruct.Q4_1 while the docs send SmolLM2-135M-Instruct.
    commands, program = _examples()
    assert len(commands) == 2
    with _server(None) as (proc, url, log):
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == \
            ["SmolLM2-135M-Instruct"]
        outputs = []
        for command in commands:
            assert "http://127.0.0.1:8000" in command
            result = subprocess.run(["bash", "-c", command.replace("http://127.0.0.1:8000", url)],
                                    capture_output=True, text=True, timeout=300, check=False)
            assert result.returncode == 0, result.stderr
            outputs.append(result.stdout)
        completion = json.loads(outputs[0])
        assert completion["object"] == "text_completion", completion
        assert completion["model"] == "SmolLM2-135M-Instruct"
        assert completion["usage"]["completion_tokens"] >= 1
        events = [line.removeprefix("data: ") for line in outputs[1].splitlines() if line]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
        assert 'base_url="http://127.0.0.1:8000/v1"' in program
        env = dict(os.environ, PYTHONPATH=str(REPO))
        result = subprocess.run(
            [sys.executable, "-c", program.replace("http://127.0.0.1:8000", url)],
            capture_output=True, text=True, timeout=300, cwd=REPO, env=env, check=False)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip()
        proc.send_signal(signal.SIGTERM)
    assert proc.returncode == 0, "".join(log)


def _tool_calling_curls() -> list[str]:
    """The curl commands of docs/serving.md's "Tool calling"."""
    section = DOCS.read_text().split("\n## Tool calling\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.DOTALL)
    return [body for lang, body in blocks if lang == "sh"]


@pytest.mark.parametrize("which", ["tiny", pytest.param("default", marks=pytest.mark.slow)])
def test_the_docs_tool_calling_round_trip_runs_as_written(which: str, tmp_path: Path) -> None:
    """Both legs of the curl round trip: a named call, then that call and its result sent
    back and answered. The tiny model's template ignores tools, as the default model's
    does, so both go through the fallback tool prompt."""
    from chat_fixtures import write_marker_model
    from http_server import ServerThread

    import engine.api
    from engine.models.loader import default_model_path
    from engine.models.testing import CHATML_TEMPLATE

    first, second = _tool_calling_curls()
    # (The tiny marker model has the 2048 positions the fallback prompt needs. The commands
    # carry no seed: they draw from the engine's generator, seeded by --seed (0), and run
    # one at a time, so the random model's call ends the same way every run.)
    path = (write_marker_model(tmp_path / "m", CHATML_TEMPLATE) if which == "tiny"
            else default_model_path())
    with ServerThread(lambda: engine.api.open_engine(
            str(path), max_model_len=1536, kv_cache_memory=64 * 2**20)) as server:
        replies = []
        for command in (first, second):
            assert "http://127.0.0.1:8000" in command
            result = subprocess.run(
                ["bash", "-c", command.replace("http://127.0.0.1:8000", server.base_url)],
                capture_output=True, text=True, timeout=300, check=False)
            assert result.returncode == 0, result.stderr
            replies.append(json.loads(result.stdout))
    called, answered = (reply["choices"][0] for reply in replies)
    assert called["finish_reason"] == "stop", called  # a named call's, as OpenAI's
    (call,) = called["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert isinstance(json.loads(call["function"]["arguments"])["city"], str)
    # The answer is text, or (tools still on offer, "auto") another call.
    assert answered["finish_reason"] in ("stop", "length", "tool_calls"), answered
    assert isinstance(answered["message"]["content"], str) or answered["message"]["tool_calls"]
    assert replies[1]["usage"]["completion_tokens"] <= 100
    assert replies[1]["usage"]["prompt_tokens"] > replies[0]["usage"]["prompt_tokens"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory)


@contextmanager
def _server(model: Path | None, *flags: str, launch: tuple[str, ...] = ("-m", "engine"),
            env: dict[str, str] | None = None,
            ) -> Iterator[tuple[subprocess.Popen[str], str, list[str]]]:
    """Start `python -m engine serve` on a free port (``model`` None: the default model);
    yield it, its URL and its log lines. ``launch`` replaces ``-m engine``; ``env`` adds
    to the environment."""
    env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    model_flags = [] if model is None else ["--model", str(model)]
    proc = subprocess.Popen(
        [sys.executable, *launch, "serve", *model_flags, "--port", "0",
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


def _parent_pid(pid: int) -> int:
    # /proc/PID/stat: "PID (COMM) STATE PPID ..."; COMM may hold spaces, so split after ")".
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def test_serve_runs_its_engine_core_apart_where_a_step_leaves_a_cpu_free(model: Path) -> None:
    # serve's default (--engine-core auto): an engine-core process when the model's torch
    # threads are fewer than the CPUs (the front end then works beside a step, not inside
    # it), one process when they fill every CPU. Both answer alike.
    cpus = len(os.sched_getaffinity(0))
    body = {"prompt": "Hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    texts = []
    for threads in (1, cpus):
        apart = threads < cpus
        with _server(model, env={"OMP_NUM_THREADS": str(threads)}) as (proc, url, log):
            reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            texts.append(reply.json()["choices"][0]["text"])
            served = re.search(r"engine core 0 serving \(pid (\d+)", "".join(log))
            assert (served is not None) == apart, "".join(log)
            if served:  # a child of the server, alive while it serves
                assert _parent_pid(int(served.group(1))) == proc.pid
            proc.send_signal(signal.SIGINT)
        assert proc.returncode == 0, "".join(log)
        mode = "process" if apart else "inprocess"
        assert f"engine core: {mode} (auto: {cpus} CPUs" in "".join(log), "".join(log)
    assert texts[0] == texts[1] and len(texts[0]) > 0


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


# `python -m engine` with a worker thread that outlives everything (as an abandoned grammar
# compile did): a non-daemon thread, which a normal interpreter exit waits for.
LEFT_BEHIND = ("import runpy, sys, threading; "
               "threading.Thread(target=threading.Event().wait, args=(3600,), "
               "name='left-behind').start(); "
               "sys.argv[0] = 'engine'; runpy.run_module('engine', run_name='__main__')")


def test_shut_down_cleanly_is_logged_only_when_the_process_is_about_to_exit(model: Path) -> None:
    # It used to be logged inside the trio run, and the process then waited for worker
    # threads left behind (19-40 s of abandoned compiles after SIGTERM in issue 28).
    with _server(model, launch=("-c", LEFT_BEHIND)) as (proc, url, log):
        assert httpx.get(url + "/health", timeout=60).status_code == 200
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=START_TIMEOUT)  # the thread waits an hour: a hang fails here
    assert proc.returncode == 0, "".join(log)
    lines = [line for line in log if line.strip()]
    assert "SIGTERM: draining" in "".join(lines)
    assert "shut down cleanly" in lines[-1], "".join(lines)


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


# -- the chat flags and the startup log, in process ---------------------------------------

# A template that reads tools (so tool_choice "auto" needs a parser, not the fallback) and
# renders a conversation recognisably.
CHAT_TEMPLATE = ("{% for m in messages %}<<{{ m.role }}: {{ m.content }}>>\n{% endfor %}"
                 "{% if tools %}{{ tools | length }} tools\n{% endif %}")
ASK = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def test_the_chat_flags_become_the_chat_settings_the_app_uses(tmp_path: Path) -> None:
    from engine.chat.request import ChatSettings
    from engine.cli.serve import chat_settings

    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    args = _parser("serve").parse_args([
        "--chat-template", str(template), "--tool-call-parser", "mistral",
        "--enable-auto-tool-choice", "--reasoning-parser", "qwen3",
        "--trust-request-chat-template"])
    assert chat_settings(args) == ChatSettings(
        tool_call_parser="mistral", enable_auto_tool_choice=True, reasoning_parser="qwen3",
        chat_template=CHAT_TEMPLATE, trust_request_chat_template=True)
    # The template itself serves as well as a file holding it.
    inline = _parser("serve").parse_args(["--chat-template", CHAT_TEMPLATE])
    assert chat_settings(inline).chat_template == CHAT_TEMPLATE
    assert chat_settings(_parser("serve").parse_args([])) == ChatSettings()


@pytest.mark.parametrize("flag", ["--tool-call-parser", "--reasoning-parser"])
def test_an_unknown_parser_name_is_a_usage_error_listing_the_choices(
    flag: str, capsys: pytest.CaptureFixture[str],
) -> None:
    from engine.chat.reasoning import REASONING_PARSERS
    from engine.chat.tool_parsers import TOOL_PARSERS

    with pytest.raises(SystemExit) as info:
        _parser("serve").parse_args([flag, "nope"])
    assert info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {flag}: invalid choice: 'nope'" in error
    choices = TOOL_PARSERS if flag == "--tool-call-parser" else REASONING_PARSERS
    assert all(name in error for name in choices), error


@pytest.mark.parametrize(("argv", "message"), [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--chat-template", "no-such-template.jinja"],
     "--chat-template 'no-such-template.jinja' is neither a file nor a jinja template"),
])
def test_a_bad_chat_option_is_one_error_line_and_exit_2_before_the_model_loads(
    argv: list[str], message: str, caplog: pytest.LogCaptureFixture,
) -> None:
    # The model does not exist: had loading started first, the error would name it.
    from engine.cli import serve as cli

    caplog.set_level(logging.INFO)  # and puts the root level back after run_serve's
    args = _parser("serve").parse_args(["--model", "/no/such/model", "--port", "0", *argv])
    assert cli.run_serve(args) == cli.EXIT_BAD_OPTION
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [message]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tiny_model(tmp_path_factory)
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "temperature": 0.3, "top_k": 7, "do_sample": True}))
    return path


class _Listening(logging.Handler):
    """Sets ``event`` once the server logs the URL it listens on (kept in ``url``)."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.url: str | None = None
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        match = re.search(r"listening on (http://\S+)", record.getMessage())
        if match:
            self.url = match.group(1)
            self.event.set()


def _run_serve(argv: list[str], caplog: pytest.LogCaptureFixture,
               while_serving: Callable[[str], None]) -> list[str]:
    """``python -m engine serve ARGV`` in this process (cli.run_serve, signals and all):
    once it listens, ``while_serving(url)`` runs in a thread, then SIGTERM stops the
    server. Returns the log messages; any error of ``while_serving`` is raised here."""
    from engine.cli import serve as cli

    caplog.set_level(logging.INFO)
    args = _parser("serve").parse_args([*argv, "--port", "0", "--kv-cache-memory", "8MiB"])
    listening = _Listening()
    served = threading.Event()
    errors: list[BaseException] = []

    def client() -> None:
        listening.event.wait(START_TIMEOUT)
        if listening.url is None or served.is_set():  # it never listened
            return
        try:
            while_serving(listening.url)
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)
        finally:
            if not served.is_set():  # trio's signal receiver is still in place
                os.kill(os.getpid(), signal.SIGTERM)

    http_logger = logging.getLogger("engine.http")
    http_logger.addHandler(listening)
    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    try:
        status = cli.run_serve(args)
    finally:
        served.set()
        listening.event.set()
        thread.join(START_TIMEOUT)
        http_logger.removeHandler(listening)
    if errors:
        raise errors[0]
    messages = [r.getMessage() for r in caplog.records]
    assert status == 0, messages
    assert "shut down cleanly" in messages
    return messages


def _chat(url: str, **body: object) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=60,
                      json={"messages": ASK, "max_tokens": 4, **body})


def test_serve_with_chat_flags_logs_the_generation_defaults_and_applies_the_flags(
    chat_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """--generation-config auto (the default) logs generation_config.json's sampling
    defaults; --chat-template (a file) is the prompt's template; the parser flags make
    tool_choice "auto" and the reasoning split work; a request's own template is a 400."""
    from engine.models.tokenizer import Tokenizer

    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    tokenizer = Tokenizer.from_folder(chat_model)

    def while_serving(url: str) -> None:
        counted = httpx.post(url + "/tokenize", json={"messages": ASK}).json()
        assert counted["tokens"] == tokenizer.encode(
            "<<user: Weather in Paris?>>\n", add_special_tokens=False)
        reply = _chat(url, tools=[WEATHER], tool_choice="auto", ignore_eos=True)
        assert reply.status_code == 200, reply.text
        message = reply.json()["choices"][0]["message"]
        # deepseek_r1: the prompt opened the reasoning, which never closed here.
        assert message["reasoning_content"] and message["content"] is None, message
        for stream in (False, True):
            refused = _chat(url, chat_template=CHAT_TEMPLATE, stream=stream)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == "chat_template"
        refused = httpx.post(url + "/tokenize", json={"messages": ASK,
                                                      "chat_template": CHAT_TEMPLATE})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"

    messages = _run_serve([
        "--model", str(chat_model), "--chat-template", str(template), "--tool-call-parser",
        "hermes", "--enable-auto-tool-choice", "--reasoning-parser", "deepseek_r1",
    ], caplog, while_serving)
    assert 'sampling defaults from generation_config.json: {"temperature": 0.3, "top_k": 7}' \
        in messages


def test_serve_with_generation_config_none_logs_no_defaults_and_trusts_request_templates(
    chat_model: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    from engine.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(chat_model)

    def while_serving(url: str) -> None:
        counted = httpx.post(url + "/tokenize", json={"messages": ASK,
                                                      "chat_template": CHAT_TEMPLATE})
        assert counted.status_code == 200, counted.text
        assert counted.json()["tokens"] == tokenizer.encode(
            "<<user: Weather in Paris?>>\n", add_special_tokens=False)
        # That template reads tools, so "auto" needs the parser flags, which are not set.
        refused = _chat(url, chat_template=CHAT_TEMPLATE, tools=[WEATHER], tool_choice="auto")
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice"
        reply = _chat(url, chat_template=CHAT_TEMPLATE, ignore_eos=True)
        assert reply.status_code == 200, reply.text
        message = reply.json()["choices"][0]["message"]
        assert message["content"] and "reasoning_content" not in message, message
        frozen.append(gc.get_freeze_count())  # the startup heap, out of full collections

    frozen: list[int] = []
    messages = _run_serve(["--model", str(chat_model), "--generation-config", "none",
                           "--trust-request-chat-template", "--disable-log-stats",
                           "--log-stats-interval", "0.05"], caplog, while_serving)
    assert not [m for m in messages if "Avg generation throughput" in m]
    assert "sampling defaults from generation_config.json: none (--generation-config none)" \
        in messages
    # Frozen while serving (the model among it), given back to the collector on exit.
    assert frozen and frozen[0] > 10_000 and gc.get_freeze_count() == 0


def test_serve_logs_the_stats_line_while_busy_then_goes_quiet(
    chat_model: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM's periodic stats line: the request's tokens show as throughput, and once idle
    one line of zeros is logged at info level, then the lines drop to debug. With
    --enable-log-requests each request is logged as the model reads it, cut to
    --max-log-len (transformers' tokenizer is the oracle of its ids)."""
    from transformers import AutoTokenizer

    prompt = "Hello there, how are the cats and the dogs today?"
    ids: list[int] = []

    def while_serving(url: str) -> None:
        reply = _chat(url, max_tokens=12, ignore_eos=True)
        assert reply.status_code == 200, reply.text
        done = httpx.post(url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 2, "temperature": 0, "request_id": "logged-1"})
        assert done.status_code == 200, done.text
        ids.extend(done.json().get("prompt_token_ids") or [])
        time.sleep(1.5)  # several intervals: the busy one, then idle ones

    messages = _run_serve(["--model", str(chat_model), "--log-stats-interval", "0.2",
                           "--enable-log-requests", "--max-log-len", "6"],
                          caplog, while_serving)
    want = AutoTokenizer.from_pretrained(str(chat_model))(prompt)["input_ids"][:6]
    logged = [m for m in messages if m.startswith("Received request logged-1:")]
    assert len(logged) == 1, [m for m in messages if m.startswith("Received")]
    assert f"prompt_token_ids: {want}, lora: None" in logged[0]
    assert "temperature=0" in logged[0] and "max_tokens=2" in logged[0]
    pattern = re.compile(r"Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: "
                         r"([\d.]+) tokens/s, Running: (\d+) reqs, Waiting: (\d+) reqs, KV cache "
                         r"usage: ([\d.]+)%, Prefix cache hit rate: ([\d.]+)%")
    parsed = [tuple(map(float, pattern.fullmatch(m).groups())) for m in messages
              if m.startswith("Avg prompt throughput")]
    assert any(p[0] > 0 for p in parsed) and any(p[1] > 0 for p in parsed), parsed
    assert parsed[-1][:5] == (0.0, 0.0, 0.0, 0.0, 0.0), parsed
    assert sum(1 for p in parsed if p[:2] == (0.0, 0.0)) == 1, parsed


def test_stats_line_rates_are_the_tokens_over_the_seconds_between_lines() -> None:
    from engine.actors.system import EngineStatistics
    from engine.api.metrics import Metrics
    from engine.http.stats_log import StatsLog

    class Idle:
        def statistics(self) -> EngineStatistics:
            return EngineStatistics(running=0, waiting=0, kv_blocks_total=8, kv_blocks_free=6,
                                    prefix_cache_hits=1, prefix_cache_queries=4, preemptions=0,
                                    steps=0, requests_finished=0)

    eng = Idle()
    metrics = Metrics(eng, "m")  # type: ignore[arg-type]
    now = [100.0]
    log = StatsLog(eng, metrics, clock=lambda: now[0])
    metrics.prompt_token_count += 300
    metrics.generation_token_count += 50
    now[0] += 2.0
    text, busy = log.line()
    assert busy and text == ("Avg prompt throughput: 150.0 tokens/s, Avg generation throughput: "
                             "25.0 tokens/s, Running: 0 reqs, Waiting: 0 reqs, KV cache usage: "
                             "25.0%, Prefix cache hit rate: 25.0%")
    now[0] += 4.0
    assert log.line() == (text.replace("150.0 tokens", "0.0 tokens").replace("25.0 tokens", "0.0 tokens"), True)
    now[0] += 4.0
    assert log.line()[1] is False  # idle twice: debug level
