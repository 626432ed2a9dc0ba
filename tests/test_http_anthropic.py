"""Anthropic's Messages API (``POST /v1/messages``) through the official ``anthropic`` client.

One server on a tiny qwen2 whose chat template knows nothing of tools (so tools go
through the fallback tool prompt), with an API key. The oracles: the ``anthropic``
client's own parsing of responses and of the event stream (``get_final_message``), the
OpenAI chat route on the same server for what the same conversation costs in prompt
tokens (``/tokenize``) and what greedy decoding writes, and ``jsonschema`` for tool
inputs.
"""

from __future__ import annotations

import concurrent.futures
import json

import anthropic
import httpx
import jsonschema
import pytest
from chat_fixtures import EFFORT_TEMPLATE, WEATHER_TOOL, write_marker_model
from http_server import ServerThread

from engine.chat.request import ChatSettings
from engine.models.testing import CHATML_TEMPLATE

MODEL = "tiny-messages"
KEY = "sk-test-messages"
# Enums keep a random model's forced call short (a free string may be written as \u
# escapes, six tokens a character).
WEATHER = {"name": "get_weather", "description": WEATHER_TOOL["function"]["description"],
           "input_schema": {"type": "object", "properties": {
               "city": {"enum": ["Paris", "Oslo"]},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
WEATHER_OPENAI = {"type": "function", "function": {
    "name": WEATHER["name"], "description": WEATHER["description"],
    "parameters": WEATHER["input_schema"]}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# The client no longer takes sampling fields as arguments; the API still reads them.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import engine.api

    folder = write_marker_model(tmp_path_factory.mktemp("messages") / "m", CHATML_TEMPLATE)
    with ServerThread(lambda: engine.api.open_engine(
            str(folder), served_model_name=MODEL, max_model_len=1536,
            kv_cache_memory=32 * 2**20), api_key=KEY, chat=ChatSettings()) as srv:
        yield srv


@pytest.fixture
def clients(server):
    """``clients(**auth)``: a client of the server (the key as x-api-key by default),
    closed after the test."""
    made = []

    def make(**auth):
        made.append(anthropic.Anthropic(base_url=server.base_url, max_retries=0,
                                        **(auth or {"api_key": KEY})))
        return made[-1]

    yield make
    for client in made:
        client.close()


def _openai_count(server, messages, tools=None):
    """The prompt's token count as the OpenAI side templates the same conversation."""
    body = {"model": MODEL, "messages": messages,
            **({"tools": tools, "tool_choice": "auto"} if tools else {})}
    reply = httpx.post(server.base_url + "/tokenize", json=body,
                       headers={"Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 200, reply.text
    return reply.json()["count"]


def test_text_answer_matches_the_chat_route_streamed_and_not(server, clients):
    """Greedy: the Messages answer is the chat route's answer, streamed or not, and the
    usage counts are the chat route's."""
    client = clients()
    chat = httpx.post(server.base_url + "/v1/chat/completions", headers={
        "Authorization": f"Bearer {KEY}"}, json={
        "model": MODEL, "messages": [{"role": "system", "content": "Be brief."}, *ASK],
        "max_tokens": 12, "temperature": 0}).json()
    request = dict(model=MODEL, system="Be brief.", messages=ASK, max_tokens=12,
                   extra_body=GREEDY)
    full = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    expected_text = chat["choices"][0]["message"]["content"]
    for message in (full, streamed):
        assert message.type == "message" and message.role == "assistant"
        assert message.model == MODEL and message.id.startswith("msg_")
        assert [b.type for b in message.content] == ["text"]
        assert message.content[0].text == expected_text
        assert message.usage.input_tokens == chat["usage"]["prompt_tokens"]
        assert message.usage.output_tokens == chat["usage"]["completion_tokens"]
        assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
            chat["choices"][0]["finish_reason"]]
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=ASK)
    assert counted.input_tokens == chat["usage"]["prompt_tokens"]


def test_stop_sequence_ends_the_answer_where_it_first_appears(server, clients):
    client = clients()
    free = client.messages.create(model=MODEL, messages=ASK, max_tokens=24, extra_body=GREEDY)
    text = free.content[0].text
    stop = text[6:9]
    assert stop.strip(), text  # (a random model's greedy text; the test needs 3 visible chars)
    stopped = client.messages.create(model=MODEL, messages=ASK, max_tokens=24,
                                     extra_body=GREEDY, stop_sequences=["never written", stop])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert "".join(b.text for b in stopped.content) == text[:text.index(stop)]


@pytest.fixture(scope="module")
def ending(tmp_path_factory):
    """A server whose model ends its text at any token of its base vocabulary (every one an
    EOS id): only ignore_eos lets it write more than one token."""
    import engine.api
    from engine.models.testing import TINY_VOCAB_SIZE

    folder = write_marker_model(tmp_path_factory.mktemp("ending") / "m", CHATML_TEMPLATE)
    config = json.loads((folder / "generation_config.json").read_text())
    config["eos_token_id"] = list(range(TINY_VOCAB_SIZE))
    (folder / "generation_config.json").write_text(json.dumps(config))
    with ServerThread(lambda: engine.api.open_engine(
            str(folder), served_model_name=MODEL, max_model_len=512,
            kv_cache_memory=16 * 2**20), chat=ChatSettings()) as srv:
        yield srv


def test_ignore_eos_is_honoured_as_on_the_chat_route(ending):
    client = anthropic.Anthropic(base_url=ending.base_url, api_key="unused", max_retries=0)
    with client:
        ended = client.messages.create(model=MODEL, messages=ASK, max_tokens=8,
                                       extra_body=GREEDY)
        assert (ended.stop_reason, ended.usage.output_tokens) == ("end_turn", 1)
        for body in ({**GREEDY, "ignore_eos": True}, {**GREEDY, "ignore_eos": "true"}):
            full = client.messages.create(model=MODEL, messages=ASK, max_tokens=8,
                                          extra_body=body)
            assert (full.stop_reason, full.usage.output_tokens) == ("max_tokens", 8)
    chat = httpx.post(ending.base_url + "/v1/chat/completions", json={
        "model": MODEL, "messages": ASK, "max_tokens": 8, "ignore_eos": True,
        **GREEDY}).json()
    assert full.content[0].text == chat["choices"][0]["message"]["content"]


def _events(server, body):
    """The raw SSE stream: (event name, data) pairs."""
    pairs = []
    with httpx.stream("POST", server.base_url + "/v1/messages", json=body,
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as reply:
        assert reply.status_code == 200
        name = None
        for line in reply.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                pairs.append((name, json.loads(line[len("data: "):])))
    return pairs


def test_stream_events_come_in_anthropics_order(server):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 200, "stream": True,
            "tools": [WEATHER], "temperature": 0,
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    pairs = _events(server, body)
    assert all(name == data["type"] for name, data in pairs)
    names = [name for name, _ in pairs]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1:3] == ["content_block_start", "ping"] and names.count("ping") == 1
    # Blocks: start, deltas, stop, with indices counting up from 0.
    open_index = None
    starts = 0
    for name, data in pairs[1:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == starts
            open_index, starts = data["index"], starts + 1
        elif name in ("content_block_delta", "content_block_stop"):
            assert data["index"] == open_index
            if name == "content_block_stop":
                open_index = None
    assert open_index is None and starts >= 1
    delta = pairs[-2][1]
    assert delta["usage"]["output_tokens"] <= 200
    assert pairs[0][1]["message"]["usage"]["input_tokens"] > 0


def test_a_forced_call_cut_short_streams_the_blocks_the_whole_answer_has(server, clients):
    """tool_choice any cut by max_tokens: the unfinished call is no block, streamed or
    not (the stream sent its markup as a text block)."""
    body = {"model": MODEL, "messages": ASK, "max_tokens": 10, "tools": [WEATHER],
            "tool_choice": {"type": "any"}}
    whole = clients().messages.create(**body, extra_body=GREEDY)
    assert whole.stop_reason == "max_tokens"
    pairs = _events(server, {**body, **GREEDY, "stream": True})
    started = [data["content_block"]["type"] for name, data in pairs
               if name == "content_block_start"]
    assert started == [block.type for block in whole.content]
    assert pairs[-2][1]["delta"]["stop_reason"] == "max_tokens"


def test_tool_round_trip_through_the_fallback_prompt(server, clients):
    """tool_choice any: the answer is a tool_use whose input validates; sent back with a
    tool_result, the next prompt is the OpenAI conversation it means (same token count)."""
    client = clients()
    request = dict(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=200,
                   tool_choice={"type": "any", "disable_parallel_tool_use": True})

    def stream():
        with client.messages.stream(**request, extra_body=GREEDY) as events:
            return events.get_final_message()

    # Both in flight at once: the engine batches them.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streaming = pool.submit(stream)
        full = client.messages.create(**request, extra_body=GREEDY)
        streamed = streaming.result()
    for message in (full, streamed):
        if message.stop_reason == "max_tokens":
            pytest.fail(f"the forced call did not end within 200 tokens: {message}")
        assert message.stop_reason == "tool_use"
        (use,) = [b for b in message.content if b.type == "tool_use"]
        assert use.name == "get_weather"
        jsonschema.validate(use.input, WEATHER["input_schema"])
    assert streamed.content[-1].input == full.content[-1].input
    use = full.content[-1]
    history = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in full.content]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": use.id, "content": "9C, rain"},
                   {"type": "text", "text": "Thanks!"}]}]
    answer = client.messages.create(model=MODEL, messages=history, tools=[WEATHER],
                                    tool_choice={"type": "none"}, max_tokens=8)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in answer.content)
    openai_history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function",
         "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "9C, rain"},
        {"role": "user", "content": "Thanks!"}]
    # tool_choice none keeps the tools out of the prompt, on both sides.
    assert answer.usage.input_tokens == _openai_count(server, openai_history)
    counted = client.messages.count_tokens(model=MODEL, messages=history, tools=[WEATHER])
    assert counted.input_tokens == _openai_count(server, openai_history, [WEATHER_OPENAI])


