"""Property: for random schemas drawn from the JSON-Schema features docs/serving.md lists as
supported ("The JSON Schema subset"), every finished 200 output validates with
``jsonschema`` (formats checked too). The tiny random model at temperature 1 wanders over
everything the grammar allows; hypothesis draws the schemas (a bounded number, so the test
stays within seconds), and each request samples three outputs.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest
from http_server import ServerThread
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.models.testing import write_tiny_model

MODEL = "tiny-property"
NAMES = ("a", "b", "id", "name", "x_y")
FORMATS = ("date", "time", "date-time", "email", "uuid", "ipv4", "ipv6", "hostname")
SCALARS = st.one_of(st.integers(-50, 50), st.sampled_from(["", "a", "yes", "no", "x y"]),
                    st.booleans(), st.none())


@st.composite
def _integer(draw: Any) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    low = draw(st.none() | st.integers(-100, 100))
    high = draw(st.none() | st.integers(-100, 100))
    if low is not None:
        schema["minimum"] = low
    if high is not None:
        schema["maximum"] = max(high, low if low is not None else high)
    if draw(st.booleans()):
        schema["multipleOf"] = draw(st.integers(1, 5))
        if low is not None and high is not None:  # keep a multiple in range
            schema["maximum"] = schema["minimum"] + 10
    return schema


@st.composite
def _number(draw: Any) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "number"}
    low = draw(st.integers(-10, 10))
    key = draw(st.sampled_from(["minimum", "exclusiveMinimum"]))
    schema[key] = low
    schema[draw(st.sampled_from(["maximum", "exclusiveMaximum"]))] = low + draw(st.integers(1, 20))
    return schema


@st.composite
def _string(draw: Any) -> dict[str, Any]:
    which = draw(st.sampled_from(["length", "pattern", "format", "plain"]))
    if which == "length":
        low = draw(st.integers(0, 4))
        return {"type": "string", "minLength": low, "maxLength": low + draw(st.integers(0, 4))}
    if which == "pattern":
        return {"type": "string",
                "pattern": draw(st.sampled_from(["^[a-z]{1,6}$", "^[0-9]{2,3}-[A-Z]$",
                                                 "^(yes|no)$", "^a+b?$"]))}
    if which == "format":
        return {"type": "string", "format": draw(st.sampled_from(FORMATS))}
    return {"type": "string", "maxLength": 8}


LEAVES = st.one_of(
    _integer(), _number(), _string(), st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.lists(SCALARS, min_size=1, max_size=4, unique_by=json.dumps).map(lambda v: {"enum": v}),
    SCALARS.map(lambda v: {"const": v}),
    st.just({"type": ["integer", "null"]}),
)


def _extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    @st.composite
    def obj(draw: Any) -> dict[str, Any]:
        names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))
        props = {n: draw(children) for n in names}
        schema: dict[str, Any] = {"type": "object", "properties": props,
                                  "required": draw(st.lists(st.sampled_from(names), unique=True))}
        if draw(st.booleans()):
            schema["additionalProperties"] = False
        return schema

    @st.composite
    def arr(draw: Any) -> dict[str, Any]:
        low = draw(st.integers(0, 2))
        schema: dict[str, Any] = {"type": "array", "items": draw(children), "minItems": low,
                                  "maxItems": low + draw(st.integers(0, 2))}
        if draw(st.booleans()):
            schema["prefixItems"] = [draw(children)]
        return schema

    return st.one_of(
        obj(), arr(),
        st.lists(children, min_size=2, max_size=3).map(lambda s: {"anyOf": s}),
        children.map(lambda s: {"allOf": [s]}),
        children.map(lambda s: {"title": "t", "description": "annotated", **s}),
    )


_TREES = st.recursive(LEAVES, _extend, max_leaves=5)
# $defs live on the root (a $ref resolves from there), referenced at the top or below.
SCHEMAS = st.one_of(
    _TREES,
    _TREES.map(lambda s: {"$defs": {"d": s}, "$ref": "#/$defs/d"}),
    _TREES.map(lambda s: {"$defs": {"d": s}, "type": "object",
                          "properties": {"v": {"$ref": "#/$defs/d"}}, "required": ["v"]}),
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import engine.api

    folder = write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    with ServerThread(lambda: engine.api.open_engine(
            str(folder), served_model_name=MODEL, max_model_len=512,
            kv_cache_memory=16 * 2**20)) as srv:
        yield srv


def test_every_finished_output_of_a_supported_schema_validates(server):
    formats = jsonschema.FormatChecker()
    finished: list[int] = []

    # 20 schemas x 3 samples of at most 48 tokens: seconds on the tiny model.
    @settings(max_examples=20, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(schema=SCHEMAS, seed=st.integers(0, 2**31))
    def check(schema: dict[str, Any], seed: int) -> None:
        r = httpx.post(server.base_url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "JSON:", "max_tokens": 48, "n": 3, "seed": seed,
            "guided_json": schema})
        assert r.status_code == 200, (schema, r.text)
        for choice in r.json()["choices"]:
            if choice["finish_reason"] == "stop":
                finished.append(1)
                jsonschema.validate(json.loads(choice["text"]), schema, format_checker=formats)

    check()
    assert len(finished) >= 20, f"only {len(finished)} of 60 outputs finished"
