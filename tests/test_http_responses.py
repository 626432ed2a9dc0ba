"""POST /v1/responses (OpenAI's Responses API) through the official openai client.

* A scripted server (the fake engine plays a model's exact text; hermes tool parser and
  qwen3 reasoning parser on) for the wire format: output items, typed stream events in
  OpenAI's order, the stream helper's assembled response equal to the non-streamed one,
  the conversation that previous_response_id rebuilds (checked against /tokenize of the
  same chat), the store's routes and bounds, and every refusal.
* The real engine on a tiny random model, for what a script cannot show: text.format's
  JSON schema held by the grammar (validated with jsonschema, and read back by
  responses.parse into a pydantic model), forced function calls that validate against
  their schema, and a round trip through previous_response_id with every KV block back.
* The store's policy (size, age, least recently used, broken chains) with a fake clock.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import openai
import pydantic
import pytest
from chat_fixtures import EFFORT_TEMPLATE, TOOL_TEMPLATE, TOOLS, write_marker_model
from http_fake_engine import open_fake_engine
from http_server import ServerThread

from engine.chat.request import ChatSettings
from engine.http.responses.store import MissingResponse, ResponseStore
from engine.models.tokenizer import Tokenizer

MODEL = "tiny-responses"
HERMES = ChatSettings(tool_call_parser="hermes", enable_auto_tool_choice=True,
                      reasoning_parser="qwen3")
PARIS = {"city": "Paris", "unit": "celsius"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(PARIS) + "}\n</tool_call>"
# Responses' flat function tools, the same functions as the chat tests' TOOLS.
FLAT_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_marker_model(tmp_path_factory.mktemp("responses") / "m", TOOL_TEMPLATE)


@pytest.fixture(scope="module")
def scripted(folder):
    tokenizer = Tokenizer.from_folder(folder)
    with ServerThread(lambda: open_fake_engine(tokenizer, served_model_name=MODEL,
                                               max_model_len=1024), chat=HERMES) as srv:
        yield srv


def _client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def client(scripted):
    with _client(scripted) as client:
        yield client


def _without_ids(output):
    """Output items as plain dicts, ids (random per response) left out."""
    items = [item.model_dump(exclude_none=True) for item in output]
    for item in items:
        item.pop("id", None)
        item.pop("call_id", None)
    return items


def _streamed(client, **request):
    with client.responses.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_response()
    return events, final


# -- the wire format (scripted) ------------------------------------------------------------


def test_plain_text_create_stream_and_retrieve_agree(scripted, client, folder):
    scripted.engine.script = "Hello there, friend."
    full = client.responses.create(model=MODEL, input="Hi!", instructions="Be kind.")
    assert full.status == "completed" and full.object == "response"
    assert full.output_text == "Hello there, friend."
    assert [item.type for item in full.output] == ["message"]
    assert full.instructions == "Be kind." and full.store is True
    tokenizer = Tokenizer.from_folder(folder)
    assert full.usage.output_tokens == len(tokenizer.encode(
        "Hello there, friend.", add_special_tokens=False))
    counted = httpx.post(scripted.base_url + "/tokenize", json={"messages": [
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi!"}]}).json()
    assert full.usage.input_tokens == counted["count"]
    assert full.usage.total_tokens == full.usage.input_tokens + full.usage.output_tokens
    events, streamed = _streamed(client, model=MODEL, input="Hi!", instructions="Be kind.")
    assert _without_ids(streamed.output) == _without_ids(full.output)
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    assert client.responses.retrieve(full.id).model_dump() == full.model_dump()


def _check_order(events):
    """OpenAI's event grammar: created, in_progress, then per item (added, [part added],
    deltas, done(s), [part done], item done), then completed or incomplete; sequence
    numbers count from 0; every delta belongs to the open item and the done events carry
    the deltas' concatenation."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    done_items = []
    i = 2
    while i < len(events) - 1:
        added = events[i]
        assert added.type == "response.output_item.added", types[i:]
        item, index = added.item, added.output_index
        assert index == len(done_items)
        i += 1
        if item.type in ("message", "reasoning"):
            assert events[i].type == "response.content_part.added"
            i += 1
            delta_type, done_type = (("response.output_text.delta", "response.output_text.done")
                                     if item.type == "message" else
                                     ("response.reasoning_text.delta",
                                      "response.reasoning_text.done"))
        else:
            delta_type, done_type = ("response.function_call_arguments.delta",
                                     "response.function_call_arguments.done")
        text = ""
        while events[i].type == delta_type:
            assert events[i].item_id == item.id and events[i].output_index == index
            text += events[i].delta
            i += 1
        done = events[i]
        assert done.type == done_type and done.item_id == item.id
        assert (done.arguments if item.type == "function_call" else done.text) == text
        i += 1
        if item.type != "function_call":
            assert events[i].type == "response.content_part.done"
            assert events[i].part.text == text
            i += 1
        assert events[i].type == "response.output_item.done" and events[i].item.id == item.id
        done_items.append(events[i].item)
        i += 1
    assert [item.model_dump(exclude_none=True) for item in events[-1].response.output] == \
        [item.model_dump(exclude_none=True) for item in done_items]
    return done_items