def test_consecutive_turns_of_one_role_are_combined_into_one(server, clients):
    """Anthropic's rule: consecutive user (or assistant) turns are one turn. Counted on the
    OpenAI side as that one turn: its tool results first, then its blocks in order."""
    from engine.http.anthropic.protocol import chat_body

    client = clients()
    split = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "user", "content": [{"type": "text", "text": "And in Rome?"}]}]
    counted = client.messages.count_tokens(model=MODEL, messages=split)
    assert counted.input_tokens == _openai_count(server, [{"role": "user", "content": [
        {"type": "text", "text": "Weather in Paris?"}, {"type": "text", "text": "And in Rome?"}]}])
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    body = chat_body({"model": MODEL, "max_tokens": 5, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look."},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": "(a note)"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "9C"}]},
    ]}, reasoning=False)
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool", "user"]
    assert body["messages"][1]["content"] == "Let me look."
    assert [c["id"] for c in body["messages"][1]["tool_calls"]] == ["toolu_1"]
    assert body["messages"][2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "9C"}
    assert body["messages"][3] == {"role": "user", "content": "(a note)"}


def test_a_named_tool_is_called(server, clients):
    message = clients().messages.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=200, extra_body=GREEDY,
        tool_choice={"type": "tool", "name": "get_weather"})
    assert message.stop_reason == "tool_use"
    (use,) = message.content
    assert use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["input_schema"])


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": ASK}, "max_tokens"),
    # This model takes text only: the image block is refused by name.
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "iVBORw0KGgo="}}]}], "max_tokens": 5},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                        "data": "hi"}}]}], "max_tokens": 5},
     "messages[0].content[0].type"),
    ({"messages": ASK, "max_tokens": 5, "thinking": {"type": "enabled", "budget_tokens": 1024}},
     "thinking"),
    ({"messages": ASK, "max_tokens": 5, "tools": [{"type": "web_search_20250305",
                                                    "name": "web_search"}]}, "tools[0].type"),
    ({"messages": ASK, "max_tokens": 5, "mcp_servers": [{"type": "url", "url": "x"}]},
     "mcp_servers"),
    ({"messages": [{"role": "system", "content": "hi"}], "max_tokens": 5}, "messages[0].role"),
    # A tool_result must answer a tool_use of the message before it (Anthropic's rule).
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "9C"}]}],
      "max_tokens": 5}, "messages[0].content[0].tool_use_id"),
    ({"messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "9C"}]}],
      "max_tokens": 5, "tools": [WEATHER]}, "messages[2].content[0].tool_use_id"),
    # The chat path refuses stop strings beside a forced call; the error says the
    # Messages name.
    ({"messages": ASK, "max_tokens": 5, "stop_sequences": ["}"], "tools": [WEATHER],
      "tool_choice": {"type": "any"}}, "stop_sequences"),
])
def test_unsupported_or_bad_fields_are_anthropic_400s_naming_them(clients, body, param):
    with pytest.raises(anthropic.BadRequestError) as info:
        clients().post("/v1/messages", cast_to=object,
                             body={"model": MODEL, **body})
    assert info.value.status_code == 400
    error = info.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert param in error["error"]["message"]


