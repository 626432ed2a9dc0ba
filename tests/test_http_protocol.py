"""The OpenAI request bodies as the engine sees them: every documented parameter reaches
:class:`SamplingParams` (or the request), and what is not understood is said once and ignored.

Pure parsing, no server: tests/test_http_openai.py checks that the engine honours them.
"""

from __future__ import annotations

import json
import logging

import pytest

from engine.errors import InvalidParamError
from engine.http import strict_json
from engine.http.completions import protocol
from engine.http.completions.answer import Completion
from engine.http.errors import APIError
from engine.messages import RequestOutput, TokenLogprob, Usage

CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("field", "value", "attr", "expected"),
    [
        ("max_tokens", 7, "max_tokens", 7),
        ("temperature", 0.5, "temperature", 0.5),
        ("top_p", 0.9, "top_p", 0.9),
        ("top_k", 20, "top_k", 20),
        ("min_p", 0.1, "min_p", 0.1),
        ("n", 3, "n", 3),
        ("stop", "END", "stop", ("END",)),
        ("stop", ["a", "b"], "stop", ("a", "b")),
        ("stop_token_ids", [4, 5], "stop_token_ids", (4, 5)),
        ("seed", 42, "seed", 42),
        ("presence_penalty", 0.5, "presence_penalty", 0.5),
        ("frequency_penalty", -0.5, "frequency_penalty", -0.5),
        ("repetition_penalty", 1.2, "repetition_penalty", 1.2),
        ("ignore_eos", True, "ignore_eos", True),
        ("min_tokens", 2, "min_tokens", 2),
        ("logit_bias", {"7": -3, "9": 100}, "logit_bias", ((7, -3.0), (9, 100.0))),
        ("logprobs", 3, "logprobs", 3),
        ("include_stop_str_in_output", True, "include_stop_str_in_output", True),
        ("skip_special_tokens", False, "skip_special_tokens", False),
    ],
)
def test_every_completion_parameter_reaches_the_sampling_params(field, value, attr, expected):
    req = protocol.parse_completion({"prompt": "x", field: value})
    assert getattr(req.params, attr) == expected


@pytest.mark.parametrize(
    ("field", "value", "attr", "expected"),
    [
        ("max_tokens", 7, "max_tokens", 7),
        ("max_completion_tokens", 9, "max_tokens", 9),
        ("temperature", 0.0, "temperature", 0.0),
        ("stop_token_ids", [4], "stop_token_ids", (4,)),
        ("min_tokens", 2, "min_tokens", 2),
        ("logit_bias", {"7": 1}, "logit_bias", ((7, 1.0),)),
        ("seed", 3, "seed", 3),
        ("n", 2, "n", 2),
    ],
)
def test_every_chat_parameter_reaches_the_sampling_params(field, value, attr, expected):
    req = protocol.parse_chat({"messages": CHAT, field: value})
    assert getattr(req.params, attr) == expected


def test_defaults_are_openais():
    assert protocol.parse_completion({"prompt": "x"}).params.max_tokens == 16
    chat = protocol.parse_chat({"messages": CHAT})
    assert chat.params.max_tokens is None  # up to the context
    assert chat.top_logprobs is None and chat.params.logprobs is None
    assert not chat.stream and not chat.include_usage


def test_max_completion_tokens_wins_and_a_null_one_falls_back_to_max_tokens():
    both = protocol.parse_chat({"messages": CHAT, "max_tokens": 5, "max_completion_tokens": 3})
    assert both.params.max_tokens == 3
    # Clients that serialise every field send null for the one they did not set.
    null = protocol.parse_chat({"messages": CHAT, "max_tokens": 5, "max_completion_tokens": None})
    assert null.params.max_tokens == 5


def test_chat_logprobs_and_top_logprobs():
    plain = protocol.parse_chat({"messages": CHAT, "logprobs": True})
    assert plain.top_logprobs == 0 and plain.params.logprobs == 0
    top = protocol.parse_chat({"messages": CHAT, "logprobs": True, "top_logprobs": 4})
    assert top.top_logprobs == 4 and top.params.logprobs == 4
    with pytest.raises(APIError) as info:
        protocol.parse_chat({"messages": CHAT, "top_logprobs": 4})
    assert info.value.param == "top_logprobs"
    with pytest.raises(APIError) as info:
        protocol.parse_chat({"messages": CHAT, "logprobs": True, "top_logprobs": -2})
    assert (info.value.status, info.value.param) == (400, "top_logprobs")
    # -1 (the whole vocabulary) and counts past 20 are the engine's to allow
    # (--max-logprobs, checked at admission); top_logprobs 0 needs no logprobs: true.
    every = protocol.parse_chat({"messages": CHAT, "logprobs": True, "top_logprobs": -1})
    assert every.params.logprobs == -1
    assert protocol.parse_chat({"messages": CHAT, "top_logprobs": 0}).params.logprobs is None


