"""Tool definitions, tool_choice, history messages, the fallback prompt and forced calls."""

from __future__ import annotations

import itertools
import json

import jsonschema
import pytest

from engine.chat.tools import (
    ForcedCallStreamer,
    Tool,
    ToolChoice,
    check_tool_fields,
    fallback_messages,
    forced_call_schema,
    parse_tool_choice,
    parse_tools,
    template_reads_tools,
)
from engine.errors import InvalidParamError
from engine.models.testing import CHATML_TEMPLATE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}}}}


def test_tools_parse_to_typed_values() -> None:
    tools = parse_tools([WEATHER, TIME])
    assert [t.name for t in tools] == ["get_weather", "get_time"]
    assert tools[0].to_openai() == WEATHER
    assert parse_tools([{"type": "function", "function": {"name": "noop"}}])[0].parameters \
        == {"type": "object", "properties": {}}


@pytest.mark.parametrize(("tools", "param"), [
    ({"a": 1}, "tools"),
    ([{"type": "retrieval"}], "tools[0].type"),
    ([{"type": "function"}], "tools[0].function"),
    ([WEATHER, {"type": "function", "function": {"name": "bad name"}}], "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": 5}}}}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     "tools[0].function.parameters"),
    ([WEATHER, WEATHER], "tools"),
])
def test_bad_tools_name_the_field(tools: object, param: str) -> None:
    with pytest.raises(InvalidParamError) as info:
        parse_tools(tools)
    assert info.value.param == param


def test_tool_choice() -> None:
    tools = parse_tools([WEATHER, TIME])
    assert parse_tool_choice(None, tools) == ToolChoice("auto")
    assert parse_tool_choice(None, ()) == ToolChoice("none")
    assert parse_tool_choice("required", tools) == ToolChoice("required")
    named = {"type": "function", "function": {"name": "get_time"}}
    assert parse_tool_choice(named, tools) == ToolChoice("function", "get_time")
    for bad in ("sometimes", {"type": "function", "function": {"name": "nope"}}, 3):
        with pytest.raises(InvalidParamError) as info:
            parse_tool_choice(bad, tools)
        assert info.value.param == "tool_choice"
    with pytest.raises(InvalidParamError, match="needs a non-empty tools"):
        parse_tool_choice("required", ())


def test_history_tool_fields() -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    fields = check_tool_fields({"role": "assistant", "content": None, "tool_calls": [call]},
                               "messages[1]")
    assert fields["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert check_tool_fields({"role": "tool", "tool_call_id": "call_1", "content": "9C"},
                             "messages[2]") == {"tool_call_id": "call_1"}
    for message, param in [
        ({"role": "tool", "content": "9C"}, "messages[2].tool_call_id"),
        ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]},
         "messages[2].tool_calls[0].function.arguments"),
        ({"role": "user", "tool_calls": []}, "messages[2].tool_calls"),
    ]:
        with pytest.raises(InvalidParamError) as info:
            check_tool_fields(message, "messages[2]")
        assert info.value.param == param


def test_template_reads_tools() -> None:
    assert not template_reads_tools(CHATML_TEMPLATE)
    assert template_reads_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_reads_tools(None)


def test_fallback_messages() -> None:
    tools = parse_tools([WEATHER])
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "9C"},
    ]
    out = fallback_messages(history, tools, describe_tools=True)
    assert out[0]["role"] == "system" and json.dumps(WEATHER["function"]) in out[0]["content"]
    assert out[2] == {"role": "assistant", "content":
                      '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
                      "</tool_call>"}
    assert out[3] == {"role": "user", "content": "<tool_response>\n9C\n</tool_response>"}
    merged = fallback_messages([{"role": "system", "content": "Be brief."}, history[0]], tools,
                               describe_tools=True)
    assert len(merged) == 2 and merged[0]["content"].startswith("Be brief.\n\nYou can call")
    assert fallback_messages(history[:1], tools, describe_tools=False) == history[:1]


