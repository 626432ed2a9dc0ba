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

import concurrent.futures
import dataclasses
import json

import httpx
import jsonschema
import openai
import pytest
from chat_fixtures import (
    ROUND_TRIP,
    THINK_TEMPLATE,
    TOOL_TEMPLATE,
    TOOLS,
    WEATHER_TOOL,
    marker_id,
    write_marker_model,
)
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
    # The markers (<tool_call>, </think>, ...) are single tokens, so a logit_bias can make
    # the random model open calls and end its reasoning.
    return write_marker_model(tmp_path_factory.mktemp("tools") / "m", TOOL_TEMPLATE)


@pytest.fixture(scope="module")
def scripted(folder):
    tokenizer = Tokenizer.from_folder(folder)
    with ServerThread(lambda: open_fake_engine(tokenizer, served_model_name=MODEL,
                                               max_model_len=1024), chat=HERMES) as srv:
        yield srv


@pytest.fixture(scope="module")
def real(folder):
    import engine.api

    # No reasoning parser here (the `thinker` server below has one): with qwen3's, a forced
    # call may open with <think>, which the random model then rarely closes.
    settings = dataclasses.replace(HERMES, reasoning_parser=None)
    with ServerThread(lambda: engine.api.open_engine(
            str(folder), served_model_name=MODEL, max_model_len=1536,
            kv_cache_memory=32 * 2**20, enable_prompt_tokens_details=True),
            chat=settings) as srv:
        yield srv


def _each_seed(seeds, request):
    """``request(seed)`` for every seed, all in flight at once (the engine batches them;
    one after another, a tiny-model request costs its full decode latency)."""
    with concurrent.futures.ThreadPoolExecutor(len(seeds)) as pool:
        return list(pool.map(request, seeds))


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
    """Output not held to the tools' grammar (a response_format takes its place; the
    scripted engine honours neither) is parsed whole: a broken call is content."""
    script = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    full, streamed = _both(scripted, script, messages=ASK, tools=TOOLS,
                           response_format={"type": "json_object"})
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
    # Under the tools' grammar the arguments stream as the model writes them, a fragment
    # per token, not as one piece once the call is complete.
    tokens = scripted.engine.tokenizer.encode(json.dumps(PARIS), add_special_tokens=False)
    assert len(calls) - 1 >= len(tokens) - 2 > 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# -- the real engine ----------------------------------------------------------------------


VALIDATORS = {t["function"]["name"]: jsonschema.Draft202012Validator(t["function"]["parameters"])
              for t in TOOLS}
NAMED = {"type": "function", "function": {"name": "get_time"}}


def _bias(server, **tokens: float) -> dict[str, int]:
    """openai's logit_bias (token id as text) for markers and plain tokens by their text."""
    tokenizer = server.engine.tokenizer
    out = {}
    for text, value in tokens.items():
        text = {"call": "<tool_call>", "end_think": "</think>", "eos": "<|im_end|>"}[text]
        out[str(marker_id(tokenizer, text))] = value
    return out


def _validated(message, finish_reason: str = "tool_calls") -> list[tuple[str, dict]]:
    """The message's calls as (name, arguments), each checked against its tool's schema.
    Cut short by max_tokens (``"length"``), the last call may be one the model was still
    writing: it is left out, and must be a prefix of some arguments object."""
    calls = []
    complete = list(message.tool_calls or [])
    if finish_reason == "length" and complete:
        last = complete[-1].function.arguments
        try:
            json.loads(last)
        except ValueError:
            assert not last or last.startswith("{"), last
            complete.pop()
    for call in complete:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        VALIDATORS[call.function.name].validate(arguments)
        calls.append((call.function.name, arguments))
    return calls


def _ended(replies, at_least: float = 0.75) -> list:
    """The choices, having checked that at least ``at_least`` of them ended on their own
    and every other one ran to its max_tokens (a random model at temperature 1 may chain
    calls or write text that long on some seed; which seeds depends on the batch's float
    rounding, so no seed is special)."""
    choices = [reply.choices[0] for reply in replies]
    for reply, choice in zip(replies, choices, strict=True):
        if choice.finish_reason == "length":
            assert reply.usage.completion_tokens > 0, choice
    ended = sum(choice.finish_reason != "length" for choice in choices)
    assert ended >= at_least * len(choices), [c.finish_reason for c in choices]
    return choices