def test_echo_and_stream_flags():
    req = protocol.parse_completion({"prompt": "x", "echo": True, "stream": True,
                                     "stream_options": {"include_usage": True}})
    assert req.echo and req.stream and req.include_usage
    assert req.params.prompt_logprobs is None
    scored = protocol.parse_completion({"prompt": "x", "echo": True, "logprobs": 3})
    assert (scored.params.logprobs, scored.params.prompt_logprobs) == (3, 3)
    with pytest.raises(APIError) as info:
        protocol.parse_completion({"prompt": "x", "stream_options": {"include_usage": True}})
    assert info.value.param == "stream_options"


def test_unknown_fields_are_ignored_with_one_log_line(caplog):
    caplog.set_level(logging.INFO, logger="engine.http")
    req = protocol.parse_completion({"prompt": "x", "max_tokens": 2, "user": "alice",
                                     "suffix": "", "best_of": 1, "frobnicate": 3})
    assert req.params.max_tokens == 2
    assert (req.suffix, req.returned_n) == (None, None)  # suffix "" and best_of 1: no-ops
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.http"]
    assert lines == ["ignoring unknown request fields: frobnicate"]


@pytest.mark.parametrize("field", [{"length_penalty": 0.5}, {"early_stopping": True}])
def test_fields_that_change_the_answer_and_are_not_implemented_are_refused(field):
    (name,) = field
    for parse, body in ((protocol.parse_completion, {"prompt": "x"}),
                        (protocol.parse_chat, {"messages": CHAT})):
        with pytest.raises(APIError) as info:
            parse({**body, **field})
        assert (info.value.status, info.value.param) == (400, name)


@pytest.mark.parametrize("field", [{"best_of": 2}, {"suffix": "!"}, {"prompt_embeds": "x"}])
def test_completions_only_fields_are_refused_by_chat(field):
    (name,) = field
    with pytest.raises(APIError) as info:
        protocol.parse_chat({"messages": CHAT, **field})
    assert (info.value.status, info.value.param) == (400, name)
    assert "/v1/completions" in info.value.message


def test_include_reasoning_false_is_refused_by_completions():
    with pytest.raises(APIError) as info:
        protocol.parse_completion({"prompt": "x", "include_reasoning": False})
    assert (info.value.status, info.value.param) == (400, "include_reasoning")


def test_structured_output_fields_become_one_constraint():
    from engine.structured import StructuredOutputs

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a",
          "schema": schema, "strict": True}}}, StructuredOutputs(json=schema),
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True),
         "response_format"),
        ({"structured_outputs": {"regex": "a+"}}, StructuredOutputs(regex="a+"),
         "structured_outputs.regex"),
        ({"guided_choice": ["x", "y"]}, StructuredOutputs(choice=("x", "y")), "guided_choice"),
        ({"guided_json": json.dumps(schema)}, StructuredOutputs(json=schema), "guided_json"),
        ({"guided_grammar": 'root ::= "a"'}, StructuredOutputs(grammar='root ::= "a"'),
         "guided_grammar"),
        ({"response_format": {"type": "text"}}, None, None),
    ]
    for field, spec, param in cases:
        req = protocol.parse_chat({"messages": CHAT, **field})
        assert (req.params.structured_outputs, req.structured_param) == (spec, param)
        req = protocol.parse_completion({"prompt": "x", **field})
        assert (req.params.structured_outputs, req.structured_param) == (spec, param)
    with pytest.raises(InvalidParamError) as both:
        protocol.parse_chat({"messages": CHAT, "guided_regex": "a",
                             "response_format": {"type": "json_object"}})
    assert both.value.param == "guided_regex"


def test_user_is_accepted_silently(caplog):
    caplog.set_level(logging.INFO, logger="engine.http")
    protocol.parse_chat({"messages": CHAT, "user": "alice"})
    protocol.parse_completion({"prompt": "x", "user": "alice"})
    assert not [r for r in caplog.records if r.name == "engine.http"]