def _ids():  # noqa: ANN202
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def test_forced_schemas_accept_calls_and_refuse_others() -> None:
    tools = parse_tools([WEATHER, TIME])
    named = forced_call_schema(tools, ToolChoice("function", "get_weather"), parallel=True)
    jsonschema.validate({"city": "Paris"}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({}, named)
    one = forced_call_schema(tools, ToolChoice("required"), parallel=False)
    many = forced_call_schema(tools, ToolChoice("required"), parallel=True)
    calls = [{"name": "get_weather", "arguments": {"city": "Paris"}},
             {"name": "get_time", "arguments": {"tz": "UTC"}}]
    jsonschema.validate(calls[:1], one)
    jsonschema.validate(calls, many)
    for bad, schema in [(calls, one), ([], many), ([{"name": "get_time", "arguments":
                                                     {"tz": "PST"}}], many)]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert forced_call_schema(tools, ToolChoice("auto"), parallel=True) is None


@pytest.mark.parametrize("choice", [ToolChoice("required"), ToolChoice("function", "get_time")])
def test_forced_call_streamer_assembles_at_every_split(choice: ToolChoice) -> None:
    text = ('[{"name": "get_weather", "arguments": {"city": "P}a[ris"}}, '
            '{"name": "get_time", "arguments": {"tz": "UTC"}}]'
            if choice.mode == "required" else '{"tz": "UTC"}')
    whole = ForcedCallStreamer(choice, _ids())
    whole.feed(text)
    whole.finish()
    expected = [(c.name, c.arguments) for c in whole.result().tool_calls]
    if choice.mode == "required":
        assert expected == [("get_weather", '{"city": "P}a[ris"}'), ("get_time", '{"tz": "UTC"}')]
    else:
        assert expected == [("get_time", text)]
    for k in range(len(text) + 1):
        streamer = ForcedCallStreamer(choice, _ids())
        deltas = [*streamer.feed(text[:k]).tool_calls, *streamer.feed(text[k:]).tool_calls,
                  *streamer.finish().tool_calls]
        calls: dict[int, list[str]] = {}
        for d in deltas:
            entry = calls.setdefault(d.index, ["", ""])
            if d.name:
                entry[0] = d.name
            entry[1] += d.arguments
        assert [tuple(calls[i]) for i in sorted(calls)] == expected


def test_tool_value_is_typed() -> None:
    tool = Tool("f", {"type": "object"}, "does f")
    assert tool.to_openai()["function"]["description"] == "does f"


# -- a choice's output read as a message ---------------------------------------------------

from engine.chat.output import ChatOutputOptions, ChatOutputParser  # noqa: E402
from engine.chat.reasoning import get_reasoning_parser  # noqa: E402
from engine.chat.tool_parsers import TOOL_PARSERS, get_tool_parser  # noqa: E402


def _read(options: ChatOutputOptions, pieces: list[str]) -> tuple[dict, dict]:  # type: ignore[type-arg]
    parser = ChatOutputParser(options)
    streamed: dict = {"reasoning": "", "content": "", "calls": {}}  # type: ignore[type-arg]
    for delta in [*(parser.feed(p) for p in pieces), parser.finish()]:
        streamed["reasoning"] += delta.reasoning
        streamed["content"] += delta.content
        for d in delta.tool_calls:
            call = streamed["calls"].setdefault(d.index, {"name": "", "arguments": ""})
            call["name"] += d.name or ""
            call["arguments"] += d.arguments
    return streamed, parser.message().to_openai()


def test_reasoning_then_auto_call_streamed_equals_complete() -> None:
    tools = parse_tools([WEATHER])
    options = ChatOutputOptions(tools=tools, tool_choice=ToolChoice("auto"),
                                tool_parser=get_tool_parser("hermes"),
                                reasoning_parser=get_reasoning_parser("qwen3"))
    text = ('<think>Paris, so call it.</think>\n\nOne moment.\n<tool_call>{"name": '
            '"get_weather", "arguments": {"city": "Paris"}}</tool_call>')
    for k in range(len(text) + 1):
        streamed, message = _read(options, [text[:k], text[k:]])
        assert message["reasoning_content"] == streamed["reasoning"] == "Paris, so call it."
        assert message["content"] == streamed["content"] == "\n\nOne moment."
        assert [c["function"] for c in message["tool_calls"]] == [
            {"name": "get_weather", "arguments": '{"city": "Paris"}'}] == list(
            streamed["calls"].values())
    parser = ChatOutputParser(options)
    parser.feed(text)
    parser.finish()
    assert parser.finish_reason("stop") == "tool_calls"
    assert parser.finish_reason("length") == "length"


def test_tool_choice_none_passes_text_through() -> None:
    options = ChatOutputOptions(tools=parse_tools([WEATHER]), tool_choice=ToolChoice("none"),
                                tool_parser=get_tool_parser("hermes"))
    text = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    streamed, message = _read(options, list(text))
    assert message == {"role": "assistant", "content": text} and streamed["content"] == text
    assert not options.parses


def test_auto_structural_tag_frees_text_and_constrains_calls(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """xgrammar (the backend that enforces it) accepts valid calls after free text and
    refuses a call to an unknown function or with arguments off the schema."""
    xgr = pytest.importorskip("xgrammar")
    from tokenizers import Tokenizer as HFTokenizer

    from engine.chat.tools import auto_structural_tag
    from engine.models.testing import write_tiny_model

    folder = write_tiny_model(tmp_path / "m", "qwen2")
    backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    vocab = [backend.id_to_token(i) for i in range(backend.get_vocab_size())]
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.BYTE_LEVEL))
    tools = parse_tools([WEATHER, TIME])
    compiled = compiler.compile_structural_tag(json.dumps(auto_structural_tag(tools, "hermes")))

    def accepts(text: str) -> bool:
        return bool(xgr.GrammarMatcher(compiled).accept_string(text))

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert accepts("Let me check. " + call + " and then some text")
    assert accepts("no call at all")
    assert not accepts('<tool_call>\n{"name": "get_pizza", "arguments": {}}')
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {"town": "x"}}')
    assert not accepts('<tool_call>\n{"name": "get_time", "arguments": {"tz": "PST"}}')
    assert auto_structural_tag(tools, "pythonic") is None  # parsed, not constrained


