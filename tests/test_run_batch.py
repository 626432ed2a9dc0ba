"""``python -m engine run-batch`` (issue 37): an OpenAI Batch file answered offline.

The batch is 1,000 lines of chat, completions and embeddings with ten bad lines among them.
The engine serves one model at a time, and embeddings need a pooling model, so the file is
split by ``url`` (as docs/serving.md tells users to): the generation lines run on the tiny
Llama, the embeddings lines on the same weights served as an embedder (``--runner
pooling``). The oracles: the HTTP server itself, asked the same bodies through the official
openai client (each answer must be the server's), and one clean run (a run killed with
SIGKILL halfway and resumed must give the same answers, each line once).
"""

from __future__ import annotations

import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from engine_helpers import tiny_model
from http_server import ServerThread

import engine
from engine import cli
from engine.cli import run_batch

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parent.parent
ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "8MiB"]
WORDS = ("the quick brown fox jumps over the lazy dog while paged attention keeps blocks "
         "and continuous batching lets new requests join").split()
# Each bad line, and how it must be answered: the envelope's error (no response), or the
# server's status with its error code.
BAD = {
    "bad-url": ({"url": "/v1/moderations", "body": {"input": "x"}}, None, "invalid_url"),
    "bad-method": ({"method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}},
                   None, "invalid_method"),
    "bad-body": ({"url": "/v1/chat/completions", "body": ["not", "an", "object"]},
                 None, "missing_required_parameter"),
    "bad-stream": ({"url": "/v1/completions", "body": {"prompt": "hi", "stream": True}},
                   None, "invalid_value"),
    "bad-temperature": ({"url": "/v1/chat/completions", "body": {
        "messages": [{"role": "user", "content": "hi"}], "temperature": -1}}, 400, None),
    "bad-max-tokens": ({"url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": "ten"}},
                       400, None),
    "bad-model": ({"url": "/v1/chat/completions", "body": {
        "model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}}, 404, None),
    "bad-messages": ({"url": "/v1/chat/completions", "body": {"max_tokens": 2}}, 400, None),
    "bad-token": ({"url": "/v1/completions", "body": {"prompt": [10**6], "max_tokens": 2}},
                  400, None),
    "bad-embedding": ({"url": "/v1/embeddings", "body": {"input": []}}, 400, None),
}
LINES = 1000
# Lines in flight in the run that is killed: small, so that it is caught part way (answers
# are written in bursts of about this many).
KILLED_CONCURRENCY = 32


def batch_lines(seed: int = 0) -> list[dict[str, Any]]:
    """1,000 batch lines: every tenth an embedding, the rest chat and completions in turn
    (greedy, 1 to 3 tokens), and the ten bad lines at random places."""
    rng = random.Random(seed)
    lines = []
    for i in range(LINES - len(BAD)):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
        if i % 10 == 0:
            url, body = "/v1/embeddings", {"input": text if i % 20 else [text, text[::-1]]}
        elif i % 2:
            url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}],
                                                 "max_tokens": rng.randint(1, 3), "temperature": 0}
        else:
            url, body = "/v1/completions", {"prompt": text, "max_tokens": rng.randint(1, 3),
                                            "temperature": 0}
        lines.append({"custom_id": f"line-{i}", "method": "POST", "url": url, "body": body})
    for custom_id, (spec, _, _) in BAD.items():
        lines.insert(rng.randrange(len(lines) + 1), {"custom_id": custom_id, "method": "POST", **spec})
    return lines


