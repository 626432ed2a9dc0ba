"""``python -m engine chat`` driven through a pseudo-terminal, and ``python -m engine bench``
(issue 37).

``chat`` is typed at as a person would (pexpect), against a running SmolLM2 server: the
official openai client, sent the same conversation, is the oracle of every reply, so the
history the client keeps is checked turn by turn. ``bench serve``'s token counts are checked
against the server's own counters (/metrics), the offline benches' against what they asked.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import openai
import pexpect
import pytest
from engine_helpers import tiny_model
from http_server import ServerThread

import engine
from engine import cli
from engine.cli import chat

# Torch on one thread for the servers in this process: on a shared 2-core machine a second
# OpenMP thread made SmolLM2 50x slower here (see conftest's one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parent.parent
# A hang guard per expected answer: SmolLM2 writes a dozen tokens in well under a second.
EXPECT_SECONDS = 120
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def smollm2():
    from engine.models.loader import default_model_path

    with ServerThread(lambda: engine.open_engine(
            str(default_model_path()), served_model_name="SmolLM2-135M-Instruct",
            max_model_len=2048, kv_cache_memory=64 * 2**20)) as server:
        yield server


def _oracle(client: openai.OpenAI, model: str, messages: list[dict[str, str]]) -> str:
    answer = client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                            max_tokens=MAX_TOKENS, temperature=0)
    return answer.choices[0].message.content or ""


def _terminal(text: str) -> str:
    """``text`` as a terminal shows it (the pty turns a newline into CR LF)."""
    return text.replace("\n", "\r\n")


@pytest.mark.slow
def test_chat_in_a_terminal_keeps_the_conversation_across_turns(smollm2: ServerThread) -> None:
    url = smollm2.base_url + "/v1"
    system = "You are a geography teacher. Answer in one short sentence."
    first, second = "What is the capital of France?", "And of Italy?"
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as client:
        model = smollm2.engine.model_name
        history = [{"role": "system", "content": system}, {"role": "user", "content": first}]
        reply1 = _oracle(client, model, history)
        history += [{"role": "assistant", "content": reply1}, {"role": "user", "content": second}]
        reply2 = _oracle(client, model, history)
        fresh = _oracle(client, model, [{"role": "system", "content": system},
                                        {"role": "user", "content": second}])
    # The second question means something else without the first: so the replies show
    # whether the client sent the history.
    assert reply2 != fresh

    # TERM=dumb: readline writes no escape sequences (bracketed paste) around the prompt.
    env = dict(os.environ, PYTHONPATH=str(REPO), TERM="dumb")
    child = pexpect.spawn(
        sys.executable, ["-m", "engine", "chat", "--url", url, "--system-prompt", system,
                         "--max-tokens", str(MAX_TOKENS), "--temperature", "0"],
        cwd=str(REPO), env=env, encoding="utf-8", timeout=EXPECT_SECONDS)
    try:
        child.expect_exact(f"chat with {model}")
        child.expect_exact(chat.PROMPT)
        for question, reply in ((first, reply1), (second, reply2)):
            child.sendline(question)
            child.expect_exact(_terminal(f"{question}\n{reply}\n{chat.PROMPT}"))
        child.sendline("/clear")
        child.expect_exact("(conversation cleared)")
        child.expect_exact(chat.PROMPT)
        child.sendline(second)
        child.expect_exact(_terminal(f"{second}\n{fresh}\n{chat.PROMPT}"))
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


# -- bench ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory)


def test_bench_serve_counts_the_tokens_the_server_counted(model: Path, tmp_path: Path) -> None:
    prompts, input_len, output_len = 6, 5, 3
    names = ("engine:prompt_tokens_total", "engine:generation_tokens_total")
    with ServerThread(lambda: engine.open_engine(str(model), dtype="float32",
                                                 kv_cache_memory=8 * 2**20)) as server:
        before = server.metrics(*names)
        status = cli.main([
            "bench", "serve", "--base-url", server.base_url, "--num-prompts", str(prompts),
            "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            # The tiny model's 384 tokens, past its 3 specials.
            "--random-token-range", "3:384", "--ignore-eos", "--max-concurrency", "2",
            "--no-warmup", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90", "--output-json", str(tmp_path / "serve.json")])
        after = server.metrics(*names)
    assert status == 0
    result = json.loads((tmp_path / "serve.json").read_text())
    assert (result["completed"], result["failed"]) == (prompts, 0)
    assert result["total_input_tokens"] == after[0] - before[0] == prompts * input_len
    assert result["total_output_tokens"] == after[1] - before[1] == prompts * output_len
    assert result["output_tokens_per_s"] == pytest.approx(
        result["total_output_tokens"] / result["duration_s"])
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < result[f"p50_{metric}_s"] <= result[f"p90_{metric}_s"]
    # Every request's first token came before its end.
    assert result["p90_ttft_s"] <= result["p90_e2el_s"]


def test_bench_serve_chat_streams_chat_and_counts_the_tokens_the_server_counted(
        model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's ``openai-chat`` backend: each prompt's ids made text by the server's
    /detokenize, sent as a user message, streamed; the server counts the prompt (template
    and all), and each answer is its whole length."""
    prompts, input_len, output_len = 4, 6, 3
    names = ("engine:prompt_tokens_total", "engine:generation_tokens_total")
    with ServerThread(lambda: engine.open_engine(str(model), dtype="float32",
                                                 kv_cache_memory=8 * 2**20)) as server:
        before = server.metrics(*names)
        status = cli.main([
            "bench", "serve", "--base-url", server.base_url, "--backend", "openai-chat",
            "--num-prompts", str(prompts), "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--random-token-range", "3:384", "--ignore-eos",
            "--no-warmup", "--disable-tqdm", "--output-json", str(tmp_path / "chat.json")])
        after = server.metrics(*names)
        mismatched = cli.main(["bench", "serve", "--base-url", server.base_url, "--backend", "openai-chat",
                               "--endpoint", "/v1/completions", "--num-prompts", "1", "--no-warmup"])
    assert status == 0 and mismatched == 1
    assert "--backend openai-chat sends to /v1/chat/completions" in capsys.readouterr().err
    result = json.loads((tmp_path / "chat.json").read_text())
    assert (result["endpoint"], result["completed"], result["failed"]) == ("/v1/chat/completions", prompts, 0)
    assert result["total_input_tokens"] == after[0] - before[0] > prompts * input_len  # the template's too
    assert result["total_output_tokens"] == after[1] - before[1] == prompts * output_len
    assert 0 < result["p50_ttft_s"] <= result["p50_e2el_s"]