def test_stream_events_come_in_openais_order_for_reasoning_text_and_calls(scripted, client):
    scripted.engine.script = "<think>Paris, so weather.</think>Let me check.\n" + CALL
    request = {"model": MODEL, "input": "Weather in Paris?", "tools": FLAT_TOOLS}
    events, streamed = _streamed(client, **request)
    items = _check_order(events)
    assert [item.type for item in items] == ["reasoning", "message", "function_call"]
    reasoning, message, call = items
    assert reasoning.content[0].text == "Paris, so weather." and reasoning.summary == []
    assert message.content[0].text == "Let me check."
    assert (call.name, json.loads(call.arguments)) == ("get_weather", PARIS)
    assert call.call_id.startswith("call_") and call.status == "completed"
    full = client.responses.create(**request)
    assert _without_ids(full.output) == _without_ids(streamed.output)
    assert full.usage.output_tokens_details.reasoning_tokens > 0
    # The stream helper's own accumulation of the deltas is the same response.
    assert streamed.output_text == full.output_text == "Let me check."


def test_max_output_tokens_ends_incomplete(scripted, client):
    scripted.engine.script = "one two three four five six seven eight nine ten"
    full = client.responses.create(model=MODEL, input="Count", max_output_tokens=3)
    assert full.status == "incomplete"
    assert full.incomplete_details.reason == "max_output_tokens"
    assert full.usage.output_tokens == 3 and full.output[0].status == "incomplete"
    # (The stream helper wants response.completed; OpenAI ends such a stream with
    # response.incomplete, so the raw stream is read.)
    events = list(client.responses.create(model=MODEL, input="Count", max_output_tokens=3,
                                          stream=True))
    _check_order(events)
    assert events[-1].type == "response.incomplete"


def test_function_call_round_trip_rebuilds_the_conversation(scripted, client):
    """Turn 1 calls a tool; turn 2 sends only the call's output and previous_response_id.
    The prompt of turn 2 is the chat of the whole conversation: its token count is
    /tokenize's for the same chat messages and tools."""
    scripted.engine.script = CALL
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=FLAT_TOOLS,
                                    instructions="Be terse.")
    (call,) = first.output
    assert call.type == "function_call" and json.loads(call.arguments) == PARIS
    scripted.engine.script = "It is 9 degrees."
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=FLAT_TOOLS,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "9 degrees, rain"}])
    assert second.output_text == "It is 9 degrees."
    assert second.previous_response_id == first.id and second.instructions is None
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": call.call_id, "type": "function",
                "function": {"name": "get_weather", "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "9 degrees, rain"}]
    counted = httpx.post(scripted.base_url + "/tokenize",
                         json={"messages": chat, "tools": TOOLS}).json()
    assert second.usage.input_tokens == counted["count"]
    # The same conversation sent whole as input items is the same prompt.
    scripted.engine.script = "It is 9 degrees."
    # (A reasoning item goes with the next assistant turn; this template does not show
    # earlier turns' thinking, as most do not.)
    whole = client.responses.create(model=MODEL, tools=FLAT_TOOLS, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "They want the weather."}]},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "9 degrees, rain"}])
    assert whole.usage.input_tokens == second.usage.input_tokens


