"""End to end: the official openai client and raw HTTP against the server on a tiny model.

One server per module (a background thread, real engine, tiny llama, free loopback port).
The openai client is the oracle for the wire format; greedy decoding makes streamed and
non-streamed answers comparable token for token.
"""

from __future__ import annotations

import json
import re
import socket

import httpx
import openai
import pytest
import trio
from http_server import ServerThread

from engine.models.testing import write_tiny_model

MODEL = "tiny-llama"


def _open_engine(folder, **options):
    import engine.api

    return engine.api.open_engine(str(folder), served_model_name=MODEL, max_model_len=256,
                                  kv_cache_memory=64 * 2**20, **options)  # a small pool


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture(scope="module", params=["inprocess", "process"])
def server(model_folder, request):
    # Both modes of issue 20: the engine core in the server's process, and in an
    # engine-core process of its own behind the same front end.
    with ServerThread(lambda: _open_engine(model_folder, engine_core=request.param)) as srv:
        yield srv


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


def _prompt_tokens(server, text):
    return httpx.post(server.base_url + "/tokenize", json={"prompt": text}).json()["count"]


def test_completion_non_streamed_and_streamed_agree(server, client):
    full = client.completions.create(model=MODEL, prompt="The quick brown", **GREEDY)
    (choice,) = full.choices
    assert choice.finish_reason == "length"
    assert full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens == _prompt_tokens(server, "The quick brown")
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    chunks = list(client.completions.create(model=MODEL, prompt="The quick brown", stream=True,
                                            **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_non_streamed_and_streamed_agree(client):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    full = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                 **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_2_gives_two_choices_each_finished(client):
    full = client.completions.create(model=MODEL, prompt="Hello", n=2, max_tokens=6, seed=1,
                                     extra_body={"ignore_eos": True})
    assert sorted(c.index for c in full.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in full.choices)
    assert full.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=6,
        stream=True, extra_body={"ignore_eos": True}))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
        assert mine[-1].finish_reason == "length"


def test_list_and_token_id_prompts(server, client):
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": "Hello"}).json()["tokens"]
    full = client.completions.create(model=MODEL, prompt=["Hello", "The quick"], **GREEDY)
    assert [c.index for c in full.choices] == [0, 1]
    by_ids = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == full.choices[0].text
    nested = client.completions.create(model=MODEL, prompt=[ids, ids], **GREEDY)
    assert [c.text for c in nested.choices] == [full.choices[0].text] * 2


def test_completion_logprobs(client):
    full = client.completions.create(model=MODEL, prompt="Hello", logprobs=3, **GREEDY)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0
        assert 1 <= len(top) <= 3
        # Greedy: the chosen token is the most likely one.
        assert top[token] == pytest.approx(max(top.values()), abs=1e-4)


def test_chat_logprobs(client):
    full = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], logprobs=True,
        top_logprobs=2, **GREEDY)
    content = full.choices[0].logprobs.content
    assert len(content) == 12
    assert all(len(item.top_logprobs) == 2 and item.logprob <= 0 for item in content)


def test_include_usage_adds_a_final_usage_chunk(client):
    chunks = list(client.completions.create(
        model=MODEL, prompt="Hello", stream=True, stream_options={"include_usage": True},
        **GREEDY))
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_framing_byte_for_byte(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True,
            "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_raw())
    assert raw.endswith(b"\n\ndata: [DONE]\n\n")
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    payloads = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    # Re-encoding every payload compactly gives back the exact bytes that were sent.
    rebuilt = b"".join(b"data: " + json.dumps(p, ensure_ascii=False, separators=(",", ":"))
                       .encode() + b"\n\n" for p in payloads) + b"data: [DONE]\n\n"
    assert raw == rebuilt
    first = payloads[0]
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]
    assert len({p["id"] for p in payloads}) == 1
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def _single_token(server, text):
    (token,) = httpx.post(server.base_url + "/tokenize",
                          json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    return token


def test_echo_puts_the_prompt_before_the_completion(server, client):
    plain = client.completions.create(model=MODEL, prompt="The quick brown", **GREEDY)
    echoed = client.completions.create(model=MODEL, prompt="The quick brown", echo=True,
                                       **GREEDY)
    assert echoed.choices[0].text == "The quick brown" + plain.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="The quick brown", echo=True,
                                            stream=True, **GREEDY))
    assert chunks[0].choices[0].text == "The quick brown"
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": "The quick brown"}).json()
    by_ids = client.completions.create(model=MODEL, prompt=ids["tokens"], echo=True, **GREEDY)
    prompt_text = httpx.post(server.base_url + "/detokenize", json=ids).json()["prompt"]
    assert by_ids.choices[0].text == prompt_text + plain.choices[0].text