def test_bench_serve_embeddings_times_each_request(model: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's ``openai-embeddings`` backend: the prompts posted to /v1/embeddings, each
    answered whole; the report is their latency (E2EL) and the tokens the server embedded."""
    prompts, input_len = 5, 6
    with ServerThread(lambda: engine.open_engine(str(model), dtype="float32", kv_cache_memory=8 * 2**20,
                                                 runner="pooling")) as server:
        status = cli.main([
            "bench", "serve", "--base-url", server.base_url, "--backend", "openai-embeddings",
            "--num-prompts", str(prompts), "--random-input-len", str(input_len), "--random-token-range", "3:384",
            "--disable-tqdm", "--output-json", str(tmp_path / "embed.json")])
    assert status == 0
    result = json.loads((tmp_path / "embed.json").read_text())
    assert (result["endpoint"], result["completed"], result["failed"]) == ("/v1/embeddings", prompts, 0)
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (prompts * input_len, 0)
    assert 0 < result["p50_e2el_s"] <= result["p90_e2el_s"]
    printed = capsys.readouterr().out
    assert "Mean E2EL (ms):" in printed and "TTFT" not in printed


@pytest.mark.parametrize("kind", ["throughput", "latency"])
def test_offline_benches_run_what_they_were_asked(model: Path, tmp_path: Path, kind: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / f"{kind}.json"
    size = ["--num-prompts", "5"] if kind == "throughput" else [
        "--batch-size", "3", "--num-iters-warmup", "1", "--num-iters", "2", "--disable-tqdm"]
    status = cli.main(["bench", kind, "--model", str(model), "--dtype", "float32",
                       "--kv-cache-memory", "8MiB", "--input-len", "6", "--output-len", "4",
                       *size, "--output-json", str(out)])
    assert status == 0
    result: dict[str, Any] = json.loads(out.read_text())
    printed = capsys.readouterr().out
    if kind == "throughput":
        assert (result["num_requests"], result["total_prompt_tokens"],
                result["total_output_tokens"]) == (5, 5 * 6, 5 * 4)
        assert result["requests_per_second"] == pytest.approx(5 / result["elapsed_time"])
        assert f"{result['requests_per_second']:.2f} requests/s" in printed
    else:
        assert len(result["latencies"]) == 2
        assert result["avg_latency"] == pytest.approx(sum(result["latencies"]) / 2)
        assert f"Avg latency: {result['avg_latency']:.4f} seconds" in printed


@pytest.mark.parametrize("command", ["chat", "complete"])
def test_with_no_server_an_embedded_engine_answers(
        model: Path, command: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    options: dict[str, Any] = {"dtype": "float32", "kv_cache_memory": 8 * 2**20}
    with ServerThread(lambda: engine.open_engine(str(model), **options)) as server, \
            openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused",
                          max_retries=0) as client:
        name = server.engine.model_name
        if command == "chat":
            answer = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "hello"}], max_tokens=4,
                temperature=0).choices[0].message.content
        else:
            answer = client.completions.create(model=name, prompt="hello", max_tokens=4,
                                               temperature=0).choices[0].text
    # Nothing listens at the default address: the server above is gone, its port free.
    monkeypatch.setattr(chat, "DEFAULT_URL", server.base_url + "/v1")
    status = cli.main([command, "-q", "hello", "--max-tokens", "4", "--temperature", "0",
                       "--model", str(model), "--dtype", "float32", "--kv-cache-memory", "8MiB"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "starting an embedded engine" in captured.err
    assert captured.out == f"{answer}\n"