@pytest.mark.parametrize(("choice", "parallel"), [("required", True), ("required", False),
                                                  (NAMED, True)])
def test_forced_calls_always_parse_and_validate(real, choice, parallel):
    """Over many seeds at temperature 1 the random model's forced calls come back as
    calls that validate, and the turn ends with finish_reason "tool_calls" ("stop" for a
    named call, as OpenAI and vLLM end one)."""
    client = _client(real)
    # (required is written as the template's <tool_call> blocks: after each the grammar
    # allows another or EOS, and even the random model's lists end.)
    counts = set()
    replies = _each_seed(range(8), lambda seed: client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, seed=seed,
        temperature=1.0, max_tokens=400, parallel_tool_calls=parallel))
    ended = "stop" if choice == NAMED else "tool_calls"
    for choice_ in _ended(replies):
        assert choice_.finish_reason in (ended, "length"), choice_
        assert choice_.message.content == ""  # a forced call's, as vLLM's
        calls = _validated(choice_.message, choice_.finish_reason)
        if choice_.finish_reason == ended:
            counts.add(len(calls))
        if choice == NAMED:
            assert [name for name, _ in calls] == ["get_time"]
        elif not parallel:
            assert len(calls) == 1
    if parallel and choice == "required":
        assert max(counts) > 1  # a list of calls, and it ended


def test_auto_calls_opened_by_the_model_validate(real):
    """tool_choice auto: the model writes text or opens calls (a bias on <tool_call>); a
    call it opens is held to the schema, so every call that comes back validates. (One
    call per turn: the random model's parallel auto calls run to max_tokens on half the
    seeds of some ranges; tests/test_chat_constraints.py checks them over 24 seeds.)"""
    client = _client(real)
    called = 0
    replies = _each_seed(range(8), lambda seed: client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, seed=seed, temperature=1.0,
        max_tokens=400, parallel_tool_calls=False, logit_bias=_bias(real, call=4, eos=3)))
    for choice in _ended(replies):
        calls = _validated(choice.message, choice.finish_reason)
        content = choice.message.content or ""
        if choice.finish_reason == "length":
            # Cut off before a call's name was complete, its opening is the content's end.
            head, opening, _ = content.rpartition("<tool_call>")
            content = head if opening else content
        else:
            assert choice.finish_reason == ("tool_calls" if calls else "stop"), choice
        assert "<tool_call>" not in content, choice
        called += bool(calls)
    assert 0 < called < 8  # both kinds of answer were seen


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_a_streamed_call_assembles_to_the_unstreamed_one(real, choice):
    client = _client(real)
    request = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, seed=3,
                   temperature=1.0, max_tokens=400, parallel_tool_calls=False,
                   logit_bias=_bias(real, call=6))
    full = client.chat.completions.create(**request).choices[0]
    with client.chat.completions.stream(**request) as stream:
        fragments = sum(event.type == "tool_calls.function.arguments.delta"
                        for event in stream)
        streamed = stream.get_final_completion().choices[0]
    assert full.finish_reason == streamed.finish_reason == "tool_calls"
    assert _validated(full.message) == _validated(streamed.message) != []
    assert [c.function.arguments for c in full.message.tool_calls] == \
        [c.function.arguments for c in streamed.message.tool_calls]
    # The call was generated under the tools' grammar in hermes syntax, so its arguments
    # streamed as they were written: a fragment per token, not one piece at the end.
    tokens = real.engine.tokenizer.encode(full.message.tool_calls[0].function.arguments,
                                          add_special_tokens=False)
    assert fragments >= len(tokens) - 2 > 1


def test_a_full_round_trip_call_result_answer(real):
    """The call the server made goes back with its result, and the model answers."""
    client = _client(real)
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice={
            "type": "function", "function": {"name": "get_weather"}}, seed=1,
        temperature=1.0, max_tokens=200)
    (call,) = first.choices[0].message.tool_calls
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "9 degrees, rain"}]
    final = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", seed=1,
        max_tokens=16, logit_bias=_bias(real, eos=2))
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
    assert isinstance(answer.message.content, str)
    # The prompt was the template's rendering of the call (arguments as an object) and
    # of the result.
    tokens = httpx.post(real.base_url + "/tokenize", json={
        "messages": history, "tools": TOOLS, "tool_choice": "none"}).json()
    assert final.usage.prompt_tokens == tokens["count"]
    text = real.engine.tokenizer.decode(tokens["tokens"], skip_special_tokens=False)
    assert f'"arguments": {call.function.arguments}' in text
    assert "<tool_response>\n9 degrees, rain\n</tool_response>" in text
    stats = real.engine.statistics()
    assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    import engine.api

    path = write_marker_model(tmp_path_factory.mktemp("think") / "m", THINK_TEMPLATE)
    settings = ChatSettings(reasoning_parser="deepseek_r1")
    with ServerThread(lambda: engine.api.open_engine(
            str(path), served_model_name=MODEL, max_model_len=1024,
            kv_cache_memory=16 * 2**20), chat=settings) as srv:
        yield srv


