"""SamplingParams: every vLLM-style field, checked on construction; a bad value raises a
ValueError (InvalidParamError) that names the field."""

from __future__ import annotations

import dataclasses

import pytest

from engine import SamplingParams
from engine.errors import InvalidParamError

# The fields issue 4 asks for, by their vLLM names.
FIELDS = (
    "n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logprobs", "include_stop_str_in_output", "skip_special_tokens",
)


def test_every_field_exists_and_the_defaults_are_valid() -> None:
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(FIELDS) <= names
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k) == (1, 1.0, 1.0, 0)
    assert params.skip_special_tokens and not params.ignore_eos and params.logprobs is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", 1.5),
        ("max_tokens", 0),
        ("max_tokens", "16"),
        ("min_tokens", -1),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -2),
        ("top_k", 2.0),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("seed", 2**63),
        ("seed", 1.0),
        ("stop", [""]),
        ("stop", [3]),
        ("stop", 3),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["2"]),
        ("stop_token_ids", 2),
        ("ignore_eos", "yes"),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        # Regression: 1e-320 divided positive logits into +inf, and the sampler's draw ran
        # off the end of the vocabulary ("index 49152 is out of bounds"), killing the engine.
        ("repetition_penalty", 1e-320),
        ("repetition_penalty", float("inf")),
        ("repetition_penalty", True),
        ("temperature", float("nan")),
        ("top_p", float("inf")),
        ("stop", ["x" * 513]),
        ("stop", [str(i) for i in range(33)]),
        ("stop_token_ids", [2**31]),
        ("logit_bias", {2**31: 1.0}),
        ("logit_bias", {3: 1e43}),
        ("logit_bias", {3: float("nan")}),
        ("logprobs", -2),  # -1 is the whole vocabulary; the cap is admission's
        ("include_stop_str_in_output", 1),
        ("skip_special_tokens", None),
        ("logit_bias", {"x": 1.0}),
        ("logit_bias", {3: "up"}),
        ("logit_bias", {3: 101.0}),
        ("logit_bias", [(3,)]),
        ("prompt_logprobs", -2),
        ("prompt_logprobs", True),
    ],
)
def test_a_bad_value_raises_value_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**{field: value})
    assert isinstance(info.value, InvalidParamError)
    assert info.value.param == field


def test_min_tokens_may_not_exceed_max_tokens() -> None:
    with pytest.raises(InvalidParamError) as info:
        SamplingParams(min_tokens=5, max_tokens=4)
    assert info.value.param == "min_tokens"
    assert SamplingParams(min_tokens=50, max_tokens=None).min_tokens == 50


def test_lists_and_dicts_are_stored_as_tuples_and_a_set_field_is_checked() -> None:
    params = SamplingParams(stop="END", stop_token_ids=[2, 3], logit_bias={"7": -1})
    assert params.stop == ("END",)
    assert params.stop_token_ids == (2, 3)
    assert params.logit_bias == ((7, -1.0),)
    assert SamplingParams(logit_bias=[[7, -1.0]]).logit_bias == ((7, -1.0),)
    hash(params)  # every field is immutable
    # vLLM's SamplingParams is mutable, and scripts set fields: a set field is checked and
    # stored as the constructor stores it; a bad one raises and changes nothing.
    params.stop = ["A", "B"]  # type: ignore[assignment]
    params.max_tokens = 7
    assert (params.stop, params.max_tokens) == (("A", "B"), 7)
    with pytest.raises(InvalidParamError) as caught:
        params.temperature = -1.0
    assert caught.value.param == "temperature" and params.temperature == 1.0
    with pytest.raises(AttributeError):
        params.temprature = 0.5  # type: ignore[attr-defined]
    copy = params.clone()
    copy.max_tokens = 1
    assert (params.max_tokens, copy.max_tokens) == (7, 1)


def test_boundary_values_are_accepted() -> None:
    SamplingParams(
        temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, seed=-(2**63), logprobs=0, prompt_logprobs=20,
        presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=100.0, max_tokens=None,
    )


def test_generation_defaults_take_the_sampling_fields_a_model_sets() -> None:
    from engine.params import generation_defaults

    config = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
              "repetition_penalty": 1.05, "do_sample": True, "max_new_tokens": 99,
              "eos_token_id": 2}
    assert generation_defaults(config) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                           "min_p": 0.0, "repetition_penalty": 1.05}
    # An invalid value is dropped rather than failing every request.
    assert generation_defaults({"temperature": -1, "top_p": 0.5}) == {"top_p": 0.5}
    assert generation_defaults({}) == {}


def test_vllms_other_field_names_are_taken_at_their_neutral_values_and_refused_otherwise() -> None:
    """A script written for vLLM passes fields the engine has no use for at their
    defaults; a value that asks for something the engine does not do is refused by name."""
    from engine.structured import StructuredOutputs

    params = SamplingParams(n=2, best_of=2, detokenize=True, spaces_between_special_tokens=True,
                            output_kind=None, truncate_prompt_tokens=None, bad_words=None,
                            allowed_token_ids=None, logits_processors=[], extra_args={},
                            thinking_token_budget=-1, max_tokens=8)
    assert params == SamplingParams(n=2, max_tokens=8)  # nothing stored, -1 is no budget
    # best_of above n is the completions route's (OpenAI's); code in a request is refused.
    for name, value in [("best_of", 3), ("logits_processors", [lambda ids, logits: logits])]:
        with pytest.raises(InvalidParamError) as info:
            SamplingParams(**{name: value})
        assert info.value.param == name
    # detokenize=False is built (token ids only); stop strings need the text.
    assert SamplingParams(detokenize=False).detokenize is False
    with pytest.raises(InvalidParamError) as info:
        SamplingParams(detokenize=False, stop=["."])
    assert info.value.param == "stop"
    with pytest.raises(InvalidParamError) as info:
        SamplingParams(n=2, best_of=3)
    assert "or n (2)" in str(info.value)  # what it does take
    spec = StructuredOutputs(regex="[ab]+")
    assert SamplingParams(guided_decoding=spec).structured_outputs == spec
    assert SamplingParams(guided_decoding=spec).replace(max_tokens=3).structured_outputs == spec

