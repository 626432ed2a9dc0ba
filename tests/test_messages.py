"""Every message between actors survives a msgpack round trip unchanged."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import messages
from engine.messages import (
    ChatPrompt,
    OutputBatch,
    RequestOutput,
    SampledToken,
    SubmitRequest,
    TokenLogprob,
    Usage,
    pack,
    unpack,
)
from engine.params import SamplingParams
from engine.structured.spec import StructuredOutputs

# Valid sampling params come from a few representative constructions, not from random
# fields, because SamplingParams rejects most random values on construction.
_PARAMS = st.sampled_from(
    [
        SamplingParams(),
        SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=5, seed=2**62, stop=["\n\n", "END"]),
        SamplingParams(max_tokens=None, logprobs=5, logit_bias={7: -1.5}, stop_token_ids=[2, 3]),
        SamplingParams(prompt_logprobs=0),
    ]
)
_FLOATS = st.floats(allow_nan=False)  # NaN != NaN would fail equality, not packing
# Valid structured-output specs, for the same reason (RankGrammar carries one).
_SPECS = st.sampled_from([
    StructuredOutputs(regex=r"(yes|no) [0-9]{2,4}"),
    StructuredOutputs(json={"type": "object", "properties": {"n": {"type": "integer"}}}),
    StructuredOutputs(choice=["red", "green"]),
])


def _strategy_for(tp: object) -> st.SearchStrategy[object]:
    if tp is SamplingParams:
        return _PARAMS
    if tp is StructuredOutputs:
        return _SPECS
    if tp is float:
        return _FLOATS
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _builds(tp)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(_strategy_for(args[0]), max_size=3).map(tuple)
        return st.tuples(*(_strategy_for(a) for a in args))
    if origin in (typing.Union, __import__("types").UnionType):
        return st.one_of(*(_strategy_for(a) for a in args))
    if tp is type(None):
        return st.none()
    if tp is int:
        return st.integers(min_value=-(2**63), max_value=2**64 - 1)
    return st.from_type(tp)  # type: ignore[arg-type]


def _builds(cls: type) -> st.SearchStrategy[object]:
    hints = typing.get_type_hints(cls, vars(messages))
    fields = {f.name: _strategy_for(hints[f.name]) for f in dataclasses.fields(cls)}
    return st.builds(cls, **fields)


MESSAGE_TYPES = sorted(
    (
        obj
        for obj in vars(messages).values()
        if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == messages.__name__
    ),
    key=lambda cls: cls.__name__,
)


def test_the_message_module_defines_the_actor_protocol() -> None:
    names = {cls.__name__ for cls in MESSAGE_TYPES}
    assert {"SubmitRequest", "StepPlan", "StepResult", "AllocateSlots", "OutputBatch"} <= names


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda cls: cls.__name__)
def test_every_message_type_is_frozen_and_slotted(cls: type) -> None:
    assert cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert "__slots__" in vars(cls) and cls.__dictoffset__ == 0  # instances have no __dict__


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda cls: cls.__name__)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_message_type_round_trips(cls: type, data: st.DataObject) -> None:
    message = data.draw(_builds(cls))
    back = unpack(pack(message))
    assert type(back) is cls
    assert back == message


def test_nested_messages_and_params_keep_their_types() -> None:
    submit = SubmitRequest(
        "r1",
        ChatPrompt('[{"role": "user", "content": "héllo"}]'),
        SamplingParams(stop=["a"], seed=-5),
        priority=3,
        cache_salt="salt",
        arrival_time=1.25,
    )
    back = unpack(pack(submit))
    assert back == submit
    assert isinstance(back.prompt, ChatPrompt)
    assert isinstance(back.params, SamplingParams)


def test_logprobs_of_minus_infinity_survive() -> None:
    out = RequestOutput(
        "r", 0, "x", (1,), True, "stop", "x",
        (TokenLogprob(1, -math.inf, ((1, -math.inf),)),), Usage(3, 1),
    )
    assert unpack(pack(OutputBatch((out,), ("r#0",)))) == OutputBatch((out,), ("r#0",))
    assert unpack(pack(SampledToken("r", 4, -math.inf, ()))).logprob == -math.inf


def test_unknown_message_type_is_rejected() -> None:
    import msgpack

    with pytest.raises(ValueError, match="unknown message type"):
        unpack(msgpack.packb({"__msg__": "NoSuchMessage"}))