def test_priority_and_cache_salt_reach_the_request():
    req = protocol.parse_completion({"prompt": "x", "priority": -3, "cache_salt": "tenant-a"})
    assert (req.priority, req.cache_salt) == (-3, "tenant-a")
    chat = protocol.parse_chat({"messages": CHAT, "priority": 2})
    assert (chat.priority, chat.cache_salt) == (2, None)
    plain = protocol.parse_completion({"prompt": "x"})
    assert (plain.priority, plain.cache_salt) == (0, None)


@pytest.mark.parametrize(
    ("field", "value"), [("priority", "high"), ("priority", 1.5), ("cache_salt", 7), ("cache_salt", "")]
)
def test_bad_priority_or_cache_salt_is_400_naming_it(field, value):
    with pytest.raises(APIError) as info:
        protocol.parse_completion({"prompt": "x", field: value})
    assert (info.value.status, info.value.param) == (400, field)


# -- request bodies and response JSON ------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "param", "fragment"),
    [
        # Regressions: each was a 500 (RecursionError, a surrogate reaching the tokenizer).
        (b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", None, "nests 1001 levels"),
        (b'{"model": "\\ud800"}', "model", "lone surrogate"),
        (b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}', "messages[0].content",
         "lone surrogate"),
        (b'{"logit_bias": {"\\ud800": 1}}', "logit_bias", "lone surrogate"),
        (b'{"temperature": NaN}', None, "NaN"),
        (b'{"temperature": -Infinity}', None, "-Infinity"),
        (b'{"logit_bias": {"5": 1e999}}', None, "out of range"),
        (b"\xff\xfe", None, "UTF-8"),
        (b"{", None, "not valid JSON"),
    ],
)
def test_bad_bodies_are_a_400_naming_the_field(data, param, fragment) -> None:
    with pytest.raises(APIError) as info:
        strict_json.loads_body(data)
    assert info.value.status == 400 and info.value.param == param
    assert fragment in info.value.message


def test_a_body_at_the_depth_limit_and_brackets_inside_strings_are_fine() -> None:
    depth = strict_json.MAX_JSON_DEPTH
    assert strict_json.loads_body(b"[" * depth + b"]" * depth) is not None
    assert strict_json.loads_body(b'{"prompt": "[[[[[[[[[[{{{{{{{{\\\\\\"[[[["}') == {
        "prompt": '[[[[[[[[[[{{{{{{{{\\"[[[['}


def test_values_and_containers_are_counted_before_parsing_and_strings_do_not_count() -> None:
    at_limit = b"[" + b",".join([b"1"] * strict_json.MAX_JSON_VALUES) + b"]"
    assert len(strict_json.loads_body(at_limit)) == strict_json.MAX_JSON_VALUES
    with pytest.raises(APIError, match="values") as info:
        strict_json.loads_body(b"[" + b",".join([b"1"] * (strict_json.MAX_JSON_VALUES + 1)) + b"]")
    assert info.value.code == "too_many_values"
    lists = strict_json.MAX_JSON_CONTAINERS - 1  # plus the outer one
    assert len(strict_json.loads_body(b"[" + b",".join([b"[]"] * lists) + b"]")) == lists
    with pytest.raises(APIError, match="arrays and objects"):
        strict_json.loads_body(b"[" + b",".join([b"{}"] * (lists + 1)) + b"]")
    # Commas and brackets inside strings (escaped quotes too) are text, not structure.
    text = '\\"' + ",[{" * strict_json.MAX_JSON_VALUES
    assert strict_json.loads_body(json.dumps({"prompt": text}).encode()) == {"prompt": text}


def test_the_json_string_pattern_finds_the_strings_json_does() -> None:
    # The blanking that counts values and depth must see exactly JSON's strings.
    import random

    rng = random.Random(0)
    alphabet = ['"', "\\", "a", ",", "[", "{", "u", "n", "\u00e9"]
    for _ in range(300):
        value = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(12)))
                 for _ in range(rng.randrange(1, 5))]
        text = json.dumps(value)
        assert strict_json._JSON_STRING.sub('""', text) == json.dumps([""] * len(value))


def test_response_json_never_holds_nan_or_infinity() -> None:
    from engine.http import sse

    body = {"logprob": float("-inf"), "top": [float("nan"), 1.5], "ok": 2}
    text = sse.dumps(body).decode()
    assert json.loads(text, parse_constant=lambda c: pytest.fail(c)) == {
        "logprob": sse.NO_LOGPROB, "top": [None, 1.5], "ok": 2}


