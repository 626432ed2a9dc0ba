"""Tool calling, reasoning and chat-template controls through HTTP with the openai client.

Two servers per module on a tiny qwen2 whose chat template knows tools (``TOOL_TEMPLATE``):

* a scripted one (the fake engine plays a model's exact output), for the wire format of
  parsed calls and reasoning: the openai client's stream helper must assemble the
  streamed ``delta.tool_calls`` into the same calls as the non-streamed answer;
* the real engine, for what no script can show: ``tool_choice: "none"`` never returns
  calls, bad input is a 400 naming the field while the server keeps serving and every KV
  block comes back, chat-template controls reach the prompt.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from chat_fixtures import ROUND_TRIP, TOOL_TEMPLATE, TOOLS, WEATHER_TOOL
from http_fake_engine import open_fake_engine
from http_server import ServerThread

from engine.chat.request import ChatSettings
from engine.models.testing import write_tiny_model
from engine.models.tokenizer import Tokenizer

MODEL = "tiny-tools"
HERMES = ChatSettings(tool_call_parser="hermes", enable_auto_tool_choice=True,
                      reasoning_parser="qwen3", trust_request_chat_template=True)
PARIS = {"city": "Paris", "unit": "celsius"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(PARIS) + "}\n</tool_call>"
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("tools"), "qwen2")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOL_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def scripted(folder):
    tokenizer = Tokenizer.from_folder(folder)
    with ServerThread(lambda: open_fake_engine(tokenizer, served_model_name=MODEL,
                                               max_model_len=1024), chat=HERMES) as srv:
        yield srv


@pytest.fixture(scope="module")
def real(folder):
    import engine.api

    with ServerThread(lambda: engine.api.open_engine(
            str(folder), served_model_name=MODEL, max_model_len=512,
            kv_cache_memory=32 * 2**20), chat=HERMES) as srv:
        yield srv


def _client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _both(server, script, **request):
    """The non-streamed answer and the stream helper's assembled one, for one script."""
    server.engine.script = script
    client = _client(server)
    full = client.chat.completions.create(model=MODEL, **request)
    with client.chat.completions.stream(model=MODEL, **request) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion()
    return full.choices[0], streamed.choices[0]


def _calls(message):
    return [(c.type, c.function.name, json.loads(c.function.arguments))
            for c in message.tool_calls or []]


def test_auto_call_streamed_assembles_to_the_unstreamed_call(scripted):
    full, streamed = _both(scripted, "Let me check.\n" + CALL, messages=ASK, tools=TOOLS)
    for choice in (full, streamed):
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me check."
        assert _calls(choice.message) == [("function", "get_weather", PARIS)]
        assert choice.message.tool_calls[0].id.startswith("call_")
    assert full.message.tool_calls[0].function.arguments == \
        streamed.message.tool_calls[0].function.arguments


def test_parallel_calls_keep_their_order_and_indices(scripted):
    script = CALL + "\n" + CALL.replace("get_weather", "get_time").replace(
        json.dumps(PARIS), '{"zone": "UTC", "hour24": true}')
    full, streamed = _both(scripted, script, messages=ASK, tools=TOOLS)
    # (The stream's first chunk carries the role with content "", as vLLM's does.)
    assert full.message.content is None and not streamed.message.content
    for choice in (full, streamed):
        assert _calls(choice.message) == [("function", "get_weather", PARIS),
                                          ("function", "get_time", {"zone": "UTC", "hour24": True})]
        assert len({c.id for c in choice.message.tool_calls}) == 2


def test_malformed_call_comes_back_as_content(scripted):
    script = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    full, streamed = _both(scripted, script, messages=ASK, tools=TOOLS)
    for choice in (full, streamed):
        assert choice.finish_reason == "stop"
        assert choice.message.content == script and not choice.message.tool_calls


def test_tool_choice_none_returns_the_text(scripted):
    full, streamed = _both(scripted, CALL, messages=ASK, tools=TOOLS, tool_choice="none")
    for choice in (full, streamed):
        assert choice.message.content == CALL and not choice.message.tool_calls
        assert choice.finish_reason == "stop"