def test_retrieve_delete_and_input_items(scripted, client):
    scripted.engine.script = "Done."
    items = [{"role": "user", "content": f"message {k}"} for k in range(5)]
    reply = client.responses.create(model=MODEL, input=items)
    assert client.responses.retrieve(reply.id).output_text == "Done."
    listed = client.responses.input_items.list(reply.id, order="asc", limit=2)
    assert [i.content[0].text for i in listed.data] == ["message 0", "message 1"]
    assert listed.has_more
    rest = client.responses.input_items.list(reply.id, order="asc", after=listed.last_id)
    assert [i.content[0].text for i in rest.data] == ["message 2", "message 3", "message 4"]
    newest = client.responses.input_items.list(reply.id)  # desc by default, as OpenAI's
    assert newest.data[0].content[0].text == "message 4"
    # Only a background response can be cancelled, and this server runs none.
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.cancel(reply.id)
    assert info.value.body["param"] == "response_id"
    assert client.responses.retrieve(reply.id).status == "completed"
    client.responses.delete(reply.id)
    for call in (lambda: client.responses.retrieve(reply.id),
                 lambda: client.responses.delete(reply.id),
                 lambda: client.responses.cancel(reply.id),
                 lambda: client.responses.create(model=MODEL, input="more",
                                                 previous_response_id=reply.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = client.responses.create(model=MODEL, input="Hi", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


REFUSED = [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[0].type"),
    ({"tools": [{**FLAT_TOOLS[0], "defer_loading": True}]}, "tools[0].defer_loading"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
     "tool_choice.type"),
    ({"background": True}, "background"),
    ({"include": ["file_search_call.results"]}, "include[0]"),
    ({"include": ["message.output_text.logprobs", "reasoning.encrypted_content"]}, "include[1]"),
    # Logprobs of text alone: this server splits reasoning out (its tokens would not line
    # up with the output text).
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"n": 2}, "n"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"context_management": [{"type": "compaction"}]}, "context_management"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "x"}]}]},
     "input[0].content[0].file_id"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": [],
                 "encrypted_content": "gAAA"}]}, "input[0].encrypted_content"),
]
INVALID = [
    ({"truncation": "middle"}, "truncation"),
    # This model's template never reads reasoning_effort: refused, not dropped.
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"input": [{"role": "user", "content": "Hi"},
                {"type": "function_call", "call_id": "c1", "name": "get_weather",
                 "arguments": "{not json"}]}, "input[1].arguments"),
    ({"input": [{"type": "function_call_output", "output": "9C"}]}, "input[0].call_id"),
    # An output that answers no call before it (OpenAI: "No tool call found ...").
    ({"input": [{"role": "user", "content": "Hi"},
                {"type": "function_call_output", "call_id": "c9", "output": "9C"}]},
     "input[1].call_id"),
    ({"input": [{"role": "user", "content": "Hi"},
                {"type": "function_call_output", "call_id": "c1", "output": "9C"},
                {"type": "function_call", "call_id": "c1", "name": "get_weather",
                 "arguments": "{}"}]}, "input[1].call_id"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "wrong"}}}}]}, "tools[0].parameters"),
    ({"tools": [{"type": "function", "name": "has space"}]}, "tools[0].name"),
    ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "wrong"}}}},
     "text.format.schema"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"input": 7}, "input"),
    ({"previous_response_id": "resp_never"}, "previous_response_id"),
]


@pytest.mark.parametrize(("change", "param"), REFUSED + INVALID)
def test_unsupported_and_invalid_fields_are_named_and_hold_nothing(scripted, change, param):
    body = {"model": MODEL, "input": "Hi", **change}
    for stream in (False, True):
        r = httpx.post(scripted.base_url + "/v1/responses", json={**body, "stream": stream})
        assert r.status_code in (400, 404), r.text
        error = r.json()["error"]
        assert error["param"] == param, error
        if (change, param) in REFUSED:
            assert r.status_code == 400 and error["code"] == "unsupported_parameter"
    stats = scripted.engine.statistics()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == 0