def test_the_reasoning_split_is_exact(thinker):
    """reasoning_content + "</think>" + content is, character for character, the text the
    same prompt and seed give through /v1/completions, streamed or not."""
    client = _client(thinker)
    prompt = httpx.post(thinker.base_url + "/tokenize", json={"messages": ASK}).json()
    def three_ways(seed):
        request = dict(seed=seed, temperature=1.0, max_tokens=60,
                       logit_bias=_bias(thinker, end_think=3, eos=2))
        raw = client.completions.create(model=MODEL, prompt=prompt["tokens"], **request)
        reply = client.chat.completions.create(model=MODEL, messages=ASK, **request)
        stream = list(client.chat.completions.create(model=MODEL, messages=ASK, stream=True,
                                                     **request))
        return raw.choices[0].text, reply.choices[0].message, stream

    split = 0
    for text, message, stream in _each_seed(range(6), three_ways):
        reasoning = message.model_extra.get("reasoning_content")
        if text.partition("</think>")[0]:
            assert reasoning is not None
        else:  # "</think>" first (or nothing at all): no reasoning, and no field for it
            assert reasoning is None and "reasoning_content" not in message.model_extra
            reasoning = ""
        if "</think>" in text:
            split += 1
            assert reasoning + "</think>" + (message.content or "") == text
        else:  # never closed: all reasoning
            assert reasoning == text and message.content is None
        streamed_reasoning = streamed_content = ""
        for chunk in stream:
            delta = chunk.choices[0].delta
            streamed_reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            streamed_content += delta.content or ""
        assert (streamed_reasoning, streamed_content) == (reasoning, message.content or "")
    assert split >= 3


def test_a_forced_call_after_reasoning_is_split_off(thinker):
    client = _client(thinker)
    replies = _each_seed(range(4), lambda seed: client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, seed=seed,
        temperature=1.0, max_tokens=200, logit_bias=_bias(thinker, end_think=3)))
    thought = 0
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice  # a named call's, as OpenAI's and vLLM's
        # A seed whose first token is "</think>" thinks nothing: no reasoning_content.
        thought += bool(choice.message.model_extra.get("reasoning_content"))
        assert choice.message.content == ""  # a forced call's, as vLLM's
        assert [name for name, _ in _validated(choice.message)] == ["get_time"]
    assert thought >= 2


@pytest.fixture(scope="module")
def smollm2():
    import engine.api
    from engine.models.loader import default_model_path

    # SmolLM2's template ignores tools: the fallback prompt describes them (~300 tokens).
    with ServerThread(lambda: engine.api.open_engine(
            str(default_model_path()), served_model_name=MODEL, max_model_len=1024,
            kv_cache_memory=64 * 2**20)) as srv:
        yield srv


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {
    "name": "get_weather"}}, "auto"])
def test_smollm2_calls_through_the_fallback_prompt_validate(smollm2, choice):
    client = _client(smollm2)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    # A forced turn asks for one call: with parallel calls allowed, SmolLM2 at temperature 1
    # may chain calls until max_tokens (9 calls in 400 tokens on one seed), a rightful
    # "length" that says nothing about whether the grammar ends a call.
    forced = {} if choice == "auto" else {"parallel_tool_calls": False}
    replies = _each_seed(range(4), lambda seed: client.chat.completions.create(
        model=MODEL, messages=ask, tools=TOOLS, tool_choice=choice, seed=seed,
        temperature=1.0, max_tokens=200 if choice != "auto" else 100, **forced))
    for reply in replies:
        answer = reply.choices[0]
        calls = _validated(answer.message)
        if choice != "auto":
            ended = "tool_calls" if choice == "required" else "stop"  # named: OpenAI's
            assert answer.finish_reason == ended and len(calls) == 1, answer
            assert answer.message.content == ""  # a forced call's, as vLLM's
        elif answer.finish_reason != "length":  # auto: text, or calls that validate
            assert answer.finish_reason == ("tool_calls" if calls else "stop"), answer
            assert "<tool_call>" not in (answer.message.content or "")


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


