"""What a user coming from vLLM sends: chat fields vLLM honours, fields this server refuses,
hostile templates. Through the official openai client and raw httpx.

Two servers per module on a tiny model whose template knows tools (``TOOL_TEMPLATE``): the
fake engine (wire format, refusals; no generation needed) and the real engine (a forced
call generated under its grammar).
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from chat_fixtures import TOOL_TEMPLATE, WEATHER_TOOL, write_marker_model
from http_fake_engine import open_fake_engine
from http_server import ServerThread

from engine.chat.request import ChatSettings
from engine.models.tokenizer import Tokenizer

MODEL = "tiny-compat"
SETTINGS = ChatSettings(tool_call_parser="hermes", enable_auto_tool_choice=True,
                        trust_request_chat_template=True)
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_marker_model(tmp_path_factory.mktemp("compat") / "m", TOOL_TEMPLATE)


@pytest.fixture(scope="module")
def fake(folder):
    tokenizer = Tokenizer.from_folder(folder)
    with ServerThread(lambda: open_fake_engine(tokenizer, served_model_name=MODEL,
                                               max_model_len=1024), chat=SETTINGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def real(folder):
    import engine.api

    with ServerThread(lambda: engine.api.open_engine(
            str(folder), served_model_name=MODEL, max_model_len=1024,
            kv_cache_memory=16 * 2**20), chat=SETTINGS) as srv:
        yield srv


def _client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


def _tokenize(server, **body):
    r = httpx.post(server.base_url + "/tokenize", json={"model": MODEL, **body})
    return r


# -- custom roles -----------------------------------------------------------------------


def test_a_custom_role_reaches_the_chat_template_as_transformers_renders_it(fake, folder):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "be brief"},
                {"role": "wizard", "content": "a spell"}, {"role": "user", "content": "hi"}]
    ours = _tokenize(fake, messages=messages)
    assert ours.status_code == 200, ours.text
    hf = AutoTokenizer.from_pretrained(folder)
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "wizard" in text
    assert ours.json()["tokens"] == hf.encode(text, add_special_tokens=False)
    # And generation takes it too.
    with _client(fake) as client:
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert reply.choices[0].finish_reason == "length"


def test_a_template_that_rejects_a_custom_role_is_a_400_with_its_message(fake):
    template = ("{% for m in messages %}{% if m.role not in ['user', 'assistant', 'system'] %}"
                "{{ raise_exception('Unknown role: ' + m.role) }}{% endif %}"
                "{{ m.content }}{% endfor %}")
    with _client(fake) as client, pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "wizard", "content": "x"}],
            extra_body={"chat_template": template})
    assert "Unknown role: wizard" in info.value.body["message"]


@pytest.mark.parametrize("role", [7, "", None])
def test_a_role_that_is_no_string_is_a_400_naming_it(fake, role):
    r = httpx.post(fake.base_url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": role, "content": "x"}]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages[0].role"


# -- hostile templates ------------------------------------------------------------------


@pytest.mark.parametrize("expression", [
    "(10 ** 5000) | string",  # folded while compiling: over Python's int-to-text limit
    "10 ** 100000000",  # would hold the CPU for a long time
    "(messages | length * 10) ** 5000",  # computed while rendering
])
def test_a_request_template_that_raises_is_a_400_naming_the_error(fake, expression):
    with _client(fake) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ASK, extra_body={
                "chat_template": "{{ " + expression + " }}"})
        assert "integer" in info.value.body["message"] or "digits" in info.value.body["message"]
        # The server keeps serving.
        assert client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1).choices


# -- fields refused -------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("web_search_options", {}),
    ("prediction", {"type": "content", "content": "hello"}),
    ("verbosity", "low"),
    ("truncate_prompt_tokens", 5),
    ("allowed_token_ids", [1, 2]),
    ("bad_words", ["x"]),
    ("spaces_between_special_tokens", False),
    ("include_reasoning", False),
    ("documents", [{"title": "a", "text": "b"}]),
    ("vllm_xargs", {"a": 1}),
    ("kv_transfer_params", {"do_remote_decode": True}),
])
def test_a_field_that_changes_the_answer_and_is_not_built_is_a_400_naming_it(fake, field, value):
    with _client(fake) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1,
                                           extra_body={field: value})
        assert info.value.body["param"] == field
        assert field in info.value.body["message"]
    # Completions refuses them the same way.
    r = httpx.post(fake.base_url + "/v1/completions",
                   json={"model": MODEL, "prompt": "x", "max_tokens": 1, field: value})
    assert (r.status_code, r.json()["error"]["param"]) == (400, field)


def test_harmless_fields_and_no_op_values_are_accepted(fake):
    with _client(fake) as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=1, modalities=["text"], service_tier="auto",
            store=False, metadata={"k": "v"}, extra_body={"include_reasoning": True,
                                                          "spaces_between_special_tokens": True})
    assert reply.choices[0].finish_reason == "length"


def test_reasoning_effort_reaches_a_template_that_reads_it_and_is_refused_otherwise(fake):
    # The effort changes the prompt's length: the chat's prompt_tokens show which it got.
    template = ("{% if reasoning_effort == 'high' %}{{ 'think hard ' * 20 }}{% endif %}"
                "{{ messages[0].content }}")
    counts = {effort: _tokenize(fake, messages=ASK, chat_template=template,
                                chat_template_kwargs={"reasoning_effort": effort}).json()["count"]
              for effort in ("high", "low")}
    assert counts["high"] > counts["low"]
    with _client(fake) as client:
        for effort in ("high", "low"):
            reply = client.chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=1, reasoning_effort=effort,
                extra_body={"chat_template": template})
            assert reply.usage.prompt_tokens == counts[effort]
        # The model's own template never reads it: a 400, not a silent drop.
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1,
                                           reasoning_effort="high")
    assert info.value.body["param"] == "reasoning_effort"


# -- a forced call with a response_format ---------------------------------------------------


def test_a_forced_call_wins_over_response_format_as_in_vllm(real):
    other = {"type": "object", "properties": {"zzz": {"type": "integer"}}, "required": ["zzz"],
             "additionalProperties": False}
    with _client(real) as client:
        for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
            reply = client.chat.completions.create(
                model=MODEL, messages=ASK, tools=[WEATHER_TOOL], tool_choice=choice,
                max_tokens=200, temperature=0, response_format={
                    "type": "json_schema", "json_schema": {"name": "z", "schema": other}})
            calls = reply.choices[0].message.tool_calls
            assert calls and calls[0].function.name == "get_weather", reply
            jsonschema.validate(json.loads(calls[0].function.arguments),
                                WEATHER_TOOL["function"]["parameters"])
        # An explicit grammar beside a forced call stays a 400 saying why.
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=MODEL, messages=ASK, tools=[WEATHER_TOOL], tool_choice="required",
                max_tokens=5, extra_body={"guided_regex": "[a-z]+"})
        assert info.value.body["param"] == "tool_choice"
        assert "response_format" in info.value.body["message"]