def test_auth_takes_x_api_key_or_bearer_and_answers_in_anthropics_shape(server, clients):
    ok = clients(auth_token=KEY).messages.create(  # Authorization: Bearer
        model=MODEL, messages=ASK, max_tokens=2)
    assert ok.usage.output_tokens <= 2
    with pytest.raises(anthropic.AuthenticationError) as info:
        clients(api_key="wrong").messages.create(model=MODEL, messages=ASK,
                                                         max_tokens=2)
    assert info.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        clients().messages.create(model="claude-x", messages=ASK, max_tokens=2)
    assert missing.value.body["error"]["type"] == "not_found_error"


def test_a_prefill_is_continued_as_the_chat_route_continues_it(server, clients):
    prefill = [*ASK, {"role": "assistant", "content": "The weather in Paris"}]
    chat = httpx.post(server.base_url + "/v1/chat/completions", headers={
        "Authorization": f"Bearer {KEY}"}, json={
        "model": MODEL, "messages": prefill, "max_tokens": 6, "temperature": 0,
        "add_generation_prompt": False, "continue_final_message": True}).json()
    message = clients().messages.create(model=MODEL, messages=prefill, max_tokens=6,
                                        extra_body=GREEDY)
    assert message.content[0].text == chat["choices"][0]["message"]["content"]


