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
from chat_fixtures import THINK_TEMPLATE, TIME_TOOL, TOOL_TEMPLATE, marker_id, write_marker_model
from http_fake_engine import open_fake_engine
from http_server import ServerThread

import engine.api
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
    # Behind a proxy at /llm, with X-Request-Id on every response; the routes answer
    # without the prefix too.
    with ServerThread(lambda: open_fake_engine(tokenizer, served_model_name=MODEL,
                                               max_model_len=1024), chat=SETTINGS,
                      root_path="/llm", enable_request_id_headers=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def real(folder):
    import engine.api

    # Metrics under vLLM's names (--metrics-prefix vllm).
    with ServerThread(lambda: engine.api.open_engine(
            str(folder), served_model_name=MODEL, max_model_len=1024,
            kv_cache_memory=16 * 2**20), chat=SETTINGS, metrics_prefix="vllm") as srv:
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


# -- what vLLM's pydantic models take ----------------------------------------------------------


@pytest.mark.parametrize("value", ["true", "True", "YES", "on", "1", 1, 1.0, "false", "off",
                                   "0", 0, 0.0, "maybe", "", 2, 0.5, [True]])
def test_a_boolean_field_is_read_as_vllms_pydantic_models_read_it(fake, value):
    """Oracle: pydantic's own lax reading of a ``bool | None`` field (vLLM's
    ``ChatCompletionRequest.logprobs``); what it refuses is a 400 naming the field."""
    import pydantic

    class Request(pydantic.BaseModel):
        logprobs: bool | None = False

    try:
        expected = Request.model_validate_json(json.dumps({"logprobs": value})).logprobs
    except pydantic.ValidationError:
        expected = None
    with _client(fake) as client:
        if expected is None:
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                               logprobs=value)
            assert info.value.body["param"] == "logprobs"
            return
        reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                               logprobs=value)
    (choice,) = reply.choices
    assert (choice.logprobs is not None) is expected
    if expected:
        assert len(choice.logprobs.content) == reply.usage.completion_tokens


def test_whole_answers_carry_service_tier_and_system_fingerprint_as_null(fake):
    with _client(fake) as client:
        chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
        text = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    for reply in (chat, text):
        # Sent as null keys: to_dict() keeps only the keys the server sent (the client
        # would read an absent key as None too).
        sent = reply.to_dict()
        assert "service_tier" in sent and "system_fingerprint" in sent
        assert sent["service_tier"] is None and sent["system_fingerprint"] is None


def test_tokenize_with_tools_on_a_template_without_them_counts_the_fallback_prompt(fake, folder):
    """A template that never reads tools drops them when vLLM renders it (its /tokenize
    is transformers' rendering); here the chat route runs them in the fallback tool prompt,
    and /tokenize counts what the chat route runs (the documented departure)."""
    from transformers import AutoTokenizer

    from engine.models.testing import CHATML_TEMPLATE

    tools = [UNIT_TOOL]
    body = {"messages": ASK, "tools": tools, "chat_template": CHATML_TEMPLATE}
    ours = _tokenize(fake, **body)
    assert ours.status_code == 200, ours.text
    hf = AutoTokenizer.from_pretrained(folder)
    dropped = hf.apply_chat_template(ASK, tools=tools, chat_template=CHATML_TEMPLATE,
                                     add_generation_prompt=True, tokenize=False)
    assert "set_unit" not in dropped  # what vLLM counts: the tools are gone
    text = hf.decode(ours.json()["tokens"])
    assert "set_unit" in text and text.endswith(dropped.split("<|im_start|>user")[-1])
    with _client(fake) as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=tools, max_tokens=1,
            extra_body={"chat_template": CHATML_TEMPLATE, "return_token_ids": True})
    assert reply.model_extra["prompt_token_ids"] == ours.json()["tokens"]


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
    ("verbosity", "low"),
    # Without --reasoning-parser (chat); a chat field (completions).
    ("include_reasoning", False),
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


