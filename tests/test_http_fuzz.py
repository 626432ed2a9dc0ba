"""Property-based fuzzing of the real server on a tiny model: no request takes it down.

Hypothesis generates request bodies for every route: each field with wrong types,
out-of-range and extreme values (huge ints, NaN, infinities, denormals), huge and deeply
nested JSON, invalid Unicode. Properties: never a 5xx but the documented ``request_failed``
500, every body (streamed or not) strict JSON, the engine alive after each request, and the
KV cache empty once idle.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from engine_helpers import tiny_model
from http_server import ServerThread
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine
from engine.models.testing import TINY_VOCAB_SIZE

# A short context bounds every generation the fuzzer can ask for (the tiny model runs
# each in milliseconds); a small body limit makes 413s cheap to reach.
MAX_MODEL_LEN = 64
MAX_REQUEST_BYTES = 64 * 1024
EXAMPLES = 150
TIMEOUT = 60.0  # hang guard for one request


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tiny_model(tmp_path_factory)
    opener = lambda: engine.open_engine(  # noqa: E731
        str(model), dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
        kv_cache_memory=4 * 1024 * 1024, served_model_name="tiny")
    with ServerThread(opener, max_request_bytes=MAX_REQUEST_BYTES) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT) as c:
        yield c


def _strict_json(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} in response JSON: {text[:200]}")

    return json.loads(text, parse_constant=refuse)


# -- values -----------------------------------------------------------------------------

EXTREME_INTS = st.sampled_from([
    -1, 0, 1, 2, 255, 256, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63) - 1,
    10**30,
])
EXTREME_FLOATS = st.sampled_from([
    0.0, -0.0, 1e-320, 5e-324, 1e-5, 0.5, 1.0, 2.0, 100.0, 100.5, 1e43, 1e308,
    float("nan"), float("inf"), float("-inf"), -1e308,
])
NASTY_STRINGS = st.sampled_from(["", " ", "\ud800", "a\udfffb", "\x00", "Hello", "\u2028",
                                 "😀" * 3, "x" * 600, "<|im_start|>", "\ufffd"])
SCALARS = st.one_of(st.none(), st.booleans(), EXTREME_INTS, EXTREME_FLOATS, NASTY_STRINGS,
                    st.integers(), st.floats(), st.text(max_size=20))
ANY_JSON = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12)

# Plausible values per field, so requests also get past validation and into the engine.
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 600), max_size=8),
                        st.lists(st.text(max_size=8), min_size=1, max_size=3)),
    "messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "user", "user", "system", "assistant", "bogus"]),
        "content": st.one_of(st.text(max_size=20), st.none(), st.lists(st.fixed_dictionaries(
            {"type": st.just("text"), "text": st.text(max_size=8)}), max_size=2))}),
        min_size=1, max_size=3),
    "max_tokens": st.integers(-2, 80), "max_completion_tokens": st.integers(-2, 80),
    "min_tokens": st.integers(-1, 70), "n": st.integers(0, 4),
    "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-2, 600), "min_p": st.floats(-0.5, 1.5),
    "seed": st.integers(-(2**64), 2**64),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=40)),
    "stop_token_ids": st.one_of(st.lists(st.integers(-1, 600), max_size=5),
                                st.just(list(range(512)))),
    "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 200),
    "logit_bias": st.dictionaries(st.one_of(st.integers(-5, 600).map(str), st.text(max_size=3)),
                                  st.one_of(st.floats(-200, 200), EXTREME_FLOATS), max_size=4),
    "logprobs": st.one_of(st.integers(-1, 25), st.booleans()),
    "top_logprobs": st.integers(-1, 25), "echo": st.booleans(), "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries(
        {"include_usage": st.one_of(st.booleans(), SCALARS)})),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
    "priority": st.integers(-(2**65), 2**65), "cache_salt": st.one_of(st.text(max_size=4), SCALARS),
    "model": st.sampled_from(["tiny", "other", "\ud800", None]),
    "user": st.text(max_size=4),
    "tokens": st.lists(st.integers(-2, 600), max_size=6),
    "add_special_tokens": st.booleans(), "add_generation_prompt": st.booleans(),
}
ROUTES = {
    "/v1/completions": ["prompt", "max_tokens", "min_tokens", "n", "temperature", "top_p",
                        "top_k", "min_p", "seed", "stop", "stop_token_ids",
                        "presence_penalty", "frequency_penalty", "repetition_penalty",
                        "logit_bias", "logprobs", "echo", "ignore_eos", "stream",
                        "stream_options", "include_stop_str_in_output",
                        "skip_special_tokens", "priority", "cache_salt", "model", "user"],
    "/v1/chat/completions": ["messages", "max_tokens", "max_completion_tokens", "min_tokens",
                             "n", "temperature", "top_p", "top_k", "seed", "stop",
                             "stop_token_ids", "repetition_penalty", "logit_bias",
                             "logprobs", "top_logprobs", "stream", "stream_options", "model"],
    "/tokenize": ["prompt", "messages", "add_special_tokens", "add_generation_prompt", "model"],
    "/detokenize": ["tokens", "model"],
}


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    route = draw(st.sampled_from(sorted(ROUTES)))
    fields = draw(st.lists(st.sampled_from(ROUTES[route]), unique=True, max_size=7))
    main = ROUTES[route][0]
    if main not in fields and draw(st.integers(0, 9)) < 8:
        fields.insert(0, main)  # most requests carry their prompt, so they reach the engine
    body: dict[str, Any] = {}
    for name in fields:
        # Three times in four a plausible value, else anything at all.
        wild = draw(st.integers(0, 3)) == 0
        body[name] = draw(ANY_JSON if wild else PLAUSIBLE[name])
    if route.startswith("/v1/") and draw(st.booleans()):
        # Keep most generations short: the engine is real.
        body["max_tokens"] = draw(st.integers(1, 4))
    shape = draw(st.sampled_from(["json", "json", "json", "deep", "raw", "huge"]))
    if shape == "deep":
        # Spliced in as text: Python's own json module cannot build 5000 levels.
        name = draw(st.sampled_from(ROUTES[route]))
        depth = draw(st.sampled_from([62, 65, 1000, 5000]))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        body[name] = "@DEEP@"
        text = json.dumps(body, allow_nan=True)
        return route, text.replace('"@DEEP@"', opener * depth + "1" + closer * depth).encode()
    if shape == "raw":
        return route, draw(st.sampled_from([
            b"", b"{", b"\xff\xfe", b"[1,2]", b'{"prompt": NaN}', b'{"prompt": "a", "n": 1e999}',
            b'{"prompt": "\\ud800"}', b'{"messages": [{"role": "user", "content": "\\udc00"}]}',
            b"null", b'"just a string"', b'{"prompt": "a"} trailing',
        ]))
    elif shape == "huge":
        body["prompt"] = "a " * (MAX_REQUEST_BYTES // 2 + 1)
    return route, json.dumps(body, allow_nan=True).encode()


def _check(response: httpx.Response) -> None:
    status = response.status_code
    content_type = response.headers.get("content-type", "")
    if content_type.startswith("text/event-stream"):
        assert status == 200
        events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
        assert events[-1] == "[DONE]", response.text[-300:]
        for event in events[:-1]:
            chunk = _strict_json(event)
            if "error" in chunk:
                assert chunk["error"]["code"] == "request_failed", chunk
        return
    body = _strict_json(response.text)
    if status >= 500:
        assert status == 500 and body["error"]["code"] == "request_failed", body
    if status >= 400:
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert "Traceback" not in body["error"]["message"]


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(request=bodies())
def test_no_generated_request_takes_the_server_down(server, client, request) -> None:
    route, data = request
    response = client.post(route, content=data, headers={"content-type": "application/json"})
    _check(response)
    assert client.get("/health").status_code == 200
    assert not server.engine.dead


def test_the_engine_is_idle_and_its_kv_cache_empty_after_the_fuzzing(server, client) -> None:
    import time

    deadline = time.monotonic() + TIMEOUT
    while True:
        usage, running = server.metrics("engine:kv_cache_usage_perc", "engine:num_requests_running")
        if (usage, running) == (0.0, 0.0) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert (usage, running) == (0.0, 0.0)
    assert client.get("/health").status_code == 200


# -- the crashes the issue reports, one regression test each ---------------------------------

DEEP = "[" * 1000 + "]" * 1000


@pytest.mark.parametrize(
    ("name", "body", "param"),
    [
        # Each of these killed the engine for everybody (503 until a restart).
        ("top_k_2147483648_overflowed_int32", {"prompt": "Hi", "top_k": 2147483648}, "top_k"),
        # "Overflow when unpacking long long": 2**63 and past it do not fit a C int64.
        ("top_k_2pow63_overflowed_long_long", {"prompt": "Hi", "top_k": 2**63}, "top_k"),
        ("top_k_2pow64_overflowed_long_long", {"prompt": "Hi", "top_k": 2**64}, "top_k"),
        ("top_k_past_the_vocabulary", {"prompt": "Hi", "top_k": 100_000}, "top_k"),
        ("repetition_penalty_1e-320_indexed_past_the_vocabulary",
         {"prompt": "Hi", "repetition_penalty": 1e-320}, "repetition_penalty"),
        ("stop_token_ids_covering_the_vocabulary_with_min_tokens",
         {"prompt": "Hi", "min_tokens": 1, "stop_token_ids": list(range(TINY_VOCAB_SIZE))},
         "stop_token_ids"),
        # Each of these was a 500.
        ("logit_bias_1e43", {"prompt": "Hi", "logit_bias": {"5": 1e43}}, "logit_bias"),
        ("lone_surrogate_model", {"prompt": "Hi", "model": "\ud800"}, "model"),
        ("a_40000_character_stop_string", {"prompt": "Hi", "stop": ["x" * 40_000]}, "stop"),
    ],
    ids=lambda v: v if isinstance(v, str) and " " not in v and len(v) < 80 else None,
)
def test_what_crashed_the_server_is_a_400_naming_the_field(server, client, name, body, param) -> None:
    data = json.dumps(body).encode()  # ASCII escapes: "\ud800" as JSON clients send it
    response = client.post("/v1/completions", content=data,
                           headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(param)  # stop[0] names the item
    ok = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200 and not server.engine.dead


@pytest.mark.parametrize(
    ("route", "raw"),
    [
        ("/v1/completions", '{"prompt": ' + DEEP + "}"),
        ("/v1/completions", '{"prompt": "Hi", "logit_bias": ' + DEEP + "}"),
        ("/v1/chat/completions", '{"messages": ' + DEEP + "}"),
        ("/tokenize", '{"prompt": ' + DEEP + "}"),
    ],
)
def test_json_nested_a_thousand_levels_is_a_400(client, route, raw) -> None:
    response = client.post(route, content=raw.encode(), headers={"content-type": "application/json"})
    assert response.status_code == 400 and "nests" in response.json()["error"]["message"]


# -- the metrics vLLM's dashboards chart ---------------------------------------------------


def _samples(client: httpx.Client) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.labels.get("le") in (None, "+Inf"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def test_the_vllm_dashboard_metrics_follow_a_request(server, client) -> None:
    before = _samples(client)
    body = {"prompt": "Hello there", "max_tokens": 6, "ignore_eos": True, "stream": True}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200
    after = _samples(client)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    for name in ("time_per_output_token_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens"):
        assert grew(f"engine:{name}_count") == 1, name
    assert grew("engine:request_generation_tokens_sum") == 6
    prompt = client.post("/tokenize", json={"prompt": "Hello there"}).json()["count"]
    assert grew("engine:request_prompt_tokens_sum") == prompt
    # Prefill then decode make up the inference time.
    parts = grew("engine:request_prefill_time_seconds_sum") + grew(
        "engine:request_decode_time_seconds_sum")
    assert parts == pytest.approx(grew("engine:request_inference_time_seconds_sum"), abs=1e-6)
    # One prefill step and five decode steps (it ran alone): 6 steps, prompt + 5 tokens.
    assert grew("engine:iteration_tokens_total_count") >= 6
    assert grew("engine:iteration_tokens_total_sum") >= prompt + 5
    assert after["engine:cache_config_info"] == 1.0
