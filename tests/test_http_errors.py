"""HTTP error mapping, auth, limits, disconnects and engine death, against a fake engine.

The fake (tests/http_fake_engine.py) follows the embedded API contract but generates on a
fixed clock, which makes queue-full, slow streams and crashes deterministic. The same
behaviour against the real engine is covered in test_http_openai.py.
"""

from __future__ import annotations

import json
import socket

import httpx
import openai
import pytest
import trio
from http_fake_engine import open_fake_engine
from http_server import ServerThread

from engine.models.testing import write_tiny_model
from engine.models.tokenizer import Tokenizer

API_KEY = "sk-test-key"
MAX_REQUEST_BYTES = 4096  # small, so a 413 needs only a few KB


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    return Tokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def server(tokenizer):
    # One running slot and one waiting slot: the third concurrent request gets a 429.
    opener = lambda: open_fake_engine(  # noqa: E731
        tokenizer, step_delay=0.01, max_num_seqs=1, max_queued_requests=1, max_model_len=256,
        served_model_name="tiny")
    with ServerThread(opener, api_key=API_KEY, max_request_bytes=MAX_REQUEST_BYTES) as srv:
        yield srv


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


def _headers():
    return {"Authorization": f"Bearer {API_KEY}"}


def _assert_error_body(response: httpx.Response, status: int, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["param"] == param
    return error


def test_invalid_parameter_is_400_naming_the_param(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hi", temperature=-1)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "temperature"


def test_invalid_chat_message_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": 7, "content": "x"}])
    assert info.value.body["param"] == "messages[0].role"


def test_tokenize_checks_chat_messages_as_generation_does(server):
    # One normalizer (the tokenizer's) for /v1/chat/completions and /tokenize.
    bad = {"messages": [{"role": "user", "content": "x"}, {"role": "", "content": "y"}]}
    tokenized = httpx.post(server.base_url + "/tokenize", json=bad, headers=_headers())
    chat = httpx.post(server.base_url + "/v1/chat/completions", json=bad, headers=_headers())
    assert _assert_error_body(tokenized, 400, "messages[1].role") == \
        _assert_error_body(chat, 400, "messages[1].role")
    developer = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = [httpx.post(server.base_url + "/tokenize", json={"messages": m},
                      headers=_headers()).json()["tokens"] for m in (developer, system)]
    assert ids[0] == ids[1]


def test_tokenize_given_both_a_prompt_and_messages_is_400(server):
    """Either could be counted, and the counts differ: neither is guessed."""
    messages = [{"role": "user", "content": "hi"}]
    both = httpx.post(server.base_url + "/tokenize", json={"prompt": "hi", "messages": messages},
                      headers=_headers())
    assert _assert_error_body(both, 400, "messages")["code"] == "invalid_value"
    counts = [httpx.post(server.base_url + "/tokenize", json=body, headers=_headers()).json()[
        "count"] for body in ({"prompt": "hi"}, {"messages": messages})]
    assert counts[0] != counts[1]


def test_malformed_json_is_400(server):
    r = httpx.post(server.base_url + "/v1/completions", content=b'{"prompt": ',
                   headers={**_headers(), "Content-Type": "application/json"})
    assert _assert_error_body(r, 400)["code"] == "invalid_json"


def test_prompt_too_long_is_400_with_the_lengths(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hello " * 100, max_tokens=200)
    message = info.value.body["message"]
    assert "256" in message and "200 for the completion" in message


def test_missing_or_wrong_key_is_401_but_health_and_metrics_stay_open(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="sk-wrong",
                       max_retries=0) as bad, pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="hi")
    _assert_error_body(httpx.get(server.base_url + "/v1/models"), 401)
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/metrics").status_code == 200


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-17", prompt="hi")
    assert info.value.body["param"] == "model"


def test_unknown_route_is_404_json(server):
    _assert_error_body(httpx.get(server.base_url + "/v1/nothing", headers=_headers()), 404)


def test_body_over_the_limit_is_413(server):
    body = json.dumps({"model": "tiny", "prompt": "x" * MAX_REQUEST_BYTES}).encode()
    r = httpx.post(server.base_url + "/v1/completions", content=body,
                   headers={**_headers(), "Content-Type": "application/json"})
    _assert_error_body(r, 413)


def test_streamed_body_over_the_limit_is_413(server):
    # No Content-Length: the body arrives chunked and is cut off while it streams in.
    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(8):
            yield b"x" * 1024
        yield b'"}'

    r = httpx.post(server.base_url + "/v1/completions", content=chunks(),
                   headers={**_headers(), "Content-Type": "application/json"})
    _assert_error_body(r, 413)


async def test_full_queue_is_429(server, client):
    async with httpx.AsyncClient(base_url=server.base_url, headers=_headers()) as http:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 200, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as running:
            assert running.status_code == 200
            async with http.stream("POST", "/v1/completions", json=body) as waiting:
                assert waiting.status_code == 200
                with pytest.raises(openai.RateLimitError) as info:
                    await trio.to_thread.run_sync(
                        lambda: client.completions.create(model="tiny", prompt="hi"))
                assert info.value.status_code == 429
                assert info.value.response.headers["retry-after"] == "1"
    await _wait_idle(server)


async def _wait_idle(server):
    """Poll the metrics until no request runs or waits and no KV block is held."""
    with trio.fail_after(10):  # hang guard only; an abort takes one engine step
        while True:
            running, waiting, kv = await trio.to_thread.run_sync(lambda: (
                server.metric("engine:num_requests_running"),
                server.metric("engine:num_requests_waiting"),
                server.metric("engine:kv_cache_usage_perc")))
            if (running, waiting, kv) == (0, 0, 0):
                return
            await trio.sleep(0.02)


def _raw_post(server, body: dict) -> socket.socket:
    """Send a request on a raw socket, so the test controls exactly when it hangs up."""
    host, port = server.base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    payload = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
        + payload)
    return sock


def _engine_steps(server) -> int:
    return server.call(lambda: server.engine.statistics().steps)


@pytest.mark.parametrize("stream", [True, False], ids=["mid-stream", "mid-wait"])
async def test_disconnect_aborts_and_frees_kv_blocks(server, stream):
    max_tokens = 200
    steps_before = await trio.to_thread.run_sync(_engine_steps, server)
    sock = _raw_post(server, {"model": "tiny", "prompt": "hi", "max_tokens": max_tokens,
                              "stream": stream})
    # Wait until the request is running and holds blocks.
    with trio.fail_after(10):
        while await trio.to_thread.run_sync(server.metric, "engine:kv_cache_usage_perc") == 0:  # noqa: ASYNC110 - polls another loop over HTTP
            await trio.sleep(0.02)
    if stream:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    sock.close()
    await _wait_idle(server)
    # Idle alone proves nothing (the request ends by itself in 2 s): it was cut short.
    steps = await trio.to_thread.run_sync(_engine_steps, server) - steps_before
    assert steps < max_tokens


async def test_engine_death_is_503_and_ends_streams_with_an_error_chunk(tokenizer):
    opener = lambda: open_fake_engine(tokenizer, step_delay=0.01, max_model_len=256)  # noqa: E731
    with ServerThread(opener) as server:
        async with httpx.AsyncClient(base_url=server.base_url) as http:
            body = {"prompt": "hi", "max_tokens": 200, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.aiter_lines()
                assert (await anext(lines)).startswith("data: {")
                server.call(server.engine.crash, RuntimeError("injected"))
                events = [line async for line in lines if line]
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2].removeprefix("data: "))["error"]
            assert error["code"] == "engine_dead"
            health = await http.get("/health")
            _assert_error_body(health, 503)
            later = await http.post("/v1/completions", json={"prompt": "hi"})
            _assert_error_body(later, 503)


async def test_503_bodies_carry_no_internal_exception_text(tokenizer):
    """A dead engine's 503s (and the error chunk of a cut stream) say the engine is down,
    never what the exception inside it said (paths, tensor shapes, library internals)."""
    secret = "index 49152 is out of bounds at /srv/engine/runner.py:42"
    opener = lambda: open_fake_engine(tokenizer, step_delay=0.01, max_model_len=256)  # noqa: E731
    with ServerThread(opener) as server:
        async with httpx.AsyncClient(base_url=server.base_url) as http:
            body = {"prompt": "hi", "max_tokens": 200, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                lines = response.aiter_lines()
                assert (await anext(lines)).startswith("data: {")
                server.call(server.engine.crash, RuntimeError(secret))
                events = [line async for line in lines if line]
            bodies = [events[-2], (await http.get("/health")).text,
                      (await http.post("/v1/completions", json={"prompt": "hi"})).text,
                      (await http.post("/v1/chat/completions",
                                       json={"messages": [{"role": "user", "content": "hi"}]})).text]
    for text in bodies:
        assert "engine_dead" in text
        assert "49152" not in text and "runner.py" not in text and "out of bounds" not in text