def test_documents_reach_a_retrieval_augmented_template_as_transformers_renders_them(fake, folder):
    from transformers import AutoTokenizer

    template = ("{% for d in documents %}[{{ d.title }}] {{ d.text }}\n{% endfor %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    docs = [{"title": "Paris", "text": "Paris is the capital of France."},
            {"title": "Lyon", "text": "Lyon lies where the Rhone meets the Saone."}]
    want = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        ASK, documents=docs, chat_template=template, tokenize=True, add_generation_prompt=True,
        return_dict=False)
    got = _tokenize(fake, messages=ASK, documents=docs, chat_template=template).json()
    assert got["tokens"] == list(want)
    with _client(fake) as client:
        reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, extra_body={
            "documents": docs, "chat_template": template})
        assert reply.usage.prompt_tokens == len(want)
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1,
                                           extra_body={"documents": ["not an object"]})
        assert info.value.body["param"] == "documents[0]"
    # A completions prompt has no template to read them: refused by name.
    r = httpx.post(fake.base_url + "/v1/completions",
                   json={"model": MODEL, "prompt": "x", "max_tokens": 1, "documents": docs})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "documents")


# -- a forced call with a response_format ---------------------------------------------------


# A tool whose call is a few tokens (the random model would write long strings for free-text
# arguments).
UNIT_TOOL = {"type": "function", "function": {"name": "set_unit", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
    "additionalProperties": False}}}


def test_a_forced_call_wins_over_response_format_as_in_vllm(real):
    other = {"type": "object", "properties": {"zzz": {"type": "integer"}}, "required": ["zzz"],
             "additionalProperties": False}
    with _client(real) as client:
        for choice in ({"type": "function", "function": {"name": "set_unit"}}, "required"):
            reply = client.chat.completions.create(
                model=MODEL, messages=ASK, tools=[UNIT_TOOL], tool_choice=choice,
                max_tokens=60, temperature=0, response_format={
                    "type": "json_schema", "json_schema": {"name": "z", "schema": other}})
            calls = reply.choices[0].message.tool_calls
            assert calls and calls[0].function.name == "set_unit", reply
            jsonschema.validate(json.loads(calls[0].function.arguments),
                                UNIT_TOOL["function"]["parameters"])
        # An explicit grammar beside a forced call stays a 400 saying why.
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=MODEL, messages=ASK, tools=[UNIT_TOOL], tool_choice="required",
                max_tokens=5, extra_body={"guided_regex": "[a-z]+"})
        assert info.value.body["param"] == "tool_choice"
        assert "response_format" in info.value.body["message"]


# A oneOf whose branches cannot both match (an integer, or one of two words): a
# response_format holds the output to it, and so must a tool's parameters.
WHEN_SCHEMA = {"type": "object", "properties": {"when": {"oneOf": [
    {"type": "integer", "minimum": 0, "maximum": 9},
    {"type": "string", "enum": ["now", "later"]}]}}, "required": ["when"],
    "additionalProperties": False}
WHEN_TOOL = {"type": "function", "function": {"name": "remind", "parameters": WHEN_SCHEMA}}


@pytest.mark.parametrize("choice", ["required", "auto",
                                    {"type": "function", "function": {"name": "remind"}}])
def test_one_of_in_tool_parameters_is_enforced_as_in_response_format(real, folder, choice):
    """The calls of every tool_choice (required and auto in hermes' <tool_call> syntax, a
    named call as JSON) hold to the oneOf, as a response_format with the same schema does;
    jsonschema is the oracle."""
    from chat_fixtures import marker_id

    opening = marker_id(Tokenizer.from_folder(folder), "<tool_call>")
    with _client(real) as client:
        formatted = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=60, temperature=0, response_format={
                "type": "json_schema", "json_schema": {"name": "w", "schema": WHEN_SCHEMA}})
        jsonschema.validate(json.loads(formatted.choices[0].message.content), WHEN_SCHEMA)
        # (auto: a bias on <tool_call> makes the random model open a call.)
        reply = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WHEN_TOOL], tool_choice=choice, max_tokens=60,
            temperature=0, parallel_tool_calls=False, logit_bias={str(opening): 100})
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "remind"
    jsonschema.validate(json.loads(call.function.arguments), WHEN_SCHEMA)