def write_jsonl(path: Path, items: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def comparable(item: dict[str, Any]) -> tuple[Any, ...]:
    """An output line without what differs between runs (ids, timestamps)."""
    response = item["response"]
    if response is not None:
        body = response["body"]
        if isinstance(body, dict):
            body = {k: v for k, v in body.items() if k not in ("id", "created")}
        response = (response["status_code"], json.dumps(body, sort_keys=True))
    return item["custom_id"], response, json.dumps(item["error"], sort_keys=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The 1,000 lines, and the two files a user splits them into (by url)."""
    folder = tmp_path_factory.mktemp("batch")
    lines = batch_lines()
    generation = [item for item in lines if item["url"] != "/v1/embeddings"]
    embeddings = [item for item in lines if item["url"] == "/v1/embeddings"]
    return {"lines": lines, "generation": write_jsonl(folder / "generation.jsonl", generation),
            "embeddings": write_jsonl(folder / "embeddings.jsonl", embeddings), "folder": folder}


@pytest.fixture(scope="module")
def clean(model: Path, batch: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """One clean run of each file, in this process."""
    out = {}
    for name, extra in (("generation", []), ("embeddings", ["--runner", "pooling"])):
        path = batch["folder"] / f"{name}.out.jsonl"
        status = cli.main(["run-batch", "-i", str(batch[name]), "-o", str(path), "--model",
                           str(model), *ENGINE_FLAGS, *extra, "--no-progress"])
        assert status == 0
        out[name] = read_jsonl(path)
    return out


def test_a_thousand_lines_each_answered_once_the_ten_bad_ones_with_their_errors(
        batch: dict[str, Any], clean: dict[str, list[dict[str, Any]]]) -> None:
    answers = clean["generation"] + clean["embeddings"]
    ids = [item["custom_id"] for item in answers]
    assert len(batch["lines"]) == LINES
    assert sorted(ids) == sorted(item["custom_id"] for item in batch["lines"])  # each once
    by_id = {item["custom_id"]: item for item in answers}
    assert {i for i, item in by_id.items() if item["error"] is not None} == set(BAD)
    numbers = {}
    for name in ("generation", "embeddings"):
        for number, text in enumerate(batch[name].read_text().splitlines(), start=1):
            numbers[json.loads(text)["custom_id"]] = number
    for custom_id, (_, status, code) in BAD.items():
        item = by_id[custom_id]
        assert item["error"]["line"] == numbers[custom_id]
        if status is None:  # the envelope's fault: the app never saw it
            assert item["response"] is None and item["error"]["code"] == code, item
        else:
            assert item["response"]["status_code"] == status, item
            assert item["error"]["message"] == item["response"]["body"]["error"]["message"]
    objects = {"/v1/chat/completions": "chat.completion", "/v1/completions": "text_completion",
               "/v1/embeddings": "list"}
    for line in batch["lines"]:
        if line["custom_id"] in BAD:
            continue
        item = by_id[line["custom_id"]]
        assert item["id"].startswith("batch_req_") and item["error"] is None
        assert item["response"]["status_code"] == 200
        assert item["response"]["body"]["object"] == objects[line["url"]]
    assert len({item["id"] for item in answers}) == LINES


def _server_answer(client: openai.OpenAI, url: str, body: dict[str, Any], model: str) -> Any:
    if url == "/v1/chat/completions":
        return client.chat.completions.create(model=model, **body)
    if url == "/v1/completions":
        return client.completions.create(model=model, **body)
    return client.embeddings.create(model=model, encoding_format="float", **body)


@pytest.mark.parametrize("name", ["generation", "embeddings"])
def test_each_answer_is_the_servers_answer(model: Path, batch: dict[str, Any],
                                           clean: dict[str, list[dict[str, Any]]],
                                           name: str) -> None:
    options: dict[str, Any] = {"dtype": "float32", "kv_cache_memory": 8 * 1024**2}
    if name == "embeddings":
        options["runner"] = "pooling"
    lines = [json.loads(text) for text in batch[name].read_text().splitlines()]
    by_id = {item["custom_id"]: item for item in clean[name]}
    good = [line for line in lines if line["custom_id"] not in BAD][:12]
    bad = [line for line in lines if line["custom_id"] in BAD and BAD[line["custom_id"]][1]]
    with ServerThread(lambda: engine.open_engine(str(model), **options)) as server, \
            openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused",
                          max_retries=0) as client:
        served = server.engine.model_name
        for line in good:
            ours = by_id[line["custom_id"]]["response"]["body"]
            theirs = _server_answer(client, line["url"], line["body"], served)
            if line["url"] == "/v1/embeddings":
                assert np.allclose([d["embedding"] for d in ours["data"]],
                                   [d.embedding for d in theirs.data], atol=1e-6)
            elif line["url"] == "/v1/completions":
                assert [c["text"] for c in ours["choices"]] == [c.text for c in theirs.choices]
            else:
                assert [c["message"]["content"] for c in ours["choices"]] == \
                    [c.message.content for c in theirs.choices]
            assert (ours["usage"]["prompt_tokens"], ours["usage"]["total_tokens"]) == \
                (theirs.usage.prompt_tokens, theirs.usage.total_tokens)
        for line in bad:  # the server's own status and error body, word for word
            response = httpx.post(server.base_url + line["url"], json=line["body"])
            ours = by_id[line["custom_id"]]["response"]
            assert (ours["status_code"], ours["body"]) == (response.status_code, response.json())


def _run_batch_process(*args: str) -> subprocess.Popen[str]:
    # One torch thread, as the one_thread fixture gives this process (tiny shapes).
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-m", "engine", "run-batch", *args, "--no-progress"], cwd=REPO,
        env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)


def _count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_killed_halfway_and_resumed_the_union_is_one_clean_run(
        model: Path, batch: dict[str, Any], clean: dict[str, list[dict[str, Any]]]) -> None:
    out = batch["folder"] / "killed.out.jsonl"
    total = len(clean["generation"])
    args = ["-i", str(batch["generation"]), "-o", str(out), "--model", str(model), *ENGINE_FLAGS]
    proc = _run_batch_process(*args, "--max-concurrency", str(KILLED_CONCURRENCY))
    deadline = time.monotonic() + 300  # a hang guard
    while _count_lines(out) < total // 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    written = _count_lines(out)
    assert total // 2 <= written < total, (written, total)
    # A kill in the middle of a write leaves a torn line; resuming cuts it off.
    with out.open("ab") as f:
        f.write(b'{"id": "batch_req_torn", "custom_id": "line-')
    resumed = _run_batch_process(*args, "--resume")
    _, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr
    assert f"--resume: {written} of {total} line(s) already answered" in stderr
    union = read_jsonl(out)
    assert len(union) == total
    assert sorted(map(comparable, union)) == sorted(map(comparable, clean["generation"]))


def test_stdin_to_stdout_answers_a_line_that_is_not_json_by_its_number(
        model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    lines = ['{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "hi", '
             '"max_tokens": 2, "temperature": 0}}', "", "{not json", '{"url": "/v1/completions"}']
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    status = cli.main(["run-batch", "-i", "-", "-o", "-", "--model", str(model), *ENGINE_FLAGS,
                       "--no-progress"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    answers = {(item["custom_id"], (item["error"] or {}).get("line")): item
               for item in map(json.loads, captured.out.splitlines())}
    assert set(answers) == {("a", None), (None, 3), (None, 4)}  # the blank line 2 is skipped
    assert answers["a", None]["response"]["body"]["usage"]["completion_tokens"] == 2
    assert answers[None, 3]["error"]["code"] == "invalid_json_line"
    assert answers[None, 4]["error"]["param"] == "custom_id"


def test_two_lines_with_one_custom_id_refuse_the_file_before_the_model_loads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = {"custom_id": "same", "url": "/v1/completions", "body": {"prompt": "x"}}
    path = write_jsonl(tmp_path / "in.jsonl", [line, line])
    # No model exists at this path: the refusal must come first.
    status = cli.main(["run-batch", "-i", str(path), "-o", str(tmp_path / "out.jsonl"),
                       "--model", str(tmp_path / "absent")])
    assert status == run_batch.EXIT_BAD_INPUT
    assert "custom_id 'same' is on lines 1 and 2" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_resume_reads_ids_and_numbered_errors_and_refuses_a_foreign_file(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    answered = [run_batch.answer(run_batch.parse_line(1, '{"custom_id": "a", "url": "/x"}'),
                                 None, None, None),
                run_batch.answer(run_batch.parse_line(7, "[]"), None, None, None)]
    out.write_text("".join(json.dumps(a) + "\n" for a in answered) + '{"custom_id": "tor')
    assert run_batch.resume_state(str(out)) == ({"a"}, {7})
    assert out.read_text().count("\n") == 2 and out.read_text().endswith("\n")  # torn line cut
    out.write_text('{"some": "other file"}\n')
    with pytest.raises(run_batch.BatchFileError, match="not a batch output line"):
        run_batch.resume_state(str(out))
    assert run_batch.resume_state(str(tmp_path / "absent.jsonl")) == (set(), set())


def test_a_line_nested_past_the_parser_is_answered_not_fatal() -> None:
    line = run_batch.parse_line(3, "[" * 100_000)
    assert line.error is not None and line.error["code"] == "invalid_json_line"
    assert line.error["line"] == 3