def test_a_floatless_chunk_is_written_byte_for_byte_as_the_standard_encoder_writes_it() -> None:
    """The orjson path of token chunks without logprobs against the standard library's
    encoder (``sse.dumps``) on text of every kind a detokenizer can produce."""
    import random

    from engine.http import sse

    rng = random.Random(1)
    pieces = ["a", " ", '"', "\\", "/", "\n", "\r", "\t", "\x00", "\x1f", "\x7f", "\u00e9",
              "\u2028", "\u2029", "\ufeff", "\U0001f600", "\u4e2d", "</script>", "\\u0041"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(8)))
        chunk = {"id": "cmpl-" + text[:3], "object": "text_completion", "created": 1_700_000_000,
                 "model": "m", "choices": [{"index": rng.randrange(4), "text": text,
                                            "logprobs": None, "finish_reason": None,
                                            "token_ids": [rng.randrange(2**31) for _ in range(3)]}],
                 "usage": {"prompt_tokens": 5, "total_tokens": 9}, "ok": True}
        assert sse.event(chunk, floats=False) == sse.event(chunk)
    # What orjson refuses goes the standard way: an integer past 64 bits.
    big = {"n": 2**70}
    assert sse.event(big, floats=False) == sse.event(big)


# -- one request's choices (Completion) ------------------------------------------


def _completion(body: dict, prompt_ids: list[tuple[int, ...]]) -> Completion:
    chat = "messages" in body
    req = protocol.parse_chat(body) if chat else protocol.parse_completion(body)
    return Completion(req, "m", prompt_ids, lambda t: f"<{t}>",
                               lambda ids: "".join(f"<{t}>" for t in ids))


def _out(index: int, text: str, ids: tuple[int, ...], *, finished: bool = False,
         logprobs: tuple | None = None, prompt_logprobs: tuple | None = None) -> RequestOutput:
    return RequestOutput("r", index, text, ids, finished, "length" if finished else None, None,
                         logprobs, Usage(2, 1) if finished else None, prompt_logprobs)


def test_a_streamed_token_that_is_not_yet_text_waits_with_its_logprobs() -> None:
    answer = _completion({"prompt": "hi", "logprobs": 1, "stream": True}, [(5, 6)])
    lp = [TokenLogprob(7, -0.5, ((7, -0.5),)), TokenLogprob(8, -0.25, ((8, -0.25),))]
    assert answer.opening_chunks() == []
    assert answer.stream_output(0, _out(0, "", (7,), logprobs=(lp[0],))) == []  # half a character
    (chunk,) = answer.stream_output(0, _out(0, "é", (8,), finished=True, logprobs=(lp[1],)))
    choice = chunk["choices"][0]
    assert choice["text"] == "é" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["<7>", "<8>"]
    assert choice["logprobs"]["text_offset"] == [0, 3]
    # prompt_tokens_details only with --enable-prompt-tokens-details, as vLLM.
    assert answer.usage() == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


def test_echo_with_logprobs_aligns_prompt_then_completion_in_both_writers() -> None:
    body = {"prompt": [5, 6], "echo": True, "logprobs": 0, "max_tokens": 1}
    scored = (None, TokenLogprob(6, -1.0, ()))
    out = _out(0, "<9>", (9,), finished=True, logprobs=(TokenLogprob(9, -0.5, ()),),
               prompt_logprobs=scored)
    collected = _completion(body, [(5, 6)])
    collected.begin_collected()
    collected.record(0, out)
    (choice,) = collected.response()["choices"]
    assert choice["text"] == "<5><6><9>"
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0, -0.5]
    assert choice["logprobs"]["text_offset"] == [0, 3, 6]
    streamed = _completion(dict(body, stream=True), [(5, 6)])
    assert streamed.opening_chunks() == []  # the echo waits for the prompt's logprobs
    echo, token = streamed.stream_output(0, out)
    assert echo["choices"][0]["text"] == "<5><6>"
    assert echo["choices"][0]["logprobs"]["token_logprobs"] == [None, -1.0]
    assert token["choices"][0]["logprobs"]["text_offset"] == [6]


def test_chat_streams_open_with_the_role_of_every_choice() -> None:
    answer = _completion({"messages": CHAT, "n": 2, "stream": True}, [(5,)])
    assert [c["choices"][0]["delta"] for c in answer.opening_chunks()] == [{"role": "assistant", "content": ""}] * 2
    answer.stream_output(0, _out(1, "x", (9,), finished=True))
    assert answer.unfinished() == [0]