# -- serving options ----------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["", "/llm"])
def test_root_path_routes_answer_with_and_without_the_prefix(fake, prefix):
    with openai.OpenAI(base_url=fake.base_url + prefix + "/v1", api_key="x",
                       max_retries=0) as client:
        reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
        assert reply.choices[0].finish_reason == "length"
        assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(fake.base_url + prefix + "/health").status_code == 200
    # Only the whole prefix is stripped: /llmx is not /llm.
    assert httpx.get(fake.base_url + "/llmx/health").status_code == 404


def test_request_id_headers_on_every_response(fake):
    mine = httpx.post(fake.base_url + "/v1/completions", headers={"X-Request-Id": "abc-1"},
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert mine.headers["X-Request-Id"] == "abc-1"
    assert mine.json()["id"] == "cmpl-abc-1"
    fresh = httpx.post(fake.base_url + "/v1/completions",
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    # The generated id is the one the request ran under (the response's id carries it).
    assert fresh.json()["id"] == "cmpl-" + fresh.headers["X-Request-Id"]
    other = httpx.post(fake.base_url + "/v1/completions",
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert other.headers["X-Request-Id"] != fresh.headers["X-Request-Id"]
    assert httpx.get(fake.base_url + "/health").headers["X-Request-Id"]


def test_load_counts_requests_in_flight_and_orca_reports_the_engine_state(fake):
    assert httpx.get(fake.base_url + "/load").json() == {"server_load": 0}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1000, "stream": True}
    with httpx.stream("POST", fake.base_url + "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()  # kept: a dropped iterator closes the response
        assert next(lines).startswith("data: ")  # the stream is under way
        assert httpx.get(fake.base_url + "/load").json() == {"server_load": 1}
    # The client left: the request is done (aborted) and no longer counted.
    for _ in range(200):
        if httpx.get(fake.base_url + "/load").json() == {"server_load": 0}:
            break
    assert httpx.get(fake.base_url + "/load").json() == {"server_load": 0}

    stats = fake.call(fake.engine.statistics)
    text = httpx.post(fake.base_url + "/v1/completions",
                      headers={"endpoint-load-metrics-format": "text"},
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    header = text.headers["endpoint-load-metrics"]
    assert header.startswith("TEXT ")
    named = dict(item.split("=") for item in header[5:].split(", "))
    assert set(named) == {"named_metrics.kv_cache_usage_perc",
                          "named_metrics.num_requests_waiting"}
    assert float(named["named_metrics.num_requests_waiting"]) == stats.waiting
    with _client(fake) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=ASK, max_tokens=1,
            extra_headers={"endpoint-load-metrics-format": "json"})
    kind, payload = raw.headers["endpoint-load-metrics"].split(" ", 1)
    assert kind == "JSON"
    report = json.loads(payload)["named_metrics"]
    assert 0.0 <= report["kv_cache_usage_perc"] <= 1.0
    assert "endpoint-load-metrics" not in httpx.post(
        fake.base_url + "/v1/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 1}).headers


def test_invocations_dispatches_by_body_shape(fake):
    chat = httpx.post(fake.base_url + "/invocations",
                      json={"model": MODEL, "messages": ASK, "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    completion = httpx.post(fake.base_url + "/invocations",
                            json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert completion.status_code == 200
    assert completion.json()["object"] == "text_completion"
    # The same checks as the routes themselves.
    bad = httpx.post(fake.base_url + "/invocations",
                     json={"model": MODEL, "prompt": "hi", "temperature": -1})
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "temperature")
    # An embeddings body goes where /v1/embeddings sends it (this generative model's
    # answer, whatever it is).
    embed = {"model": MODEL, "input": "hi"}
    via = httpx.post(fake.base_url + "/invocations", json=embed)
    direct = httpx.post(fake.base_url + "/v1/embeddings", json=embed)
    assert via.status_code == direct.status_code
    assert via.json().get("error") == direct.json().get("error")
    neither = httpx.post(fake.base_url + "/invocations", json={"text": "hi"})
    assert neither.status_code == 400 and "messages" in neither.json()["error"]["message"]


def test_generate_tokens_route_matches_transformers_greedy_tokens(real, folder):
    import torch
    from transformers import AutoModelForCausalLM

    prompt = [5, 17, 42, 99, 7]
    r = httpx.post(real.base_url + "/inference/v1/generate", json={
        "model": MODEL, "token_ids": prompt, "request_id": "gen-1",
        "sampling_params": {"temperature": 0, "max_tokens": 8, "ignore_eos": True,
                            "logprobs": 1, "detokenize": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"request_id", "choices", "prompt_logprobs", "kv_transfer_params"}
    assert body["request_id"] == "gen-1"
    (choice,) = body["choices"]
    assert (choice["index"], choice["finish_reason"]) == (0, "length")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                      dtype=torch.long), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert choice["token_ids"] == out[0, len(prompt):].tolist()
    assert len(choice["logprobs"]["content"]) == 8


@pytest.mark.parametrize(("body", "param"), [
    ({"token_ids": [], "sampling_params": {}}, "token_ids"),
    ({"token_ids": [1, "a"], "sampling_params": {}}, "token_ids"),
    ({"token_ids": [1], "sampling_params": {"best_of": 2}}, "sampling_params.best_of"),
    ({"token_ids": [1], "sampling_params": {"frobnicate": 1}}, "sampling_params.frobnicate"),
    ({"token_ids": [1], "sampling_params": {}, "stream": "maybe"}, "stream"),
    ({"token_ids": [1], "sampling_params": {}, "stream": True, "stream_options": 1},
     "stream_options"),
    # Without text there is nothing to match stop strings in (vLLM's 400).
    ({"token_ids": [1], "sampling_params": {"detokenize": False, "stop": ["x"]}},
     "sampling_params.stop"),
    ({"token_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"token_ids": [10**6], "sampling_params": {}}, "prompt"),
])
def test_generate_tokens_route_refuses_what_it_cannot_honour(fake, body, param):
    r = httpx.post(fake.base_url + "/inference/v1/generate", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# -- metrics under vLLM's names --------------------------------------------------------------

# The series vLLM's dashboard and its metric tests read (histograms by their base name).
VLLM_SERIES = (
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:num_requests_waiting_by_reason", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
    "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:iteration_tokens_total",
    "vllm:cache_config_info", "vllm:request_success", "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens", "vllm:request_params_n", "vllm:request_params_max_tokens",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
)


def _families(server):
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.base_url + "/metrics").text
    return text, {f.name: f for f in text_string_to_metric_families(text)}


def _sample(family, suffix, **labels):
    (value,) = [s.value for s in family.samples if s.name == family.name + suffix
                and all(s.labels.get(k) == v for k, v in labels.items())]
    return value


def test_metrics_under_vllms_names_with_the_request_params(real):
    from engine.api.metrics import METRIC_NAMES

    _, before = _families(real)
    with _client(real) as client:
        client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, n=2,
                                  temperature=1.0, seed=1)
    text, after = _families(real)
    for name in VLLM_SERIES:
        assert name in after, name
    # The engine's own series are all there, under the same prefix; none under engine:.
    for name in METRIC_NAMES:
        assert "\n" + name.replace("engine:", "vllm:", 1) in text, name
    assert "\nengine:" not in text and "# TYPE engine:" not in text
    params_n, max_tokens = after["vllm:request_params_n"], after["vllm:request_params_max_tokens"]
    assert _sample(params_n, "_count") == _sample(before["vllm:request_params_n"], "_count") + 1
    assert _sample(params_n, "_sum") == _sample(before["vllm:request_params_n"], "_sum") + 2
    assert _sample(max_tokens, "_sum") == \
        _sample(before["vllm:request_params_max_tokens"], "_sum") + 3
    waiting = after["vllm:num_requests_waiting_by_reason"]
    assert {s.labels["reason"] for s in waiting.samples} == {"capacity", "deferred"}
    assert _sample(waiting, "", reason="capacity") == _sample(
        after["vllm:num_requests_waiting"], "")


def test_iteration_tokens_count_the_token_a_prefill_samples_as_vllm(real):
    # vLLM counts an iteration's prompt tokens plus the tokens it gave out: a prefill
    # that samples is prompt + 1, each decode step 1, and nothing else is a step. (The
    # prompt is under one 16-token block: no prefix-cache hit makes it cheaper.)
    prompt, generated, requests = [5, 17, 42, 99, 7, 11, 13, 2, 8], 10, 3
    _, before = _families(real)
    with _client(real) as client:
        for _ in range(requests):
            done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=generated,
                                             temperature=0, extra_body={"ignore_eos": True})
            assert done.usage.completion_tokens == generated
    _, after = _families(real)

    def grew(suffix):
        name = "vllm:iteration_tokens_total"
        return _sample(after[name], suffix) - _sample(before[name], suffix)

    assert grew("_count") == requests * generated
    assert grew("_sum") == requests * (len(prompt) + generated)


# -- render -------------------------------------------------------------------------------


def test_chat_render_is_the_generate_request_the_chat_would_run(real, folder):
    from transformers import AutoTokenizer

    body = {"model": MODEL, "messages": ASK, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(real.base_url + "/v1/chat/completions/render", json=body,
                   headers={"X-Request-Id": "render-1"})
    assert r.status_code == 200, r.text
    rendered = r.json()
    assert set(rendered) >= {"request_id", "token_ids", "sampling_params", "model"}
    # The id the chat answer would carry, with vLLM's prefix.
    assert rendered["request_id"] == "chatcmpl-render-1"
    assert (rendered["stream"], rendered["stream_options"]) == (False, None)
    hf = AutoTokenizer.from_pretrained(folder)
    text = hf.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    assert rendered["token_ids"] == hf.encode(text, add_special_tokens=False)
    assert rendered["sampling_params"]["max_tokens"] == 6
    # Run it: the same tokens as the chat request itself.
    generated = httpx.post(real.base_url + "/inference/v1/generate", json=rendered).json()
    chat = httpx.post(real.base_url + "/v1/chat/completions",
                      json={**body, "return_token_ids": True}).json()
    assert generated["choices"][0]["token_ids"] == chat["choices"][0]["token_ids"]
    # A streamed chat renders as a streamed generate request, which runs as one.
    options = {"include_usage": True, "continuous_usage_stats": False}
    streamed = httpx.post(real.base_url + "/v1/chat/completions/render",
                          json={**body, "stream": True, "stream_options": options}).json()
    assert (streamed["stream"], streamed["stream_options"]) == (True, options)
    assert streamed["request_id"].startswith("chatcmpl-")
    events = httpx.post(real.base_url + "/inference/v1/generate", json=streamed).text
    chunks = [json.loads(e.removeprefix("data: ")) for e in events.split("\n\n")
              if e and e != "data: [DONE]"]
    assert [t for c in chunks[:-1] for t in c["choices"][0]["token_ids"]] == \
        chat["choices"][0]["token_ids"]
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_completions_render_gives_one_request_per_prompt(fake, folder):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    r = httpx.post(fake.base_url + "/v1/completions/render",
                   json={"model": MODEL, "prompt": ["The quick fox", "Hello"], "n": 2,
                         "stop": ["."], "seed": 3})
    assert r.status_code == 200, r.text
    first, second = r.json()
    assert first["token_ids"] == hf.encode("The quick fox")
    assert second["token_ids"] == hf.encode("Hello")
    assert first["request_id"] != second["request_id"]
    assert all(x["request_id"].startswith("cmpl-") and x["stream"] is False
               for x in (first, second))
    params = first["sampling_params"]
    # Completions' default max_tokens (16), and the request's own fields.
    assert (params["max_tokens"], params["n"], params["stop"], params["seed"]) == (16, 2, ["."], 3)
    ids = httpx.post(fake.base_url + "/v1/completions/render",
                     json={"model": MODEL, "prompt": [5, 6, 7]}).json()
    assert ids[0]["token_ids"] == [5, 6, 7]


def test_render_refuses_what_the_generate_request_cannot_carry(fake):
    r = httpx.post(fake.base_url + "/v1/chat/completions/render", json={
        "model": MODEL, "messages": ASK, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    bad = httpx.post(fake.base_url + "/v1/chat/completions/render",
                     json={"model": MODEL, "messages": ASK, "temperature": -1})
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "temperature")


# -- thinking_token_budget ----------------------------------------------------------------


@pytest.fixture(scope="module")
def thinker(folder):
    import engine.api

    settings = ChatSettings(reasoning_parser="deepseek_r1")
    with ServerThread(lambda: engine.api.open_engine(
            str(folder), served_model_name=MODEL, max_model_len=1024,
            kv_cache_memory=16 * 2**20), chat=settings) as srv:
        yield srv


def test_thinking_token_budget_forces_the_end_of_the_reasoning(thinker, folder):
    from chat_fixtures import marker_id

    end = marker_id(Tokenizer.from_folder(folder), "</think>")
    # The bias keeps the random model from closing its reasoning by itself; the budget's
    # mask (only </think> allowed) holds against it.
    body = {"model": MODEL, "messages": ASK, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "logit_bias": {str(end): -100}, "return_token_ids": True}
    free = httpx.post(thinker.base_url + "/v1/chat/completions", json=body).json()
    assert end not in free["choices"][0]["token_ids"]
    for budget in (5, 0):
        r = httpx.post(thinker.base_url + "/v1/chat/completions",
                       json={**body, "thinking_token_budget": budget})
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        ids = choice["token_ids"]
        assert ids.index(end) == budget, ids
        assert ids[:budget] == free["choices"][0]["token_ids"][:budget]
        # The reasoning parser sees the reasoning end there: the rest is content.
        assert choice["message"]["content"]
    # vLLM's extra_body form through the openai client, streamed.
    with _client(thinker) as client:
        stream = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=12, temperature=0, stream=True,
            extra_body={"thinking_token_budget": 3, "ignore_eos": True,
                        "logit_bias": {str(end): -100}})
        content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert content


def test_thinking_token_budget_needs_a_reasoning_parser(real):
    r = httpx.post(real.base_url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": ASK, "thinking_token_budget": 4})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "thinking_token_budget")


def test_the_forced_token_follows_the_markers():
    from engine.params import SamplingParams, thinking_forced_token

    # DeepSeek-R1 style: reasoning from the first token; a two-token end marker [8, 9].
    r1 = SamplingParams(thinking_token_budget=3, think_end_token_ids=(8, 9))
    assert [thinking_forced_token(r1, out) for out in ([], [1, 2], [1, 2, 3])] == [None, None, 8]
    assert thinking_forced_token(r1, [1, 2, 3, 8]) == 9  # the marker goes on
    assert thinking_forced_token(r1, [1, 2, 3, 8, 9]) is None  # ended
    assert thinking_forced_token(r1, [1, 8, 9, 4, 5, 6]) is None  # ended by the model
    # Qwen3 style: reasoning only after the start marker [7].
    q3 = SamplingParams(thinking_token_budget=2, think_start_token_ids=(7,),
                        think_end_token_ids=(9,))
    assert thinking_forced_token(q3, [1, 2, 3, 4]) is None  # it did not think
    assert thinking_forced_token(q3, [7, 1]) is None
    assert thinking_forced_token(q3, [7, 1, 2]) == 9


# -- a hybrid thinker with its thinking turned off ------------------------------------------


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """Qwen3's shape: a template that writes an empty <think></think> when enable_thinking
    is false, read by the qwen3 reasoning parser."""
    yield from _parser_server(tmp_path_factory.mktemp("hybrid") / "m", THINK_TEMPLATE, "qwen3")


def _parser_server(folder, template: str, parser: str):
    """A server over a marker model with ``template``, reading ``parser``'s reasoning;
    yields it and the folder."""
    folder = write_marker_model(folder, template)
    with ServerThread(lambda: engine.api.open_engine(
            str(folder), served_model_name=MODEL, max_model_len=1024,
            kv_cache_memory=16 * 2**20), chat=ChatSettings(reasoning_parser=parser)) as srv:
        yield srv, folder


def test_a_named_call_with_thinking_off_is_the_call_not_reasoning(hybrid):
    """enable_thinking: false closes the reasoning in the prompt: the named call's grammar
    starts at once (a bias toward <think> cannot open a reasoning block), the answer has
    no reasoning, and the call holds its arguments, which validate."""
    server, folder = hybrid
    think = marker_id(Tokenizer.from_folder(folder), "<think>")
    named = {"type": "function", "function": {"name": "get_time"}}
    with _client(server) as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[TIME_TOOL], tool_choice=named,
            max_completion_tokens=40, temperature=0, logit_bias={str(think): 100},
            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        (choice,) = reply.choices
        assert choice.message.model_extra["reasoning"] is None
        assert choice.finish_reason == "stop", choice  # a named call, as OpenAI and vLLM end it
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments),
                            TIME_TOOL["function"]["parameters"])
        # With thinking on, the reasoning parser still reads a <think> block first.
        thinking = client.chat.completions.create(
            model=MODEL, messages=ASK, max_completion_tokens=4, temperature=0,
            logit_bias={str(think): 100}, extra_body={"ignore_eos": True})
        assert thinking.choices[0].message.model_extra["reasoning"] is not None


def test_anthropic_thinking_budget_tokens_bounds_the_reasoning_as_the_chat_budget(thinker, folder):
    """Anthropic's thinking.budget_tokens is the chat route's thinking_token_budget: the
    reasoning ends within it, and the two routes give the same reasoning and text."""
    from chat_fixtures import marker_id

    end = marker_id(Tokenizer.from_folder(folder), "</think>")
    chat = httpx.post(thinker.base_url + "/v1/chat/completions", json={
        "model": MODEL, "messages": ASK, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "chat_template_kwargs": {"enable_thinking": True}, "thinking_token_budget": 3,
        "return_token_ids": True}).json()
    (choice,) = chat["choices"]
    assert choice["token_ids"].index(end) <= 3
    message = httpx.post(thinker.base_url + "/v1/messages", json={
        "model": MODEL, "messages": ASK, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "thinking": {"type": "enabled", "budget_tokens": 3}}).json()
    blocks = {b["type"]: b for b in message["content"]}
    assert blocks["thinking"]["thinking"] == choice["message"]["reasoning"]
    assert blocks["text"]["text"] == choice["message"]["content"]
    bad = httpx.post(thinker.base_url + "/v1/messages", json={
        "model": MODEL, "messages": ASK, "max_tokens": 12,
        "thinking": {"type": "enabled", "budget_tokens": 0}})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert "thinking.budget_tokens" in bad.json()["error"]["message"]


# -- Granite's reasoning: text markers, off unless the request turns it on -----------------

GRANITE_TEMPLATE = ("{% if thinking is defined and thinking %}Think, then answer. {% endif %}"
                    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                    "assistant:")


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    yield from _parser_server(tmp_path_factory.mktemp("granite") / "m", GRANITE_TEMPLATE, "granite")


def test_granite_thinking_is_its_templates_switch_and_refuses_a_token_budget(granite):
    """Anthropic's thinking turns Granite's own switch (``thinking``) on and off: the
    prompts are transformers' renderings with it. A thinking_token_budget is a 400: the
    reasoning ends in two spellings, which no token budget can watch for."""
    from transformers import AutoTokenizer

    server, folder = granite
    tok = AutoTokenizer.from_pretrained(str(folder))
    for kind, on in (("enabled", True), ("disabled", False)):
        counted = httpx.post(server.base_url + "/v1/messages/count_tokens", json={
            "model": MODEL, "messages": ASK, "thinking": {"type": kind}}).json()
        rendered = tok.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True,
                                           thinking=on)
        assert counted["input_tokens"] == len(tok.encode(rendered, add_special_tokens=False)), kind
    r = httpx.post(server.base_url + "/v1/chat/completions", json={
        "model": MODEL, "messages": ASK, "thinking_token_budget": 4,
        "chat_template_kwargs": {"thinking": True}})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "thinking_token_budget")
    assert "granite" in r.json()["error"]["message"]


# -- --default-chat-template-kwargs --------------------------------------------------------


def test_default_chat_template_kwargs_render_under_the_requests_own(tmp_path):
    """vLLM's --default-chat-template-kwargs: every chat renders with them unless the
    request sets the key itself; the prompts are transformers' renderings with the same
    kwargs."""
    from transformers import AutoTokenizer

    folder = write_marker_model(tmp_path / "m", THINK_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(str(folder))
    settings = ChatSettings(default_chat_template_kwargs={"enable_thinking": False})

    def rendered(**kwargs):
        return tok.apply_chat_template(ASK, tokenize=True, add_generation_prompt=True,
                                       return_dict=False, **kwargs)

    assert rendered(enable_thinking=False) != rendered(enable_thinking=True)
    with ServerThread(lambda: open_fake_engine(Tokenizer.from_folder(folder),
                                               served_model_name=MODEL, max_model_len=1024),
                      chat=settings) as srv:
        default = _tokenize(srv, messages=ASK).json()["tokens"]
        own = _tokenize(srv, messages=ASK,
                        chat_template_kwargs={"enable_thinking": True}).json()["tokens"]
        reply = httpx.post(srv.base_url + "/v1/chat/completions", json={
            "model": MODEL, "messages": ASK, "max_tokens": 1}).json()
    assert default == rendered(enable_thinking=False)
    assert own == rendered(enable_thinking=True)
    assert reply["usage"]["prompt_tokens"] == len(default)


def test_the_cli_reads_default_chat_template_kwargs_and_vllms_tool_exclusion_flag():
    from engine.cli import build_parser
    from engine.cli.serve import chat_settings

    def parse(*flags: str):
        return build_parser(["serve"]).parse_args(["serve", *flags])

    args = parse("--default-chat-template-kwargs", '{"enable_thinking": false}',
                 "--exclude-tools-when-tool-choice-none")
    assert chat_settings(args).default_chat_template_kwargs == {"enable_thinking": False}
    for bad in ("{", "[1]"):
        with pytest.raises(ValueError, match="default-chat-template-kwargs"):
            chat_settings(parse("--default-chat-template-kwargs", bad))


# -- several served model names -----------------------------------------------------------


def test_several_served_model_names_are_each_taken_and_answers_carry_the_first(folder):
    """vLLM's --served-model-name with several names: a request may send any of them;
    /v1/models lists each; answers name the first."""
    from engine.config import EngineConfig
    from engine.errors import ConfigError

    tokenizer = Tokenizer.from_folder(folder)
    with ServerThread(lambda: open_fake_engine(tokenizer, served_model_name=("tiny", "gpt-4o"),
                                               max_model_len=1024)) as srv:
        listed = [m["id"] for m in httpx.get(srv.base_url + "/v1/models").json()["data"]]
        reply = httpx.post(srv.base_url + "/v1/completions",
                           json={"model": "gpt-4o", "prompt": "hi", "max_tokens": 1})
        card = httpx.get(srv.base_url + "/v1/models/gpt-4o")
        unknown = httpx.post(srv.base_url + "/v1/completions",
                             json={"model": "gpt-5", "prompt": "hi", "max_tokens": 1})
    assert listed == ["tiny", "gpt-4o"]
    assert reply.status_code == 200 and reply.json()["model"] == "tiny"
    assert card.json()["id"] == "gpt-4o"
    assert unknown.status_code == 404
    from engine.cli import build_parser
    from engine.cli.args import config_from_args

    args = build_parser(["serve"]).parse_args(["serve", "--served-model-name", "a", "b"])
    assert config_from_args(args).served_model_name == ("a", "b")
    config = EngineConfig(served_model_name=["a", "b"])
    assert config.served_model_names == ("a", "b")
    assert EngineConfig.from_json(config.to_json()) == config  # as it crosses to a core
    assert EngineConfig(served_model_name=["a"]).served_model_name == "a"
    with pytest.raises(ConfigError) as info:
        EngineConfig(served_model_name=["a", "a"])
    assert info.value.field == "served_model_name"


def test_response_role_names_the_answers_role_as_vllms_flag(folder):
    tokenizer = Tokenizer.from_folder(folder)
    settings = ChatSettings(response_role="bot")
    with ServerThread(lambda: open_fake_engine(tokenizer, served_model_name=MODEL,
                                               max_model_len=1024), chat=settings) as srv:
        url = srv.base_url + "/v1/chat/completions"
        plain = httpx.post(url, json={"model": MODEL, "messages": ASK, "max_tokens": 2}).json()
        with _client(srv) as client:
            first = next(iter(client.chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=2, stream=True)))
        # No generation prompt: the answer continues the last message, in its role.
        continued = httpx.post(url, json={
            "model": MODEL, "max_tokens": 2, "add_generation_prompt": False,
            "continue_final_message": True,
            "messages": [*ASK, {"role": "assistant", "content": "It is"}]}).json()
    assert plain["choices"][0]["message"]["role"] == "bot"
    assert first.choices[0].delta.role == "bot"
    assert continued["choices"][0]["message"]["role"] == "assistant"
    with pytest.raises(ValueError, match="response-role"):
        ChatSettings(response_role="")