def test_the_store_drops_the_least_recently_used_past_its_size(folder):
    """A server whose store holds two small responses: the oldest unused ones
    go, a conversation in use stays, and continuing a dropped one is a 404."""
    tokenizer = Tokenizer.from_folder(folder)
    with ServerThread(lambda: open_fake_engine(
            tokenizer, served_model_name=MODEL, max_model_len=1024,
            responses_store_bytes=3000), chat=HERMES) as server, _client(server) as client:
        server.engine.script = "Fine."
        first = client.responses.create(model=MODEL, input="one")
        size = server.call(lambda: server_store(server).statistics().bytes)
        assert 1000 < size < 1450  # so two fit and a third does not
        second = client.responses.create(model=MODEL, input="two")
        client.responses.retrieve(first.id)  # first is now the most recently used
        third = client.responses.create(model=MODEL, input="three")
        client.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(second.id)
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.create(model=MODEL, input="more", previous_response_id=second.id)
        assert info.value.body["param"] == "previous_response_id"
        assert client.responses.retrieve(third.id).output_text == "Fine."


def server_store(server):
    return server.app.extensions["responses_store"]


def test_an_engine_failure_mid_stream_ends_it_with_response_failed(folder):
    """The engine dies after the stream began: the last event is response.failed with
    the error, the response is not stored, and its blocks are back."""
    tokenizer = Tokenizer.from_folder(folder)
    with ServerThread(lambda: open_fake_engine(
            tokenizer, served_model_name=MODEL, max_model_len=1024, step_delay=0.05),
            chat=HERMES) as server, _client(server) as client:
        server.engine.script = "word " * 200
        events = []
        with client.responses.create(model=MODEL, input="Talk", stream=True) as stream:
            for event in stream:
                events.append(event)
                if event.type == "response.output_text.delta" and len(events) == 5:
                    server.call(server.engine.crash, RuntimeError("a kernel fault"))
        assert events[-1].type == "response.failed"
        failed = events[-1].response
        assert failed.status == "failed" and failed.error.code == "server_error"
        assert "kernel fault" not in failed.error.message  # internals go to the log
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-2].type == "response.output_item.done"
        assert events[-2].item.status == "incomplete"
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(failed.id)
        stats = server.engine.statistics()
        assert stats.kv_blocks_free == stats.kv_blocks_total


# -- the real engine (a tiny random model) -----------------------------------------------

CAT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                        "age": {"type": "integer", "minimum": 0, "maximum": 30}},
       "required": ["name", "age"], "additionalProperties": False}


class Cat(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=30)


@pytest.fixture(scope="module")
def real(folder):
    import engine.api

    # No reasoning parser: the random model would rarely close a <think> it opened.
    settings = dataclasses.replace(HERMES, reasoning_parser=None)
    with ServerThread(lambda: engine.api.open_engine(
            str(folder), served_model_name=MODEL, max_model_len=1536,
            kv_cache_memory=32 * 2**20), chat=settings) as srv:
        yield srv


def _each_seed(seeds, request):
    with concurrent.futures.ThreadPoolExecutor(len(seeds)) as pool:
        return list(pool.map(request, seeds))


def test_text_format_json_schema_is_held_by_the_grammar(real):
    """At temperature 1 a random model writes noise; under text.format it writes a
    document the schema accepts, every seed, streamed or not."""
    fmt = {"format": {"type": "json_schema", "name": "cat", "schema": CAT, "strict": True}}
    with _client(real) as client:
        replies = _each_seed(range(4), lambda seed: client.responses.create(
            model=MODEL, input="Describe a cat as JSON.", text=fmt, temperature=1.0,
            max_output_tokens=200, extra_body={"seed": seed}))
        events, streamed = _streamed(client, model=MODEL, input="Describe a cat as JSON.",
                                     text=fmt, temperature=1.0, max_output_tokens=200,
                                     extra_body={"seed": 7})
        parsed = client.responses.parse(model=MODEL, input="Describe a cat as JSON.",
                                        text_format=Cat, temperature=1.0,
                                        max_output_tokens=200, extra_body={"seed": 3})
    _check_order(events)
    for reply in [*replies, streamed]:
        assert reply.status == "completed", reply
        jsonschema.validate(json.loads(reply.output_text), CAT)
    assert replies[0].text.format.type == "json_schema"
    assert isinstance(parsed.output_parsed, Cat)
    assert parsed.output_parsed == Cat.model_validate_json(parsed.output_text)