def test_echo_with_logprobs_scores_the_prompt_then_the_completion(server, client):
    # What evaluation harnesses send to score a text: echo + logprobs.
    prompt = "The quick brown fox jumps"
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    plain = client.completions.create(model=MODEL, prompt=prompt, logprobs=2, **GREEDY)
    echoed = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, **GREEDY)
    lp = echoed.choices[0].logprobs
    n = len(ids)
    assert len(lp.tokens) == n + 12
    # The prompt's tokens first: the first unscored (null), as OpenAI reports it ...
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:n])
    # The prompt token and two alternatives each, as OpenAI documents logprobs + 1 and vLLM
    # sends them (fewer where the token is among the two, or two ids decode to one text).
    assert all(1 <= len(top) <= 3 and top[token] == value for top, token, value in
               zip(lp.top_logprobs[1:n], lp.tokens[1:n], lp.token_logprobs[1:n], strict=True))
    assert any(len(top) >= 2 for top in lp.top_logprobs[1:n])
    # ... then exactly the completion's, as a plain request reports them.
    assert lp.token_logprobs[n:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert lp.tokens[n:] == plain.choices[0].logprobs.tokens
    assert lp.text_offset[n] == len(prompt)
    # Streamed: the echo chunk waits for the prompt's logprobs and carries them.
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2,
                                            stream=True, **GREEDY))
    first = chunks[0].choices[0]
    assert first.text == prompt
    assert first.logprobs.token_logprobs[0] is None
    assert first.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:n], abs=1e-5)
    streamed = [v for c in chunks[1:] if c.choices and c.choices[0].logprobs
                for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs[n:], abs=1e-5)


def test_echo_with_max_tokens_zero_is_the_prompt_scored_by_transformers(
    server, client, model_folder
):
    # OpenAI's and vLLM's way to score a text without generating: echo, max_tokens 0.
    import torch
    from transformers import AutoModelForCausalLM

    prompt = "The quick brown fox jumps"
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    hf = AutoModelForCausalLM.from_pretrained(str(model_folder), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        scores = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)
    want = [scores[i - 1, ids[i]].item() for i in range(1, len(ids))]
    answer = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1,
                                       max_tokens=0)
    choice = answer.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert answer.usage.completion_tokens == 0 and answer.usage.prompt_tokens == len(ids)
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1,
                                            max_tokens=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs
                for v in c.choices[0].logprobs.token_logprobs]
    assert streamed[1:] == pytest.approx(want, abs=1e-4)
    # Without echo there is nothing to return: max_tokens 0 stays a 400.
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)
    assert refused.value.body["param"] == "max_tokens"


def test_logit_bias_stop_token_ids_and_min_tokens_are_honoured(server, client):
    token = _single_token(server, ".")
    base = {"model": MODEL, "prompt": "Hello", "temperature": 0, "max_tokens": 6}
    plain = client.completions.create(**base).choices[0].text
    # The tiny model's greedy answer to "Hello" is all dots; a bias of -100 forbids them.
    assert plain == "." * 6
    assert "." not in client.completions.create(**base, logit_bias={str(token): -100}
                                                ).choices[0].text
    forced = {**base, "prompt": "The quick", "logit_bias": {str(token): 100}}
    assert "." not in client.completions.create(**{**forced, "logit_bias": None}
                                                ).choices[0].text
    assert client.completions.create(**forced).choices[0].text == "." * 6
    stopped = client.completions.create(**forced, extra_body={"stop_token_ids": [token]})
    choice = stopped.choices[0]
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", token)
    assert stopped.usage.completion_tokens == 1
    assert choice.text == ""  # a stop token's text is left out, as in vLLM...
    kept = client.completions.create(**forced, extra_body={"stop_token_ids": [token],
                                                           "include_stop_str_in_output": True})
    assert kept.choices[0].text == "."  # ...unless asked for
    # min_tokens holds the stop token off for three tokens; the fourth is forced to it.
    held = client.completions.create(**forced, extra_body={"stop_token_ids": [token],
                                                           "min_tokens": 3})
    assert held.choices[0].finish_reason == "stop"
    assert held.usage.completion_tokens == 4


