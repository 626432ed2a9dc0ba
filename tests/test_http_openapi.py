"""GET /openapi.json describes the server as it validates, and the server honours it:
schemathesis generates requests from the document and checks every response against it
(no server errors, documented status codes, content types and bodies)."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from engine_helpers import tiny_model
from http_server import ServerThread
from hypothesis import HealthCheck, given, settings

import engine
from engine.http import schema as body_schema

# A short context bounds every generation schemathesis asks for on the real tiny model.
MAX_MODEL_LEN = 64
EXAMPLES = 10  # per operation


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tiny_model(tmp_path_factory)
    opener = lambda: engine.open_engine(  # noqa: E731
        str(model), dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
        kv_cache_memory=4 * 1024 * 1024, served_model_name="tiny")
    with ServerThread(opener) as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.base_url + "/openapi.json")


def test_the_document_publishes_the_schemas_the_server_validates_with(server) -> None:
    document = httpx.get(server.base_url + "/openapi.json").json()
    assert document["openapi"].startswith("3.1")
    schemas = document["components"]["schemas"]
    # The very dictionaries check_body validates with (JSON round trip aside).
    import json

    for name, definition in (("CompletionRequest", body_schema.COMPLETION),
                             ("ChatCompletionRequest", body_schema.CHAT)):
        assert schemas[name] == json.loads(json.dumps(definition))
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/tokenize",
            "/detokenize", "/metrics", "/version", "/openapi.json"} <= set(document["paths"])


def test_the_server_honours_its_own_openapi_document(api_schema, server) -> None:
    # Driven through hypothesis directly: schemathesis' pytest plugin does not run under
    # this pytest version (it reaches into private node attributes).
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {"POST /v1/completions", "POST /v1/chat/completions"} <= {op.label for op in operations}
    for operation in operations:

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def check(case) -> None:
            # Excluded: "valid by the schema, so accepted" cannot hold for what only the
            # model decides (an empty prompt after tokenization, ids past the vocabulary,
            # a prompt over the context); those are 400s by design.
            case.call_and_validate(excluded_checks=[schemathesis.checks.positive_data_acceptance])
            assert not server.engine.dead

        check()


def test_the_token_list_fast_path_agrees_with_the_published_schema() -> None:
    # check_body checks a completion's prompt and detokenize's tokens by hand (a million
    # ids are too many for jsonschema); its verdict is the schema's on every shape.
    import random

    import jsonschema

    from engine.http import schema

    prompt_schema = jsonschema.Draft202012Validator(schema.COMPLETION["properties"]["prompt"])
    tokens_schema = jsonschema.Draft202012Validator(
        schema.DETOKENIZE["properties"]["tokens"])
    atoms = [0, 5, 2**31 - 1, 2**31, -1, True, 1.5, "a", "", None, [], [3], ["a"], [[1]], {}]
    rng = random.Random(0)
    values = [*atoms, *([rng.choice(atoms) for _ in range(rng.randrange(4))]
                        for _ in range(400))]
    for value in values:
        assert schema._valid_prompt(value) == prompt_schema.is_valid(value), value
        if isinstance(value, list):
            assert schema._token_ids(value) == tokens_schema.is_valid(value), value