def test_output_text_logprobs_are_transformers_log_softmax(real, folder):
    """include message.output_text.logprobs: each output token's logprob and its
    alternatives, whole and streamed (each delta with its tokens'), as transformers scores
    the tokens the chat route says the same greedy request writes."""
    import torch
    from transformers import AutoModelForCausalLM

    ask = "Say something."
    request = {"model": MODEL, "input": ask, "max_output_tokens": 6, "temperature": 0,
               "include": ["message.output_text.logprobs"], "top_logprobs": 3,
               "tool_choice": "none"}
    with _client(real) as client:
        answer = client.responses.create(**request)
        streamed = list(client.responses.create(**request, stream=True))
    chat = httpx.post(real.base_url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": ask}], "max_tokens": 6,
        "temperature": 0, "return_token_ids": True}).json()
    prompt = chat["prompt_token_ids"]
    output = chat["choices"][0]["token_ids"]
    hf = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        scores = torch.log_softmax(hf(torch.tensor([prompt + output])).logits[0].double(), -1)
    want = [scores[len(prompt) + i - 1, t].item() for i, t in enumerate(output)]
    part = answer.output[0].content[0]
    assert part.text == chat["choices"][0]["message"]["content"]
    assert [lp.logprob for lp in part.logprobs] == pytest.approx(want, abs=1e-4)
    assert all(len(lp.top_logprobs) == 3 and lp.top_logprobs[0].token == lp.token
               for lp in part.logprobs)
    assert answer.top_logprobs == 3
    deltas = [e for e in streamed if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == part.text
    assert [lp.logprob for e in deltas for lp in e.logprobs] == pytest.approx(want, abs=1e-4)
    done = next(e for e in streamed if e.type == "response.output_text.done")
    assert [lp.logprob for lp in done.logprobs] == pytest.approx(want, abs=1e-4)


def test_forced_call_round_trip_through_previous_response_id_frees_every_block(real):
    schemas = {tool["name"]: tool["parameters"] for tool in FLAT_TOOLS}
    with _client(real) as client:
        for seed in range(1):
            request = {"model": MODEL, "input": "Weather in Paris?", "tools": FLAT_TOOLS,
                       "temperature": 1.0, "max_output_tokens": 200,
                       "extra_body": {"seed": seed}}
            first = client.responses.create(tool_choice="required", parallel_tool_calls=False,
                                            **request)
            events, named = _streamed(client, tool_choice={"type": "function",
                                                           "name": "get_weather"}, **request)
            _check_order(events)
            for reply in (first, named):
                calls = [item for item in reply.output if item.type == "function_call"]
                assert reply.status == "completed" and len(calls) == 1, reply
                jsonschema.validate(json.loads(calls[0].arguments), schemas[calls[0].name])
            assert named.output[-1].name == "get_weather"
            calls = [item for item in first.output if item.type == "function_call"]
            answer = client.responses.create(
                model=MODEL, previous_response_id=first.id, tools=FLAT_TOOLS, tool_choice="none",
                max_output_tokens=8, input=[{"type": "function_call_output",
                                             "call_id": calls[0].call_id, "output": "9C"}])
            assert answer.status in ("completed", "incomplete")
            assert [item.type for item in answer.output] == ["message"]
    stats = real.engine.statistics()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == 0


DOCS = Path(__file__).resolve().parents[1] / "docs" / "serving.md"


def _docs_blocks(language):
    section = DOCS.read_text().split("\n## Responses API (`/v1/responses`)\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    return [body for lang, body in re.findall(r"```(\w+)\n(.*?)```", section, re.DOTALL)
            if lang == language]


def test_the_docs_curl_examples_run_as_written(real):
    (shell,) = _docs_blocks("sh")
    first, second = [c for c in shell.split("\n\n") if c.strip()]
    outputs = []
    for command in (first, second):
        assert "http://127.0.0.1:8000" in command
        command = command.replace("http://127.0.0.1:8000", real.base_url)
        result = subprocess.run(["bash", "-c", command.replace("SmolLM2-135M-Instruct", MODEL)],
                                capture_output=True, text=True, timeout=300, check=False)
        assert result.returncode == 0, result.stderr
        outputs.append(result.stdout)
    reply = json.loads(outputs[0])
    assert reply["object"] == "response" and reply["status"] in ("completed", "incomplete")
    assert reply["output"][0]["type"] == "message" and reply["instructions"] == "Be brief."
    frames = [frame for frame in outputs[1].split("\n\n") if frame.strip()]
    events = []
    for frame in frames:
        name, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == "event: " + event["type"]
        events.append(event)
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


# -- SmolLM2, the default model, end to end ------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    import engine.api
    from engine.models.loader import default_model_path

    # SmolLM2's template ignores tools: the fallback prompt describes them (~300 tokens).
    with ServerThread(lambda: engine.api.open_engine(
            str(default_model_path()), served_model_name="SmolLM2-135M-Instruct",
            max_model_len=2048,
            kv_cache_memory=64 * 2**20)) as srv:
        yield srv


@pytest.mark.slow
def test_an_openai_agents_agent_with_a_function_tool_runs_on_smollm2(smollm2):
    """openai-agents on its default model path (OpenAIResponsesModel over
    /v1/responses): the first turn must call the tool (SmolLM2 calls reliably only when
    made to, one call at a time); the agent then resets tool_choice to auto, sends the
    whole conversation back as input items (the call, its output) and SmolLM2 answers."""
    import asyncio

    from agents import (
        Agent,
        ModelSettings,
        Runner,
        function_tool,
        set_default_openai_client,
        set_tracing_disabled,
    )
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
    from agents.models.openai_responses import OpenAIResponsesModel

    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return f"9 degrees and rain in {city}"

    set_tracing_disabled(True)  # tracing would upload to OpenAI
    client = openai.AsyncOpenAI(base_url=smollm2.base_url + "/v1", api_key="unused",
                                max_retries=0)
    set_default_openai_client(client, use_for_tracing=False)
    agent = Agent(name="weather", instructions="You answer questions about the weather.",
                  model=smollm2.engine.model_name, tools=[get_weather],
                  model_settings=ModelSettings(tool_choice="required", temperature=0.0,
                                               parallel_tool_calls=False, max_tokens=150))
    assert isinstance(agent.model, str)  # the provider's default: the Responses model
    from agents.models.multi_provider import MultiProvider

    assert isinstance(MultiProvider().get_model(agent.model), OpenAIResponsesModel)

    async def run():
        async with client:
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)

    result = asyncio.run(run())
    kinds = [type(item) for item in result.new_items]
    assert kinds[:2] == [ToolCallItem, ToolCallOutputItem] and kinds[-1] is MessageOutputItem
    assert cities and all(isinstance(city, str) and city for city in cities)
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert len(result.raw_responses) == len(cities) + 1
    stats = smollm2.engine.statistics()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == 0