def test_qwen3_coder_calls_through_the_chat_output_are_typed_by_the_request_tools() -> None:
    """The chat layer hands the request's tools to a parser that reads them: a value
    declared as an integer comes back as one (and a string one stays a string)."""
    tools = parse_tools([{"type": "function", "function": {"name": "wait", "parameters": {
        "type": "object", "properties": {"seconds": {"type": "integer"},
                                         "why": {"type": "string"}}}}}])
    options = ChatOutputOptions(tools=tools, tool_choice=ToolChoice("auto"),
                                tool_parser=get_tool_parser("qwen3_coder"))
    text = ("<tool_call>\n<function=wait>\n<parameter=seconds>\n5\n</parameter>\n"
            "<parameter=why>\n10\n</parameter>\n</function>\n</tool_call>")
    streamed, message = _read(options, [text[:40], text[40:]])
    (call,) = message["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"seconds": 5, "why": "10"}
    assert list(streamed["calls"].values()) == [call["function"]]


# Which parsers' calls a grammar can hold (auto once opened, required from the start):
# the others are parsed only, and a forced call with them is a JSON list.
CONSTRAINED = {"hermes", "granite4", "internlm", "llama3_json", "mistral"}


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_which_parsers_are_constrained(name: str) -> None:
    from engine.chat.tools import auto_structural_tag, required_structural_tag

    tools = parse_tools([WEATHER])
    assert (auto_structural_tag(tools, name) is not None) == (name in CONSTRAINED)
    if name == "granite4":  # hermes' syntax
        assert required_structural_tag(tools, name) == required_structural_tag(tools, "hermes")
        assert auto_structural_tag(tools, name) == auto_structural_tag(tools, "hermes")


def test_a_required_call_in_special_token_markers_keeps_them_in_the_text() -> None:
    """granite4's <tool_call> is a special token: a required call written in its syntax
    is decoded with special tokens kept, or the parser would never see the markers."""
    from engine.chat.request import ChatSettings, chat_sampling_params, parse_chat_fields
    from engine.params import SamplingParams

    settings = ChatSettings(tool_call_parser="granite4", enable_auto_tool_choice=True)
    for choice in ("required", "auto"):
        fields = parse_chat_fields({"tools": [WEATHER], "tool_choice": choice}, settings,
                                   "{{ tools }}")
        params = chat_sampling_params(SamplingParams(max_tokens=8), fields)
        assert params.skip_special_tokens is False, choice
        assert fields.output.forced_in_parser_syntax == (choice == "required")


@pytest.mark.parametrize("name", sorted(CONSTRAINED))
def test_auto_calls_with_a_stop_string_are_read_from_free_text(name: str) -> None:
    """``auto`` with ``stop`` (issue 28): no call grammar, so no parser streams a call as
    it is written that a stop string could then end mid-way; without ``stop`` the calls
    are constrained as before. Forced calls with ``stop`` are refused, naming it."""
    from engine.chat.request import (
        ChatSettings,
        calls_constrained,
        chat_sampling_params,
        parse_chat_fields,
    )
    from engine.errors import InvalidParamError
    from engine.params import SamplingParams

    settings = ChatSettings(tool_call_parser=name, enable_auto_tool_choice=True)
    fields = parse_chat_fields({"tools": [WEATHER], "tool_choice": "auto"}, settings,
                               "{{ tools }}")
    free = chat_sampling_params(SamplingParams(max_tokens=8, stop=["\n"]), fields)
    assert free.structured_outputs is None and not calls_constrained(fields, free)
    held = chat_sampling_params(SamplingParams(max_tokens=8), fields)
    assert held.structured_outputs is not None and calls_constrained(fields, held)
    for choice in ("required", {"type": "function", "function": {"name": WEATHER["function"]["name"]}}):
        forced = parse_chat_fields({"tools": [WEATHER], "tool_choice": choice}, settings,
                                   "{{ tools }}")
        with pytest.raises(InvalidParamError) as info:
            chat_sampling_params(SamplingParams(max_tokens=8, stop=['"']), forced)
        assert info.value.param == "stop"