def test_reasoning_text_and_calls_stream_as_blocks_the_client_assembles():
    """Chat chunks with reasoning, text and two calls (as a reasoning parser and a tool
    parser give them) become thinking, text and tool_use blocks; the anthropic client's
    own accumulator reads the events into the message the non-streamed path builds."""
    import httpx2  # the anthropic client's HTTP library

    from engine.http.anthropic.protocol import MessageEvents, message_from_chat

    def chunk(delta=None, finish=None, stop=None):
        return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish,
                             "stop_reason": stop}], "usage": None}

    chunks = [chunk({"role": "assistant", "content": ""}),
              chunk({"reasoning": "Paris, "}), chunk({"reasoning": "so call."}),
              chunk({"content": "One moment."}),
              chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                     "function": {"name": "get_weather", "arguments": ""}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
              chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                                     "function": {"name": "get_time", "arguments": ""}}]}),
              chunk({"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]},
                    finish="tool_calls"),
              {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 30}}]
    events = MessageEvents("msg_1", MODEL, 7)
    frames = events.start() + [f for c in chunks for f in events.chunk(c)]
    parsed = [json.loads(f.split(b"\ndata: ", 1)[1]) for f in frames]

    def answer(request):
        return httpx2.Response(200, content=b"".join(frames),
                               headers={"content-type": "text/event-stream"})

    with anthropic.Anthropic(api_key="x", base_url="http://test", http_client=httpx2.Client(
            transport=httpx2.MockTransport(answer))) as client:
        with client.messages.stream(model=MODEL, messages=ASK, max_tokens=30) as stream:
            snapshot = stream.get_final_message()
    assert [d["type"] for d in parsed if d["type"].startswith("message")] == [
        "message_start", "message_delta", "message_stop"]
    chat = {"choices": [{"message": {
        "role": "assistant", "content": "One moment.", "reasoning": "Paris, so call.",
        "tool_calls": [{"id": "call_a", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_b", "type": "function", "function": {
                "name": "get_time", "arguments": "{}"}}]},
        "finish_reason": "tool_calls", "stop_reason": None}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 30}}
    assert snapshot.model_dump(exclude_none=True) == \
        anthropic.types.Message.model_validate(
            message_from_chat(chat, "msg_1", MODEL)).model_dump(exclude_none=True)
    assert [b.type for b in snapshot.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert snapshot.stop_reason == "tool_use" and snapshot.usage.output_tokens == 30


def test_an_error_mid_stream_ends_it_with_an_error_event(tmp_path):
    """An engine crash after the 200: the stream ends with Anthropic's error event, and
    later requests are Anthropic 503 bodies (which the anthropic client reads)."""
    from http_fake_engine import open_fake_engine

    from engine.models.testing import write_tiny_model
    from engine.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(write_tiny_model(tmp_path / "m", "qwen2"))
    opener = lambda: open_fake_engine(tokenizer, step_delay=0.01, max_model_len=256,  # noqa: E731
                                      served_model_name=MODEL)
    body = {"model": MODEL, "messages": ASK, "max_tokens": 200, "stream": True}
    with ServerThread(opener) as server:
        with httpx.stream("POST", server.base_url + "/v1/messages", json=body) as reply:
            lines = reply.iter_lines()
            assert next(lines) == "event: message_start"
            server.call(server.engine.crash, RuntimeError("injected"))
            rest = [line for line in lines if line]
        assert rest[-2] == "event: error"
        error = json.loads(rest[-1].removeprefix("data: "))
        assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
        with anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0) as client:
            with pytest.raises(anthropic.APIStatusError) as info:
                client.messages.create(model=MODEL, messages=ASK, max_tokens=5)
        assert info.value.status_code == 503
        assert info.value.body["error"]["type"] == "overloaded_error"