def test_max_completion_tokens_user_and_unknown_fields(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=3,
        temperature=0, user="alice", extra_body={"ignore_eos": True, "not_a_field": {"x": 1}})
    assert answer.usage.completion_tokens == 3
    assert answer.choices[0].finish_reason == "length"


def test_a_seed_makes_sampling_repeatable(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt="Hello", max_tokens=8,
                                         temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in range(4)}) > 1


def test_models_version_tokenize_detokenize(server):
    models = httpx.get(server.base_url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 256
    assert httpx.get(server.base_url + "/version").json()["version"]
    tok = httpx.post(server.base_url + "/tokenize",
                     json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 256
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert text == {"prompt": "Hello world"}
    chat = httpx.post(server.base_url + "/tokenize",
                      json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > tok["count"] // 2
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}


async def test_64_concurrent_streams_all_complete(server):
    body = {"model": MODEL, "prompt": "The quick brown", "stream": True, "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}
    results: list[tuple[str, str]] = []

    async def one(http: httpx.AsyncClient) -> None:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            raw = b"".join([chunk async for chunk in r.aiter_raw()])
        events = raw.split(b"\n\n")
        assert events[-2:] == [b"data: [DONE]", b""]
        payloads = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
        reasons = [p["choices"][0]["finish_reason"] for p in payloads]
        text = "".join(p["choices"][0]["text"] for p in payloads)
        results.append((text, "".join(r for r in reasons if r)))

    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=server.base_url, limits=limits, timeout=120) as http:
        async with trio.open_nursery() as nursery:
            for _ in range(64):
                nursery.start_soon(one, http)
    assert len(results) == 64
    # Greedy on one prompt: batching must not change anyone's answer.
    assert len({text for text, _ in results}) == 1
    assert {reason for _, reason in results} == {"length"}


async def _wait_idle(server):
    with trio.fail_after(30):  # hang guard only; an abort takes one engine step
        while True:
            running, kv = await trio.to_thread.run_sync(lambda: (
                server.metric("engine:num_requests_running"),
                server.metric("engine:kv_cache_usage_perc")))
            if (running, kv) == (0, 0):
                return
            await trio.sleep(0.02)


def _engine_steps(server) -> int:
    return server.call(lambda: server.engine.statistics().steps)


def _aborted(server) -> float:
    text = httpx.get(server.base_url + "/metrics").text
    match = re.search(r'^engine:request_success_total\{finished_reason="abort"[^}]*\} (\S+)$',
                      text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@pytest.mark.parametrize("stream", [True, False], ids=["mid-stream", "mid-wait"])
async def test_disconnect_aborts_and_frees_kv_blocks(server, stream):
    host, port = server.base_url.removeprefix("http://").split(":")
    # Long enough (ignore_eos, up to the context) to still be running when we hang up.
    max_tokens = 240
    payload = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": max_tokens,
                          "ignore_eos": True, "stream": stream}).encode()
    steps_before = await trio.to_thread.run_sync(_engine_steps, server)
    aborted_before = await trio.to_thread.run_sync(_aborted, server)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\n" + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                     + payload)
        # Wait (one scrape at a time) until the request runs and holds KV blocks.
        with trio.fail_after(30):
            while 0 in await trio.to_thread.run_sync(  # noqa: ASYNC110 - polling another loop over HTTP
                    server.metrics, "engine:num_requests_running", "engine:kv_cache_usage_perc"):
                await trio.sleep(0.01)
        if stream:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    await _wait_idle(server)
    assert await trio.to_thread.run_sync(server.metric, "engine:num_requests_waiting") == 0
    # Going idle alone proves nothing (the request ends by itself within a second); it
    # must have been cut short: run to the end it takes one step per output token.
    steps = await trio.to_thread.run_sync(_engine_steps, server) - steps_before
    assert steps < max_tokens
    assert await trio.to_thread.run_sync(_aborted, server) == aborted_before + 1


def test_metrics_exports_every_documented_name(server, client):
    from engine.api.metrics import METRIC_NAMES

    client.completions.create(model=MODEL, prompt="Hello", **GREEDY)
    text = httpx.get(server.base_url + "/metrics").text
    for name in METRIC_NAMES:
        assert f"\n{name}" in text, name
    assert 'engine:request_success_total{finished_reason="length"' in text


def test_a_bad_request_is_a_400_and_the_engine_goes_on(server, client):
    # A logit_bias id past the vocabulary used to reach the sampler and kill the engine.
    vocab = server.engine.tokenizer.vocab_size
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                  logit_bias={str(vocab): 1})
    assert info.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[vocab], max_tokens=2)
    assert info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi " * 300)
    assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="Hi")
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="Hi", **GREEDY).usage.completion_tokens == 12