UNENFORCEABLE = {"type": "function", "function": {"name": "tag", "parameters": {
    "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}
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
    # A schema neither grammar backend enforces (uniqueItems): the forced call's
    # constraint names tool_choice, the auto call's tools.
    ({"tools": [UNENFORCEABLE], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [UNENFORCEABLE]}, "tools"),
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
    # vLLM's body field: the engine's id when no header names one; the header wins.
    body_id = httpx.post(base + "/v1/completions", json={
        "model": MODEL, "prompt": "hi", "max_tokens": 2, "request_id": "batch-7"}).json()
    assert body_id["id"] == "cmpl-batch-7"
    both = httpx.post(base + "/v1/chat/completions", headers={"X-Request-Id": "trace-43"},
                      json={"model": MODEL, "messages": ASK, "max_tokens": 2,
                            "request_id": "ignored"})
    assert both.json()["id"] == "chatcmpl-trace-43"
    bad = httpx.post(base + "/v1/chat/completions", json={
        "model": MODEL, "messages": ASK, "max_tokens": 2, "request_id": "a\nb"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id"


def test_weather_tool_fixture_is_a_valid_tool():
    from engine.chat.tools import parse_tools

    assert parse_tools([WEATHER_TOOL])[0].name == "get_weather"


async def test_generation_defaults_fill_what_a_request_leaves_out(tmp_path):
    """--generation-config auto takes generation_config.json's sampling fields; a body's
    own value wins; none turns them off."""
    import engine
    from engine.http.completions import protocol

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
    # vLLM's other two forms: "vllm" (none), and a folder whose generation_config.json is
    # read instead of the model's (transformers reads the same file as the oracle).
    from transformers import GenerationConfig

    from engine.errors import ConfigError

    other = tmp_path / "generation"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "do_sample": True}))
    want = GenerationConfig.from_pretrained(other)
    async with engine.open_engine(str(path), generation_config=str(other), **options) as eng:
        assert eng.sampling_defaults == {"temperature": want.temperature, "top_p": want.top_p}
    async with engine.open_engine(str(path), generation_config="vllm", **options) as eng:
        assert eng.sampling_defaults == {}
    with pytest.raises(ConfigError, match="generation_config"):
        async with engine.open_engine(str(path), generation_config=str(tmp_path / "nowhere"),
                                      **options):
            pass


async def test_override_generation_config_sets_defaults_and_caps_max_tokens(tmp_path):
    """vLLM's --override-generation-config: its sampling fields over the model's, and its
    max_new_tokens a chat's default max_tokens and every request's cap; without it,
    generation_config.json's max_new_tokens is a chat's default only."""
    import engine
    from engine.errors import ConfigError
    from engine.http.completions import protocol

    path = write_tiny_model(tmp_path / "m", "llama")
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "temperature": 0.3, "top_k": 7, "max_new_tokens": 6}))
    options = {"max_model_len": 128, "kv_cache_memory": 8 * 2**20}

    def limits(eng, server_defaults):
        chat = lambda **b: protocol.parse_chat({"messages": ASK, **b},  # noqa: E731
                                               defaults=server_defaults).params.max_tokens
        completion = lambda **b: protocol.parse_completion(  # noqa: E731
            {"prompt": "hi", **b}, defaults=server_defaults).params.max_tokens
        return chat(), chat(max_tokens=50), chat(max_tokens=2), completion(), completion(max_tokens=1)

    from engine.http.server import Server

    async with engine.open_engine(str(path), **options) as eng:
        assert (eng.default_max_tokens, eng.max_tokens_cap) == (6, None)
        assert limits(eng, Server(eng, api_key=None, max_request_bytes=2**20, chat=ChatSettings()).sampling_defaults) == (6, 50, 2, 16, 1)
    override = {"temperature": 0.0, "max_new_tokens": 3}
    async with engine.open_engine(str(path), override_generation_config=override,
                                  **options) as eng:
        assert eng.sampling_defaults == {"temperature": 0.0, "top_k": 7}
        assert (eng.default_max_tokens, eng.max_tokens_cap) == (3, 3)
        assert limits(eng, Server(eng, api_key=None, max_request_bytes=2**20, chat=ChatSettings()).sampling_defaults) == (3, 3, 2, 3, 1)
    async with engine.open_engine(str(path), generation_config="none",
                                  override_generation_config='{"top_p": 0.5}', **options) as eng:
        assert eng.sampling_defaults == {"top_p": 0.5}
        assert (eng.default_max_tokens, eng.max_tokens_cap) == (None, None)
    for bad, field in (({"presence_penalty": 1.0}, "presence_penalty"),
                       ({"top_p": 2}, "top_p"), ({"max_new_tokens": 0}, "max_new_tokens")):
        with pytest.raises(ConfigError, match=field) as info:
            engine.EngineConfig(override_generation_config=bad)
        assert info.value.field == "override_generation_config"