def test_output_config_effort_reaches_a_template_that_reads_it(tmp_path, server, clients):
    """output_config.effort is the chat template's reasoning_effort where the template
    reads one: the prompt is transformers' rendering with the same value. A template
    that reads none (this module's server) ignores it: the same prompt as without."""
    from http_fake_engine import open_fake_engine
    from transformers import AutoTokenizer

    from engine.models.tokenizer import Tokenizer

    folder = write_marker_model(tmp_path / "m", EFFORT_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(str(folder))
    ask = [{"role": "user", "content": "Hi there"}]
    with ServerThread(lambda: open_fake_engine(Tokenizer.from_folder(folder),
                                               served_model_name=MODEL, max_model_len=1024)) as srv:
        client = anthropic.Anthropic(base_url=srv.base_url, api_key="unused", max_retries=0)
        with client:
            counted = {effort: client.messages.count_tokens(
                model=MODEL, messages=ask, extra_body={"output_config": {"effort": effort}})
                for effort in ("low", "high")}
            answered = client.messages.create(model=MODEL, messages=ask, max_tokens=2,
                                              extra_body={"output_config": {"effort": "high"}})
            with pytest.raises(anthropic.BadRequestError) as info:
                client.messages.create(model=MODEL, messages=ask, max_tokens=2,
                                       extra_body={"output_config": {"effort": 3}})
    for effort, count in counted.items():
        want = tok.apply_chat_template(ask, tokenize=True, add_generation_prompt=True,
                                       reasoning_effort=effort, return_dict=False)
        assert count.input_tokens == len(want)
    assert answered.usage.input_tokens == counted["high"].input_tokens
    assert "output_config.effort" in info.value.body["error"]["message"]
    # Without the effort this template writes no "Effort: ..." line.
    assert counted["low"].input_tokens > len(tok.apply_chat_template(
        ask, tokenize=True, add_generation_prompt=True, return_dict=False))
    plain = clients().messages.count_tokens(model=MODEL, messages=ASK)
    hinted = clients().messages.count_tokens(model=MODEL, messages=ASK,
                                             extra_body={"output_config": {"effort": "low"}})
    assert hinted.input_tokens == plain.input_tokens