def test_reasoning_is_split_from_content_and_calls(scripted):
    script = "<think>\nThe user wants Paris.\n</think>\n\n" + CALL
    full, streamed = _both(scripted, script, messages=ASK, tools=TOOLS)
    for choice in (full, streamed):
        assert choice.message.model_extra["reasoning_content"] == "\nThe user wants Paris.\n"
        assert not choice.message.content
        assert _calls(choice.message) == [("function", "get_weather", PARIS)]


def test_streamed_deltas_are_framed_as_openai_frames_them(scripted):
    scripted.engine.script = "Ok.\n" + CALL
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "stream": True}
    with httpx.stream("POST", scripted.base_url + "/v1/chat/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    calls = [d["tool_calls"] for c in chunks for d in [c["choices"][0]["delta"]]
             if "tool_calls" in d]
    assert calls[0] == [{"index": 0, "id": calls[0][0]["id"], "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]
    assert all("id" not in part and "name" not in part["function"]
               for delta in calls[1:] for part in delta)
    assert "".join(p["function"]["arguments"] for d in calls for p in d) == json.dumps(PARIS)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# -- the real engine ----------------------------------------------------------------------


def test_tool_choice_none_never_produces_calls(real):
    client = _client(real)
    for seed in range(6):
        reply = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", seed=seed,
            max_tokens=24, temperature=1.0)
        choice = reply.choices[0]
        assert not choice.message.tool_calls and choice.finish_reason in ("stop", "length")
        assert isinstance(choice.message.content, str)


def test_round_trip_history_reaches_the_template(real):
    """A conversation with an assistant call and a tool result is accepted, and its
    prompt is the template's rendering of it with the call's arguments as an object."""
    client = _client(real)
    reply = client.chat.completions.create(model=MODEL, messages=ROUND_TRIP, tools=TOOLS,
                                           tool_choice="none", max_tokens=4)
    tokens = httpx.post(real.base_url + "/tokenize", json={
        "messages": ROUND_TRIP, "tools": TOOLS}).json()
    tokenizer = Tokenizer.from_folder(real.engine.config.model)
    text = tokenizer.decode(tokens["tokens"], skip_special_tokens=False)
    assert '"arguments": {"city": "Paris", "unit": "celsius"}' in text
    assert "<tool_response>\n9 degrees, rain\n</tool_response>" in text
    # tool_choice "none" keeps the tools out of the prompt; /tokenize with them counts more.
    assert reply.usage.prompt_tokens < tokens["count"]


BAD = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "wrong"}}}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"messages": [*ASK, {"role": "tool", "content": "9C"}]}, "messages[1].tool_call_id"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
      "function": {"name": "get_weather", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
     "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"continue_final_message": True}, "continue_final_message"),
]


@pytest.mark.parametrize(("change", "param"), BAD)
def test_bad_tool_input_is_a_400_naming_the_field_and_frees_nothing(real, change, param):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **change}
    for stream in (False, True):
        r = httpx.post(real.base_url + "/v1/chat/completions", json={**body, "stream": stream})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    ok = _client(real).chat.completions.create(model=MODEL, messages=ASK, max_tokens=4)
    assert ok.choices[0].finish_reason in ("stop", "length")
    stats = real.engine.statistics()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == 0


def test_prefill_echo_and_template_kwargs(real):
    prefill = [*ASK, {"role": "assistant", "content": "The weather in Paris is"}]
    client = _client(real)
    extra = {"continue_final_message": True, "add_generation_prompt": False, "echo": True}
    reply = client.chat.completions.create(model=MODEL, messages=prefill, max_tokens=6,
                                           temperature=0, extra_body=extra)
    assert reply.choices[0].message.content.startswith("The weather in Paris is")
    tokens = httpx.post(real.base_url + "/tokenize", json={"messages": prefill, **extra}).json()
    assert reply.usage.prompt_tokens == tokens["count"]
    # A request's own template, with its kwargs, is what the prompt is made of.
    template = "{{ greeting }} {{ messages[0].content }}"
    counted = httpx.post(real.base_url + "/tokenize", json={
        "messages": ASK, "chat_template": template,
        "chat_template_kwargs": {"greeting": "Hello there"}}).json()
    tokenizer = Tokenizer.from_folder(real.engine.config.model)
    assert counted["tokens"] == tokenizer.encode("Hello there Weather in Paris?",
                                                 add_special_tokens=False)