def test_override_generation_config_served_gives_transformers_greedy_tokens(tmp_path):
    """Served with an override of temperature 0 and max_new_tokens 3, a request that sets
    neither gets transformers' first three greedy tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    import engine

    path = write_tiny_model(tmp_path / "m", "llama")
    prompt = [5, 17, 99, 42, 8]
    hf = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False,
                           min_new_tokens=3)[0, len(prompt):].tolist()
    opener = lambda: engine.open_engine(  # noqa: E731
        str(path), dtype="float32", max_model_len=128, kv_cache_memory=8 * 2**20,
        override_generation_config={"temperature": 0, "max_new_tokens": 3})
    with ServerThread(opener) as srv:
        answer = httpx.post(srv.base_url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 40, "ignore_eos": True,
            "return_token_ids": True}).json()
    choice = answer["choices"][0]
    assert choice["token_ids"] == want
    assert choice["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 3


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


async def test_embedded_tools_go_in_and_calls_come_out_typed(folder):
    """Tool and ToolChoice values in; ToolCall values with parsed arguments out; the reply
    goes back into the history as it is, with the tool's result."""
    import engine
    from engine.chat import ChatMessage, Tool, ToolCall, ToolChoice
    from engine.params import SamplingParams

    weather = Tool("get_weather", WEATHER_TOOL["function"]["parameters"], "The weather.")
    async with engine.open_engine(str(folder), max_model_len=1024,
                                  kv_cache_memory=8 * 2**20) as eng:
        params = SamplingParams(max_tokens=200, temperature=1.0, seed=5)
        # This template reads tools and no parser is set: required is a JSON list here.
        for choice in (ToolChoice("required"), ToolChoice("function", "get_weather")):
            result = await eng.chat(ASK, params, tools=[weather, TOOLS[1]], tool_choice=choice,
                                    parallel_tool_calls=False)
            (answer,) = result.choices
            assert isinstance(answer.message, ChatMessage)
            # A named call ends with "stop", as OpenAI and vLLM end one.
            assert answer.finish_reason == ("stop" if choice.name else "tool_calls")
            (call,) = answer.message.tool_calls
            assert isinstance(call, ToolCall)
            VALIDATORS[call.name].validate(call.args())
        history = [*ASK, answer.message,
                   {"role": "tool", "tool_call_id": call.id, "content": "9 degrees, rain"}]
        final = await eng.chat(history, SamplingParams(max_tokens=4), tools=[weather],
                               tool_choice="none")
        assert final.choices[0].message.tool_calls == ()
        as_dicts = [*ASK, answer.message.to_openai(), history[-1]]
        again = await eng.chat(as_dicts, SamplingParams(max_tokens=4), tools=[weather],
                               tool_choice="none")
        assert final.prompt_tokens == again.prompt_tokens
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


# -- stop strings against forced and constrained calls (issue 28) ---------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_with_a_named_tool_call_is_a_400_naming_stop(real, stream):
    # A stop `"` used to end the named call's arguments at `{` and answer
    # finish_reason "tool_calls" with those arguments.
    r = httpx.post(real.base_url + "/v1/chat/completions", json={
        "model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": NAMED, "stop": ['"'],
        "max_tokens": 40, "stream": stream})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_with_required_tool_calls_is_a_400_naming_stop(real, stream):
    # With `required`, a stop `"` left content `<tool_call>\n{` and no call.
    r = httpx.post(real.base_url + "/v1/chat/completions", json={
        "model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
        "stop": '"', "max_tokens": 40, "stream": stream})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "stop"


