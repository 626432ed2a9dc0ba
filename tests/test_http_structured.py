"""Structured output through HTTP with the official openai client, on the tiny model.

One real server per module. The tiny model samples at temperature 1 from everything the
grammar allows, so a few seeds per case exercise it; ``jsonschema`` and pydantic (the
openai client's ``parse``) are the oracles. Every fail-closed case is a 400 naming the
field, and the server serves on afterwards.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from http_server import ServerThread
from pydantic import BaseModel, Field

from engine.models.testing import write_tiny_model

MODEL = "tiny-structured"
SEEDS = range(4)
ASK = [{"role": "user", "content": "Describe a person."}]


class Person(BaseModel):
    # Bounded fields: the tiny model's free strings rarely end by themselves.
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    mood: Literal["happy", "sad"]


CITY = {"type": "object",
        "properties": {"city": {"type": "string", "maxLength": 6},
                       "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "rank"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import engine.api

    folder = write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    with ServerThread(lambda: engine.api.open_engine(
            str(folder), served_model_name=MODEL, max_model_len=512,
            kv_cache_memory=16 * 2**20)) as srv:
        yield srv


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_parse_with_a_pydantic_model_gives_valid_instances(client):
    for seed in SEEDS:
        reply = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Person,
                                              seed=seed, max_tokens=200)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person)


def test_streamed_json_schema_assembles_to_a_valid_document(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    for seed in SEEDS:
        stream = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt,
                                                seed=seed, max_tokens=200, stream=True)
        text, reasons = "", []
        for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                reasons.append(choice.finish_reason)
        assert reasons[-1] == "stop"
        jsonschema.validate(json.loads(text), CITY)


def test_json_object_parses_as_an_object(client):
    # A bias towards closing quotes and braces (the grammar still polices them) keeps the
    # tiny model's free strings short enough to finish.
    bias = {str(i): 4 for i in _token_ids(client, ['"', "}", '"}', '":', '{"'])}
    for seed in SEEDS:
        reply = client.chat.completions.create(
            model=MODEL, messages=ASK, response_format={"type": "json_object"}, seed=seed,
            max_tokens=400, logit_bias=bias)
        assert reply.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


def _token_ids(client, texts):
    base = str(client.base_url).removesuffix("/v1/")
    ids = []
    for t in texts:
        tokens = httpx.post(base + "/tokenize", json={"prompt": t,
                                                     "add_special_tokens": False}).json()["tokens"]
        if len(tokens) == 1:
            ids.append(tokens[0])
    return ids


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"structured_outputs": {"regex": r"[A-Z][a-z]{1,4} [0-9]{2}"}},
         lambda t: re.fullmatch(r"[A-Z][a-z]{1,4} [0-9]{2}", t)),
        ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
        ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
        ({"guided_regex": "(ab|cd)+!"}, lambda t: re.fullmatch("(ab|cd)+!", t)),
        ({"structured_outputs": {"json": CITY}}, lambda t: jsonschema.validate(json.loads(t), CITY) is None),
        ({"guided_json": json.dumps(CITY)}, lambda t: jsonschema.validate(json.loads(t), CITY) is None),
        ({"structured_outputs": {"grammar": 'root ::= "x" ("+" "x"){0,3}'}},
         lambda t: re.fullmatch(r"x(\+x){0,3}", t)),
    ],
)
def test_extra_body_structured_outputs_on_completions_and_chat(client, extra, check):
    for seed in SEEDS:
        chat = client.chat.completions.create(model=MODEL, messages=ASK, seed=seed,
                                              max_tokens=200, extra_body=extra)
        assert chat.choices[0].finish_reason == "stop"
        assert check(chat.choices[0].message.content), chat.choices[0].message.content
        text = client.completions.create(model=MODEL, prompt="Say:", seed=seed, max_tokens=200,
                                         extra_body=extra)
        assert text.choices[0].finish_reason == "stop"
        assert check(text.choices[0].text), text.choices[0].text


def test_n_samples_each_match_in_one_streamed_completion(client):
    stream = client.completions.create(model=MODEL, prompt="Pick:", n=3, seed=1, max_tokens=50,
                                       stream=True, extra_body={"guided_choice": ["a1", "b2"]})
    texts = ["", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert all(t in ("a1", "b2") for t in texts)


BAD = [
    ({"response_format": {"type": "grammar"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema"),
    ({"structured_outputs": {"yaml": "a: 1"}}, "structured_outputs.yaml"),
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"guided_regex": "[", "max_tokens": 4}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a"}, "ignore_eos": True}, "ignore_eos"),
    # Beam search ranks on the raw logprobs: a constraint would be silently dropped.
    ({"use_beam_search": True, "guided_regex": "a+"}, "structured_outputs"),
    # The tiny model's tokenizer has no FIM tokens (completions), and chat has no suffix.
    ({"suffix": "!"}, "suffix"),
]


@pytest.mark.parametrize(("change", "param"), BAD)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(server, client, change, param):
    for path, body in (("/v1/chat/completions", {"messages": ASK}),
                       ("/v1/completions", {"prompt": "x"})):
        for stream in (False, True):
            r = httpx.post(server.base_url + path,
                           json={"model": MODEL, "max_tokens": 8, **body, **change,
                                 "stream": stream})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param, r.text
    assert httpx.get(server.base_url + "/health").status_code == 200
    ok = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                        extra_body={"guided_choice": ["fine"]})
    assert ok.choices[0].message.content == "fine"
    stats = server.engine.statistics()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == 0


def test_text_response_format_and_no_op_values_are_plain_requests(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                           response_format={"type": "text"},
                                           extra_body={"best_of": 1, "use_beam_search": False})
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_metrics_count_structured_requests_and_compile_time(server, client):
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20,
                                   extra_body={"guided_choice": ["metric"]})
    text = httpx.get(server.base_url + "/metrics").text
    counts = re.findall(r'^engine:structured_output_requests_total\{[^}]*kind="choice"[^}]*\} (\S+)$', text, re.M)
    assert counts and float(counts[0]) >= 1
    assert re.search(r"^engine:structured_output_compile_seconds_count\{[^}]*\} [1-9]", text, re.M)


# Issue 28: a guided_json object cut by stop "}" came back as '{"a": {"b": 100' and a
# regex cut by stop "-" as '1000', both with finish_reason "stop". A stop string beside
# a constraint is refused: the constraint is what a "stop" answer promises.
NESTED = {"type": "object", "properties": {"a": {"type": "object", "properties": {
    "b": {"type": "integer"}}, "required": ["b"]}}, "required": ["a"]}
STOP_CASES = {
    "guided_json_cut_by_brace": ({"guided_json": NESTED}, ["}"]),
    "guided_regex_cut_by_dash": ({"guided_regex": r"\d{4}-\d{2}"}, ["-"]),
    "guided_choice": ({"guided_choice": ["yes-no", "no"]}, "-"),
    "guided_grammar": ({"guided_grammar": 'root ::= "a" "-" "b"'}, ["-"]),
    "structured_outputs": ({"structured_outputs": {"regex": "[a-z]+"}}, ["q"]),
    "response_format_json_schema": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": NESTED}}}, ["}"]),
    "response_format_json_object": ({"response_format": {"type": "json_object"}}, [","]),
}


@pytest.mark.parametrize("case", list(STOP_CASES))
def test_a_stop_string_with_a_constraint_is_a_400_naming_stop(server, case):
    constraint, stop = STOP_CASES[case]
    for path, body in (("/v1/chat/completions", {"messages": ASK}),
                       ("/v1/completions", {"prompt": "x"})):
        for stream in (False, True):
            r = httpx.post(server.base_url + path, json={
                "model": MODEL, "max_tokens": 16, **body, **constraint, "stop": stop,
                "stream": stream})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "stop", r.text
    # The same constraint without stop strings (or with an empty list) is served.
    r = httpx.post(server.base_url + "/v1/completions", json={
        "model": MODEL, "max_tokens": 16, "prompt": "x", **constraint, "stop": [], "seed": 0})
    assert r.status_code == 200, r.text


def test_the_embedded_api_refuses_stop_strings_with_a_constraint():
    from engine.errors import InvalidParamError
    from engine.params import SamplingParams
    from engine.structured import StructuredOutputs

    spec = StructuredOutputs(regex=r"\d{4}-\d{2}")
    with pytest.raises(InvalidParamError) as info:
        SamplingParams(stop=["-"], structured_outputs=spec)
    assert info.value.param == "stop"
    with pytest.raises(InvalidParamError):
        SamplingParams(stop=["-"]).replace(structured_outputs=spec)
    assert SamplingParams(stop_token_ids=[5], structured_outputs=spec).stop == ()


@pytest.mark.parametrize("stream", [False, True])
def test_a_text_stop_token_id_with_a_constraint_is_a_400_and_eos_is_fine(server, stream):
    # A text token in stop_token_ids ends a constrained output early like a stop string;
    # EOS (which the grammar allows only where the output is complete) may stay.
    tok = server.engine.tokenizer
    dash = tok.encode("-", add_special_tokens=False)[-1]
    body = {"model": MODEL, "prompt": "x", "max_tokens": 16, "seed": 0, "stream": stream,
            "guided_regex": "[0-9]{2}-[0-9]{2}"}
    r = httpx.post(server.base_url + "/v1/completions", json={**body, "stop_token_ids": [dash]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "stop_token_ids"
    r = httpx.post(server.base_url + "/v1/completions",
                   json={**body, "stream": False, "stop_token_ids": [tok.eos_token_id]})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and re.fullmatch("[0-9]{2}-[0-9]{2}", choice["text"])