@pytest.mark.slow
def test_the_docs_python_example_runs_against_smollm2(smollm2):
    program = _docs_blocks("python")[0]
    assert 'base_url="http://127.0.0.1:8000/v1"' in program
    result = subprocess.run(
        [sys.executable, "-c", program.replace("http://127.0.0.1:8000", smollm2.base_url)],
        # About 250 tokens of SmolLM2 in all; generous for a loaded machine.
        capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


# -- the store's policy ------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _put(store, rid, previous=None, text="x"):
    return store.put(rid, {"id": rid, "text": text}, [], [{"role": "user", "content": text}],
                     previous)


def test_store_expires_responses_unused_for_ttl_seconds():
    clock = FakeClock()
    store = ResponseStore(10**6, ttl=60, clock=clock)
    _put(store, "a")
    _put(store, "b")
    clock.now += 50
    store.get("a")  # a use: a's 60 s start again
    clock.now += 20
    assert "a" in store and "b" not in store
    with pytest.raises(MissingResponse):
        store.get("b")
    clock.now += 61
    assert "a" not in store and store.statistics().responses == 0
    assert store.statistics().bytes == 0 and store.statistics().evicted == 2


def test_store_keeps_a_conversation_in_use_and_breaks_a_chain_honestly():
    store = ResponseStore(10**6, ttl=60, clock=FakeClock())
    _put(store, "a", text="first")
    _put(store, "b", "a", text="second")
    _put(store, "c", "b", text="third")
    assert [m["content"] for m in store.history("c")] == ["first", "second", "third"]
    store.delete("b")
    with pytest.raises(MissingResponse) as info:
        store.history("c")
    assert info.value.response_id == "b"


def test_store_drops_least_recently_used_first_and_refuses_what_cannot_fit():
    store = ResponseStore(10**6, ttl=60, clock=FakeClock())
    _put(store, "probe")
    one = store.statistics().bytes
    store = ResponseStore(3 * one, ttl=60, clock=FakeClock())
    for rid in ("a", "b", "c"):  # same-size entries ("probe" has the same length)
        assert _put(store, rid.ljust(5, "_"))
    store.history("a____")  # a use
    assert _put(store, "d____")
    assert "b____" not in store and {"a____", "c____", "d____"} <= {
        r for r in ("a____", "c____", "d____") if r in store}
    assert not store.put("huge", {"text": "x" * (4 * one)}, [], [], None)
    assert "huge" not in store and store.statistics().bytes <= 3 * one


def test_truncation_auto_drops_the_oldest_items_until_the_prompt_fits(real, folder):
    """OpenAI's truncation "auto": a conversation longer than the context drops its oldest
    input items (the instructions stay) until it fits. The oracle: transformers' rendering
    of the instructions and of each suffix of the items, the longest that fits."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    def word(n):  # letters only: the fixture's tokenizer.json and transformers' rebuilt
        return "".join(chr(97 + (n // 26 ** k) % 26) for k in range(3))  # pre-tokenizer split digits apart

    items = [{"role": "user" if i % 2 == 0 else "assistant",
              "content": " ".join(word(i * 40 + j) for j in range(40))} for i in range(21)]
    system = [{"role": "system", "content": "Be brief."}]
    limit, out = 1536, 8

    def tokens(kept):
        return len(tok.apply_chat_template(system + kept, add_generation_prompt=True,
                                           tokenize=True, return_dict=False))

    assert tokens(items) + out > limit  # too long whole
    first = next(k for k in range(len(items)) if tokens(items[k:]) + out <= limit)
    assert first > 0
    body = dict(model=MODEL, instructions="Be brief.", input=items, max_output_tokens=out,
                store=False)
    with _client(real) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(**body)
        assert info.value.body["code"] == "context_length_exceeded"
        answer = client.responses.create(**body, truncation="auto")
    assert answer.truncation == "auto" and answer.status in ("completed", "incomplete")
    assert answer.usage.input_tokens == tokens(items[first:])
    stats = real.engine.statistics()
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_reasoning_effort_reaches_a_template_that_reads_it(tmp_path) -> None:
    """reasoning.effort goes to the chat template as reasoning_effort (chat's field, and
    vLLM's Responses route): the prompt is transformers' rendering with the same value."""
    from transformers import AutoTokenizer

    folder = write_marker_model(tmp_path / "m", EFFORT_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(str(folder))
    ask = [{"role": "user", "content": "Hi there"}]
    with ServerThread(lambda: open_fake_engine(Tokenizer.from_folder(folder),
                                               served_model_name=MODEL, max_model_len=1024)) as srv:
        with _client(srv) as client:
            answers = {effort: client.responses.create(
                model=MODEL, input=ask, max_output_tokens=2, store=False,
                reasoning={"effort": effort}) for effort in ("low", "high")}
    for effort, answer in answers.items():
        want = tok.apply_chat_template(ask, tokenize=True, add_generation_prompt=True,
                                       reasoning_effort=effort, return_dict=False)
        assert answer.usage.input_tokens == len(want)
        assert answer.reasoning.effort == effort
        # Without the effort the template writes no "Effort: ..." line.
        assert len(want) > len(tok.apply_chat_template(ask, tokenize=True, return_dict=False,
                                                       add_generation_prompt=True))