def test_request_id_header_model_card_and_ping(real):
    base = real.base_url
    r = httpx.post(base + "/v1/chat/completions", headers={"X-Request-Id": "trace-42"},
                   json={"model": MODEL, "messages": ASK, "max_tokens": 2})
    assert r.headers["X-Request-Id"] == "trace-42"
    assert r.json()["id"] == "chatcmpl-trace-42"
    assert httpx.get(base + f"/v1/models/{MODEL}").json()["id"] == MODEL
    missing = httpx.get(base + "/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.get(base + "/ping").json() == {"status": "ok"}
    bad = httpx.post(base + "/v1/chat/completions", headers={"X-Request-Id": "x" * 300},
                     json={"model": MODEL, "messages": ASK, "max_tokens": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"


def test_weather_tool_fixture_is_a_valid_tool():
    from engine.chat.tools import parse_tools

    assert parse_tools([WEATHER_TOOL])[0].name == "get_weather"


async def test_generation_defaults_fill_what_a_request_leaves_out(tmp_path):
    """--generation-config auto takes generation_config.json's sampling fields; a body's
    own value wins; none turns them off."""
    import engine
    from engine.http import protocol

    path = write_tiny_model(tmp_path / "m", "llama")
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "temperature": 0.3, "top_k": 7, "do_sample": True}))
    options = {"max_model_len": 128, "kv_cache_memory": 8 * 2**20}
    async with engine.open_engine(str(path), **options) as eng:
        assert eng.sampling_defaults == {"temperature": 0.3, "top_k": 7}
        params = protocol.parse_chat({"messages": ASK, "top_k": 3},
                                     defaults=eng.sampling_defaults).params
        assert (params.temperature, params.top_k) == (0.3, 3)
    async with engine.open_engine(str(path), generation_config="none", **options) as eng:
        assert eng.sampling_defaults == {}


async def test_embedded_chat_returns_typed_messages(folder):
    import engine
    from engine.chat.output import ChatMessage
    from engine.errors import InvalidParamError
    from engine.params import SamplingParams

    async with engine.open_engine(str(folder), max_model_len=256,
                                  kv_cache_memory=8 * 2**20) as eng:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        result = await eng.chat(ROUND_TRIP, params, tools=TOOLS, tool_choice="none")
        (choice,) = result.choices
        assert isinstance(choice.message, ChatMessage) and choice.message.tool_calls == ()
        assert result.completion_tokens == 6 and choice.finish_reason == "length"
        streamed = "".join([c.delta.content async for c in eng.chat_stream(
            ROUND_TRIP, params, tools=TOOLS, tool_choice="none")])
        assert streamed == choice.message.content
        with pytest.raises(InvalidParamError) as info:
            await eng.chat(ASK, params, tools=TOOLS, tool_choice={
                "type": "function", "function": {"name": "nope"}})
        assert info.value.param == "tool_choice"
        assert eng.statistics().running == 0


def test_usage_reports_the_prefix_cache_hit(real):
    """The second request with the same long prompt finds its full blocks cached."""
    client = _client(real)
    long = [{"role": "user", "content": "Tell me about the weather. " * 12}]
    first = client.chat.completions.create(model=MODEL, messages=long, max_tokens=2,
                                           extra_body={"cache_salt": "usage-test"})
    second = client.chat.completions.create(model=MODEL, messages=long, max_tokens=2,
                                            extra_body={"cache_salt": "usage-test"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    block = real.engine.config.block_size
    assert cached > 0 and cached % block == 0 and cached < second.usage.prompt_tokens
