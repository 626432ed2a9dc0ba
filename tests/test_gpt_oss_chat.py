"""gpt-oss's harmony format through the chat API: the ``openai_gptoss`` reasoning parser
and the ``openai`` tool-call parser, served (``--reasoning-parser openai_gptoss
--tool-call-parser openai --enable-auto-tool-choice``) and read with the official openai
client. The fake engine plays a gpt-oss reply token by token over a tokenizer that holds
harmony's markers as special tokens; what comes back is the reply's analysis channel as
the reasoning, its final channel as the content, its commentary message to a function as
the call, streamed and not, and a structured answer's JSON."""

from __future__ import annotations

import json

import openai
import pytest
from chat_fixtures import HARMONY_MARKER_TOKENS, HARMONY_TEMPLATE, TOOLS, write_marker_model
from http_fake_engine import open_fake_engine
from http_server import ServerThread

from engine.chat.request import ChatSettings
from engine.models.tokenizer import Tokenizer

MODEL = "tiny-harmony"
SETTINGS = ChatSettings(reasoning_parser="openai_gptoss", tool_call_parser="openai",
                        enable_auto_tool_choice=True)
PARIS = {"city": "Paris", "unit": "celsius"}
ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather in Paris.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris."
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        + json.dumps(PARIS))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = write_marker_model(tmp_path_factory.mktemp("harmony") / "m", HARMONY_TEMPLATE,
                                HARMONY_MARKER_TOKENS, special=True)
    tokenizer = Tokenizer.from_folder(folder)
    with ServerThread(lambda: open_fake_engine(tokenizer, served_model_name=MODEL, max_model_len=1024),
                      chat=SETTINGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


def _streamed(client, **request):
    reasoning = content = ""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **request):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta.model_dump()
        reasoning += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or ():
            slot = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            slot["name"] += (call.get("function") or {}).get("name") or ""
            slot["arguments"] += (call.get("function") or {}).get("arguments") or ""
        finish = choice.finish_reason or finish
    return reasoning, content, list(calls.values()), finish


def test_the_analysis_channel_is_the_reasoning_and_the_final_channel_the_content(server, client):
    server.engine.script = ANALYSIS + FINAL
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    reply = client.chat.completions.create(**request)
    message = reply.choices[0].message.model_dump()
    assert message["reasoning_content"] == "The user wants the weather in Paris."
    assert message["content"] == "It is sunny in Paris."
    assert reply.choices[0].finish_reason == "stop"
    assert _streamed(client, **request) == (message["reasoning_content"], message["content"], [], "stop")


def test_a_commentary_message_to_a_function_is_a_tool_call(server, client):
    server.engine.script = ANALYSIS + CALL
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS}
    reply = client.chat.completions.create(**request)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", PARIS)
    reasoning, content, calls, finish = _streamed(client, **request)
    assert (reasoning, content, finish) == ("The user wants the weather in Paris.", "", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", PARIS)]


def test_a_structured_answer_comes_back_from_the_final_channel(server, client):
    """With a response_format the grammar starts after the final channel's header
    (tests/test_chat_constraints.py holds it to that); here the reply's parts come back
    split: the analysis as the reasoning, the final channel's JSON as the content."""
    server.engine.script = ANALYSIS + "<|start|>assistant<|channel|>final<|message|>" + json.dumps(PARIS)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                           response_format={"type": "json_object"})
    message = reply.choices[0].message.model_dump()
    assert json.loads(message["content"]) == PARIS
    assert message["reasoning_content"] == "The user wants the weather in Paris."