def test_a_stop_string_inside_an_auto_call_never_gives_non_json_arguments(scripted):
    """``auto`` with ``stop``: calls are read from free text (no call grammar, as vLLM
    reads them), so a stop string that ends the output inside a call leaves it as content,
    never as a call whose arguments are not JSON (streamed or not)."""
    cut_at = '"unit"'
    full, streamed = _both(scripted, "Let me check.\n" + CALL, messages=ASK, tools=TOOLS,
                           stop=[cut_at])
    for choice in (full, streamed):
        assert choice.finish_reason == "stop", choice
        assert not choice.message.tool_calls, choice
        assert choice.message.content.startswith("Let me check.\n<tool_call>"), choice
    # Without the stop string the same output is a call (the parser did read it).
    full, _ = _both(scripted, "Let me check.\n" + CALL, messages=ASK, tools=TOOLS)
    assert _calls(full.message) == [("function", "get_weather", PARIS)]


def test_auto_calls_with_a_stop_string_come_back_as_json_or_as_text(real):
    """On the real engine: ``auto``, a bias that makes the model open calls, and a stop
    string it will meet; whatever comes back, every call's arguments are a JSON object."""
    client = _client(real)
    replies = _each_seed(range(4), lambda seed: client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, seed=seed, temperature=1.0, max_tokens=60,
        parallel_tool_calls=False, logit_bias=_bias(real, call=6), stop=["e"]))
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason in ("stop", "length", "tool_calls"), choice
        for call in choice.message.tool_calls or []:
            assert isinstance(json.loads(call.function.arguments), dict), choice


def test_the_legacy_function_api_is_read_as_tools_and_answered_in_its_shape(real):
    """OpenAI's deprecated functions/function_call: the named call comes back as
    message.function_call (no tool_calls), validated against the function's schema; its
    stream's function_call pieces add up to it; a history in the legacy shape (an
    assistant function_call, a function turn) renders as the same history in tools form."""
    client = _client(real)
    functions = [t["function"] for t in TOOLS]
    request = dict(model=MODEL, messages=ASK, functions=functions,
                   function_call={"name": "get_weather"}, seed=1, temperature=1.0, max_tokens=200)
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "stop" and whole.message.tool_calls is None
    call = whole.message.function_call
    assert call.name == "get_weather"
    VALIDATORS["get_weather"].validate(json.loads(call.arguments))
    name, arguments = "", ""
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            assert not choice.delta.tool_calls
            if choice.delta.function_call is not None:
                name += choice.delta.function_call.name or ""
                arguments += choice.delta.function_call.arguments or ""
    assert (name, arguments) == (call.name, call.arguments)
    # The round trip in the legacy shape and in tools form: the same prompt.
    legacy = [*ASK, {"role": "assistant", "content": None, "function_call": {
        "name": call.name, "arguments": call.arguments}},
        {"role": "function", "name": call.name, "content": "9 degrees, rain"}]
    tools_form = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_fn_1", "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": "call_fn_1", "content": "9 degrees, rain"}]
    answers = [client.chat.completions.create(
        model=MODEL, messages=history, max_tokens=1, **extra).usage.prompt_tokens
        for history, extra in ((legacy, {"functions": functions, "function_call": "none"}),
                               (tools_form, {"tools": TOOLS, "tool_choice": "none"}))]
    assert answers[0] == answers[1]
    # /tokenize reads them as chat does: the same count as the answer's prompt.
    counted = httpx.post(real.base_url + "/tokenize", json={
        "messages": legacy, "functions": functions, "function_call": "none"}).json()["count"]
    assert counted == answers[0]
    bad_schema = [{"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "wrong"}}}}]
    for body, param in (({"functions": functions, "tools": TOOLS}, "functions"),
                        ({"function_call": {"name": "get_weather"}}, "function_call"),
                        # Errors in what the fields became name the legacy fields.
                        ({"functions": functions, "function_call": {"name": "nope"}}, "function_call"),
                        ({"functions": bad_schema, "function_call": {"name": "f"}},
                         "functions[0].parameters")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, extra_body=body)
        assert info.value.body["param"] == param
    r = httpx.post(real.base_url + "/v1/completions", json={
        "model": MODEL, "prompt": "x", "max_tokens": 1, "functions": functions})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "functions")
    stats = real.engine.statistics()
    assert stats.kv_blocks_free == stats.kv_blocks_total