async def test_each_error_class_maps_to_the_clients_exception(model_folder):
    # The real engine this time (test_http_errors.py drives the same through a fake): one
    # running slot and one waiting slot, which a request with n=2 fills.
    key = "sk-real"
    opener = lambda: _open_engine(model_folder, max_num_seqs=1, max_queued_requests=1)  # noqa: E731
    with ServerThread(opener, api_key=key, max_request_bytes=4096) as srv:
        with openai.OpenAI(base_url=srv.base_url + "/v1", api_key=key, max_retries=0) as c, \
                openai.OpenAI(base_url=srv.base_url + "/v1", api_key="sk-wrong",
                              max_retries=0) as wrong:

            def call(client, **kwargs):
                return client.completions.create(**{"model": MODEL, "prompt": "Hi",
                                                    "max_tokens": 2, **kwargs})

            with pytest.raises(openai.AuthenticationError):
                await trio.to_thread.run_sync(call, wrong)
            with pytest.raises(openai.BadRequestError) as info:
                await trio.to_thread.run_sync(lambda: call(c, temperature=-1))
            assert info.value.body["param"] == "temperature"
            with pytest.raises(openai.NotFoundError):
                await trio.to_thread.run_sync(lambda: call(c, model="gpt-17"))
            with pytest.raises(openai.APIStatusError) as info:
                await trio.to_thread.run_sync(lambda: call(c, extra_body={"x": "y" * 5000}))
            assert info.value.status_code == 413
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 240, "n": 2, "stream": True,
                    "ignore_eos": True}
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=60,
                                         headers={"Authorization": f"Bearer {key}"}) as http:
                async with http.stream("POST", "/v1/completions", json=body) as busy:
                    assert busy.status_code == 200
                    with pytest.raises(openai.RateLimitError):
                        await trio.to_thread.run_sync(call, c)
            assert (await trio.to_thread.run_sync(call, c)).usage.completion_tokens == 2


async def test_actor_crash_makes_health_503_and_ends_streams(model_folder, monkeypatch):
    from engine.runner.model_runner import ModelRunner

    with ServerThread(lambda: _open_engine(model_folder)) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            body = {"prompt": "Hello", "max_tokens": 240, "ignore_eos": True, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.aiter_lines()
                assert (await anext(lines)).startswith("data: {")

                def crash(self, plan):
                    raise RuntimeError("injected crash")

                monkeypatch.setattr(ModelRunner, "execute", crash)
                events = [line async for line in lines if line]
            assert events[-1] == "data: [DONE]"
            assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "engine_dead"
            health = await http.get("/health")
            assert health.status_code == 503
            assert health.json()["error"]["code"] == "engine_dead"
            later = await http.post("/v1/completions", json={"prompt": "Hi"})
            assert later.status_code == 503


def test_cache_salt_keeps_a_prefix_private(server, client):
    # 40 tokens of prompt: two full 16-token blocks the prefix cache can share.
    prompt = list(range(100, 140))

    def hits_after(salt):
        before = server.metric("engine:prefix_cache_hits_total")
        extra = {"ignore_eos": True, **({"cache_salt": salt} if salt else {})}
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                  extra_body=extra)
        return server.metric("engine:prefix_cache_hits_total") - before

    hits_after("tenant-a")  # fills the cache under tenant-a's salt
    assert hits_after("tenant-b") == 0  # another salt sees none of it
    assert hits_after("tenant-a") == 32  # the same salt shares both full blocks
