"""The OpenAI request bodies as the engine sees them: every documented parameter reaches
:class:`SamplingParams` (or the request), and what is not understood is said once and ignored.

Pure parsing, no server: tests/test_http_openai.py checks that the engine honours them.
"""

from __future__ import annotations

import logging

import pytest

from engine.http import protocol
from engine.http.protocol import APIError

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
        protocol.parse_chat({"messages": CHAT, "logprobs": True, "top_logprobs": 21})
    assert (info.value.status, info.value.param) == (400, "top_logprobs")


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
                                     "suffix": "!", "best_of": 1})
    assert req.params.max_tokens == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.http"]
    assert lines == ["ignoring unknown request fields: best_of, suffix"]


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
