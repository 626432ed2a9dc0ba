"""check_body's compiled fast path (jsonschema-rs) never lets through a body that the
``jsonschema`` library refuses.

check_body asks the compiled validator first and returns at once when it passes a body;
anything it refuses goes to ``jsonschema``, whose verdict and error message stand. So the
one property that keeps the server failing closed is: compiled-valid implies
jsonschema-valid. The bodies come from a generator that walks each published schema,
writing mostly what the schema asks for and, at random places, a value of the wrong kind
or at a bound's edge: near-valid bodies, where two validators would disagree if they do.
"""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest

from engine.http import schema
from engine.http.errors import APIError

NAMES = ("completion", "chat", "responses", "tokenize", "detokenize", "embeddings", "score",
         "rerank")

# Values of every JSON kind, the edges of the schemas' integer ranges, and strings that
# regexes in Python and in ECMA-262 could read differently (a trailing newline before
# "$", non-ASCII digits).
ATOMS: list[Any] = [
    None, True, False, 0, 1, -1, 2, 1.0, 0.0, -0.0, 0.5, 1.5, -1.5, 100, 101, -100, -101,
    2**31 - 1, 2**31, 2**53, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 2**70,
    1e300, -1e300, 2.0**63, "", "a", "true", "TRUE", "true\n", "yes", "0", "1", "12",
    "12\n", "\u0661\u0662", "1" * 11, "auto", "none", "required", "text", "user", "system",
    "json_object", "json_schema", "float", "base64", [], [1], ["a"], [[1]], [None], {},
    {"a": 1}, {"type": "text", "text": "hi"},
]


def _value(node: Any, rng: random.Random, depth: int, noise: float) -> Any:
    """A value for schema ``node``: usually one it describes, at rate ``noise`` a random
    atom instead."""
    if depth > 6 or not isinstance(node, dict) or rng.random() < noise:
        return rng.choice(ATOMS)
    for key in ("anyOf", "oneOf"):
        if key in node:
            return _value(rng.choice(node[key]), rng, depth + 1, noise)
    if "const" in node:
        return node["const"]
    if "enum" in node:
        return rng.choice(node["enum"])
    kind = node.get("type")
    if isinstance(kind, list):
        kind = rng.choice(kind)
    if kind == "object" or "properties" in node:
        return _object(node, rng, depth, noise)
    if kind == "array":
        size = rng.choice([0, 1, 1, 2, 3])
        return [_value(node.get("items", {}), rng, depth + 1, noise) for _ in range(size)]
    if kind in ("integer", "number"):
        lo = node.get("minimum", node.get("exclusiveMinimum"))
        hi = node.get("maximum")
        inside = [v for v in (lo, hi) if v is not None and v != node.get("exclusiveMinimum")]
        inside += [lo + 1] if lo is not None and (hi is None or lo + 1 <= hi) else [7]
        outside = [v for v in (None if lo is None else lo - 1, None if hi is None else hi + 1)
                   if v is not None]
        if kind == "number":
            inside.append((lo or 0) + 0.25 if hi is None or (lo or 0) + 0.25 <= hi else hi)
        return rng.choice(outside if outside and rng.random() < 0.02 + noise else inside)
    if kind == "string":
        if "pattern" in node:
            return rng.choice(["true", "No", "1", "12", "true\n", "12\n", "maybe"])
        return rng.choice(["hello", "", "true", "x\n", "auto", "required"])
    if kind == "boolean":
        return rng.choice([True, False])
    if kind == "null":
        return None
    return rng.choice(ATOMS)


def _object(node: dict[str, Any], rng: random.Random, depth: int, noise: float) -> dict[str, Any]:
    props = node.get("properties", {})
    required = node.get("required", [])
    names = [n for n in props if n in required or rng.random() < 0.4]
    out = {n: _value(props[n], rng, depth + 1, noise) for n in names}
    if "propertyNames" in node or "additionalProperties" in node:
        extra = node.get("additionalProperties", {})
        for key in rng.sample(["5", "12", "12\n", "x", "01", "1" * 11], rng.randrange(3)):
            out[key] = _value(extra if isinstance(extra, dict) else {}, rng, depth + 1, noise)
    if required and rng.random() < noise / 2:
        out.pop(rng.choice(required), None)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_a_body_the_compiled_validator_passes_is_one_jsonschema_passes(name: str) -> None:
    rng = random.Random(name)
    reference = jsonschema.Draft202012Validator(schema._schema(name))
    passed = refused = 0
    for _ in range(1500):
        # From clean bodies (number edges aside) to one value in eight replaced.
        body = _object(schema._schema(name), rng, 0, rng.choice([0.0, 0.01, 0.04, 0.125]))
        fast = schema._passes(body, name)
        assert not fast or reference.is_valid(body), body
        if fast:
            passed += 1
        elif reference.is_valid(body):
            # Refused by the compiled one, passed by jsonschema (a "$" before a trailing
            # newline): check_body asks jsonschema and accepts, as it always did.
            schema.check_body(body, name)
        else:
            refused += 1
            with pytest.raises(APIError) as caught:
                schema.check_body(body, name)
            assert caught.value.status == 400
    # The generator reaches both verdicts often, or the property above says little.
    assert passed > 100 and refused > 100, (passed, refused)


def _enum_fields(node: dict[str, Any]) -> dict[str, list[Any]]:
    """Top-level fields of ``node`` that take one of listed values (or null)."""
    out = {}
    for field, sub in node.get("properties", {}).items():
        for branch in sub.get("anyOf", [sub]):
            if "enum" in branch:
                out[field] = branch["enum"]
    return out


@pytest.mark.parametrize("name", [n for n in NAMES if _enum_fields(schema._schema(n))])
def test_a_value_outside_a_fields_list_is_a_400_listing_the_values(name: str) -> None:
    """The refusal of a listed-values field ("encoding_format": "hex") names the field and
    says which values it takes, read from the published schema."""
    node = schema._schema(name)
    fields = _enum_fields(node)
    rng = random.Random(name)
    reference = jsonschema.Draft202012Validator(node)
    base = next(b for b in ({n: _value(node["properties"][n], rng, 1, 0.0)
                             for n in node.get("required", [])} for _ in range(100))
                if reference.is_valid(b))
    for field, values in fields.items():
        with pytest.raises(APIError) as caught:
            schema.check_body({**base, field: "__none_of_them__"}, name)
        error = caught.value.body()["error"]
        assert caught.value.status == 400 and error["param"] == field
        for value in values:
            assert json.dumps(value) in error["message"] or repr(value) in error["message"]


def test_a_nullable_objects_inner_rule_is_named_not_its_type() -> None:
    """A value of the right type that breaks a rule inside it (a logit_bias key that is no
    token id) is refused with that rule, not "must be object or null"."""
    base = {"messages": [{"role": "user", "content": "hi"}]}
    pattern = schema.COMMON["logit_bias"]["anyOf"][0]["propertyNames"]["pattern"]
    with pytest.raises(APIError) as caught:
        schema.check_body({**base, "logit_bias": {"abc": 1}}, "chat")
    error = caught.value.body()["error"]
    assert error["param"] == "logit_bias" and pattern in error["message"] and "'abc'" in error["message"]
    assert jsonschema.Draft202012Validator(schema.COMMON["logit_bias"]).is_valid({"12": 1})
    # The wrong type altogether still says which types the field takes.
    with pytest.raises(APIError) as caught:
        schema.check_body({**base, "logit_bias": ["12"]}, "chat")
    assert "object" in caught.value.body()["error"]["message"]
