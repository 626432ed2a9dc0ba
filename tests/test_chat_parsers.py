"""Tool-call and reasoning parsers on outputs written the way each model family writes them.

Every case is checked complete and streamed: split in two at every character boundary and
fed one character at a time, the streamed deltas must assemble (as the openai client's
stream helper assembles them) to exactly the complete parse.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.chat.reasoning import REASONING_PARSERS, get_reasoning_parser
from engine.chat.tool_parsers import TOOL_PARSERS, ToolCallDelta, get_tool_parser
from engine.chat.tools import parse_tools

WEATHER = {"city": "Paris", "unit": "celsius"}
NESTED = {"q": "a } tricky ] \"string\" {", "filters": [{"k": 1}, {"k": [2, 3]}], "x": None}


def _kwargs(args: dict[str, Any]) -> str:
    """``args`` as Python keyword arguments, each value in Python's own repr."""
    return ", ".join(f"{k}={v!r}" for k, v in args.items())


# (parser, model text, expected content, expected [(name, arguments object)])
CASES: list[tuple[str, str, str | None, list[tuple[str, dict[str, Any]]]]] = [
    # hermes: Qwen2.5 / Qwen3 / Hermes write one <tool_call> block per call.
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "celsius"}}\n</tool_call>', None, [("get_weather", WEATHER)]),
    ("hermes", 'I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "search", '
     f'"arguments": {json.dumps(NESTED)}}}\n</tool_call>',
     "I will look both up.", [("get_weather", WEATHER), ("search", NESTED)]),
    ("hermes", "The answer is 4 < 5, no tools needed.", "The answer is 4 < 5, no tools needed.",
     []),
    # Broken JSON inside the tags, a missing name: content, never a call.
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', []),
    ("hermes", 'ok <tool_call>{"arguments": {}}</tool_call>',
     'ok <tool_call>{"arguments": {}}</tool_call>', []),
    # Stopped by EOS before the closing tag: a complete call is still a call...
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "celsius"}}', None, [("get_weather", WEATHER)]),
    # ...a truncated one is content.
    ("hermes", '<tool_call>\n{"name": "get_weather", "argu', '<tool_call>\n{"name": '
     '"get_weather", "argu', []),
    ("hermes", "text then <tool_ca", "text then <tool_ca", []),
    # A closing tag inside a JSON string of the arguments does not close the call (a
    # schema-constrained string may hold any text).
    ("hermes", '<tool_call>{"name": "note", "arguments": {"text": "</tool_call>"}}'
     "</tool_call> after", "after", [("note", {"text": "</tool_call>"})]),
    # llama3_json: Llama 3.1-3.3 write bare JSON, calls joined by ";".
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
     '"celsius"}}', None, [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
     f'"unit": "celsius"}}}}; {{"name": "search", "parameters": {json.dumps(NESTED)}}}',
     None, [("get_weather", WEATHER), ("search", NESTED)]),
    ("llama3_json", "Paris is sunny today.", "Paris is sunny today.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par',
     '{"name": "get_weather", "parameters": {"city": "Par', []),
    ("llama3_json", '<|python_tag|>{"city": "Paris"}', '<|python_tag|>{"city": "Paris"}', []),
    ("llama3_json", "{braces} in prose", "{braces} in prose", []),
    # mistral: v0.3 writes a JSON list after [TOOL_CALLS]; v11+ tokenizers name[ARGS]{...}.
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
     f'"unit": "celsius"}}}}, {{"name": "search", "arguments": {json.dumps(NESTED)}}}]',
     None, [("get_weather", WEATHER), ("search", NESTED)]),
    ("mistral", 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
     f'[TOOL_CALLS]search[ARGS]{json.dumps(NESTED)}', "Checking.",
     [("get_weather", WEATHER), ("search", NESTED)]),
    ("mistral", "[TOOL_CALLS]not a call!", "[TOOL_CALLS]not a call!", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": 5}]',
     '[TOOL_CALLS][{"name": "get_weather", "arguments": 5}]', []),
    ("mistral", "A list [1, 2] is fine.", "A list [1, 2] is fine.", []),
    # glm45: the name on the block's first line, key/value pairs typed by the schema.
    ("glm45", "Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
     "<arg_key>unit</arg_key>\n<arg_value>celsius</arg_value>\n</tool_call>", "Let me check.",
     [("get_weather", WEATHER)]),
    ("glm45", "<tool_call>set_alarm\n<arg_key>hour</arg_key>\n<arg_value>7</arg_value>\n<arg_key>loud</arg_key>\n"
     "<arg_value>true</arg_value>\n<arg_key>tags</arg_key>\n<arg_value>[\"a\", \"b\"]</arg_value>\n</tool_call>"
     "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>unit</arg_key>\n"
     "<arg_value>celsius</arg_value>\n</tool_call>", None,
     [("set_alarm", {"hour": 7, "loud": True, "tags": ["a", "b"]}), ("get_weather", WEATHER)]),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par",
     "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par", []),
    ("glm45", "No calls here.", "No calls here.", []),
    # deepseek_v31: the frames hold the name, the separator, then the JSON arguments.
    ("deepseek_v31", "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
     '{"city": "Paris", "unit": "celsius"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>'
     f"{json.dumps(NESTED)}<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "Checking.",
     [("get_weather", WEATHER), ("search", NESTED)]),
    ("deepseek_v31", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Par',
     '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Par', []),
    ("deepseek_v31", "No calls here.", "No calls here.", []),
    # kimi_k2: calls in one section, each with the model's own id (kept as the call's).
    ("kimi_k2", "Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     '<|tool_call_argument_begin|>{"city": "Paris", "unit": "celsius"}<|tool_call_end|><|tool_call_begin|>'
     f"functions.search:1<|tool_call_argument_begin|>{json.dumps(NESTED)}<|tool_call_end|><|tool_calls_section_end|>",
     "Let me check.", [("get_weather", WEATHER), ("search", NESTED)]),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
     '{"city": "Par', "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     '<|tool_call_argument_begin|>{"city": "Par', []),
    ("kimi_k2", "No calls here.", "No calls here.", []),
    # openai (harmony): the recipient after the channel or before it; a preamble to the
    # user is content; <|call|> (a stop token) ends a call when the text has it.
    ("openai", '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
     '{"city": "Paris", "unit": "celsius"}', None, [("get_weather", WEATHER)]),
    ("openai", '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
     '{"city": "Paris", "unit": "celsius"}<|call|>', None, [("get_weather", WEATHER)]),
    ("openai", '<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Paris", "unit": "celsius"}',
     None, [("get_weather", WEATHER)]),
    ("openai", '<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant '
     'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris", "unit": "celsius"}',
     "Checking.", [("get_weather", WEATHER)]),
    ("openai", "Paris is sunny today.", "Paris is sunny today.", []),
    ("openai", '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Par',
     '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Par', []),
    # pythonic: Llama 3.2 / Llama 4 / ToolACE write a Python list of calls.
    ("pythonic", '[get_weather(city="Paris", unit=\'celsius\')]', None,
     [("get_weather", WEATHER)]),
    ("pythonic", '<|python_start|>[get_weather(city="Paris", unit="celsius"), '
     'search(q="a } tricky ] \\"string\\" {", filters=[{"k": 1}, {"k": [2, 3]}], x=None)]'
     "<|python_end|>", None, [("get_weather", WEATHER), ("search", NESTED)]),
    ("pythonic", "[1, 2, 3]", "[1, 2, 3]", []),
    ("pythonic", "[get_weather(city=open('x'))]", "[get_weather(city=open('x'))]", []),
    ("pythonic", '[get_weather(city="Par', '[get_weather(city="Par', []),
    ("pythonic", "No call here.", "No call here.", []),
    # granite: Granite 3.0 opens the output with <|tool_call|>, 3.1+ with <tool_call>, and
    # writes a JSON list; text after the list is content.
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", '
     f'"unit": "celsius"}}}}, {{"name": "search", "arguments": {json.dumps(NESTED)}}}]',
     None, [("get_weather", WEATHER), ("search", NESTED)]),
    ("granite", ' <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "celsius"}}] Done.', "Done.", [("get_weather", WEATHER)]),
    ("granite", "Paris is sunny [today].", "Paris is sunny [today].", []),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": "nope"}]',
     '<|tool_call|>[{"name": "get_weather", "arguments": "nope"}]', []),
    ("granite", '<tool_call>[{"name": "get_weather", "arg', '<tool_call>[{"name": '
     '"get_weather", "arg', []),
    ("granite", "<|tool_call|>", "<|tool_call|>", []),
    # phi4_mini_json: Phi-4-mini opens the output with "functools" and a JSON list.
    ("phi4_mini_json", 'functools[{"name": "get_weather", "arguments": {"city": "Paris", '
     f'"unit": "celsius"}}}}, {{"name": "search", "parameters": {json.dumps(NESTED)}}}]',
     None, [("get_weather", WEATHER), ("search", NESTED)]),
    ("phi4_mini_json", "The functools module is in the standard library.",
     "The functools module is in the standard library.", []),
    ("phi4_mini_json", 'functools[{"name": "get_weather", "arguments": [1]}]',
     'functools[{"name": "get_weather", "arguments": [1]}]', []),
    ("phi4_mini_json", 'functools[{"name": "get_weather", "argu', 'functools[{"name": "get_weather", "argu', []),
    # olmo3: a <function_calls> block of Python calls, one a line (Python's own repr of
    # the values, and JSON's literals, which OLMo 3 also writes).
    ("olmo3", f"<function_calls>\nget_weather({_kwargs(WEATHER)})\nsearch({_kwargs(NESTED)})\n"
     "</function_calls>", None, [("get_weather", WEATHER), ("search", NESTED)]),
    ("olmo3", "<function_calls>set_alarm(on=true, label=null, days=[1, 2])</function_calls>"
     " Done.", "Done.", [("set_alarm", {"on": True, "label": None, "days": [1, 2]})]),
    ("olmo3", "I would call get_weather(city='Paris').", "I would call get_weather(city='Paris').",
     []),
    ("olmo3", "<function_calls>\nget_weather(city=Paris)\n</function_calls>",
     "<function_calls>\nget_weather(city=Paris)\n</function_calls>", []),
    ("olmo3", "<function_calls>\nget_weather(city='Par", "<function_calls>\nget_weather(city='Par",
     []),
    # granite4: hermes' blocks, with Granite 4's layout.
    ("granite4", 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": '
     '"Paris", "unit": "celsius"}}\n</tool_call>', "Checking.", [("get_weather", WEATHER)]),
    ("granite4", '<tool_call>{"name": "get_weather"}</tool_call><tool_call>{"name": "search",'
     f' "arguments": {json.dumps(NESTED)}}}</tool_call>', None,
     [("get_weather", {}), ("search", NESTED)]),
    ("granite4", '<tool_call>{"name": get_weather}</tool_call>',
     '<tool_call>{"name": get_weather}</tool_call>', []),
    # internlm: InternLM 2.5 writes one action block per call, "parameters" its arguments.
    ("internlm", 'Let me check.<|action_start|><|plugin|>\n{"name": "get_weather", '
     '"parameters": {"city": "Paris", "unit": "celsius"}}<|action_end|>', "Let me check.",
     [("get_weather", WEATHER)]),
    ("internlm", '<|action_start|><|plugin|>{"name": "search", "arguments": '
     f'{json.dumps(NESTED)}}}<|action_end|>\n<|action_start|><|plugin|>{{"name": '
     '"get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None,
     [("search", NESTED), ("get_weather", WEATHER)]),
    ("internlm", '<|action_start|><|plugin|>{"name": "x", "parameters": [1]}<|action_end|>',
     '<|action_start|><|plugin|>{"name": "x", "parameters": [1]}<|action_end|>', []),
    ("internlm", '<|action_start|><|interpreter|>print(1)<|action_end|>',
     '<|action_start|><|interpreter|>print(1)<|action_end|>', []),
    ("internlm", "stop at <|action_start|><|plu", "stop at <|action_start|><|plu", []),
    # qwen3_coder: XML-like, values typed by the tool's schema (TYPED below).
    ("qwen3_coder", "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
     "Paris\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n"
     "</tool_call>", "I'll check.", [("get_weather", WEATHER)]),
    ("qwen3_coder", "<tool_call>\n<function=set_alarm>\n<parameter=hour>\n7\n</parameter>\n"
     "<parameter=loud>\nTrue\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
     "<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n<parameter=opts>\n{'k': [1, 2]}\n"
     "</parameter>\n<parameter=note>\nnull\n</parameter>\n<parameter=label>\n 42 \n"
     "</parameter>\n<parameter=extra>\n3\n</parameter>\n</function>\n</tool_call>\n"
     "<tool_call>\n<function=set_alarm>\n<parameter=hour>\nseven\n</parameter>\n"
     "<parameter=note>\n</tool_call> is text\n</parameter>\n</function>\n</tool_call>",
     None, [("set_alarm", {"hour": 7, "loud": True, "ratio": 0.5, "tags": ["a", "b"],
                           "opts": {"k": [1, 2]}, "note": None, "label": " 42 ",
                           "extra": "3"}),
            ("set_alarm", {"hour": "seven", "note": "</tool_call> is text"})]),
    # Stopped by EOS after </function>: still a call.
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
     "</parameter>\n</function>", None, [("get_weather", {"city": "Paris"})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", []),
    ("qwen3_coder", "<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call> ok",
     "<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call> ok", []),
    ("qwen3_coder", "4 < 5 and <function=x> alone is text.",
     "4 < 5 and <function=x> alone is text.", []),
    # deepseek_v3: a section of fenced JSON calls between special tokens.
    ("deepseek_v3", "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
     'get_weather\n```json\n{"city": "Paris", "unit": "celsius"}\n```<｜tool▁call▁end｜>\n'
     "<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n"
     f"{json.dumps(NESTED)}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "Checking.",
     [("get_weather", WEATHER), ("search", NESTED)]),
    # Stopped by EOS after a call's end, before the section's.
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
     'get_weather\n```json\n{"city": "Paris", "unit": "celsius"}\n```<｜tool▁call▁end｜>',
     None, [("get_weather", WEATHER)]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
     'get_weather\n```json\n{"city": \n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
     'get_weather\n```json\n{"city": \n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', []),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_wea",
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_wea", []),
    ("deepseek_v3", "No ```json\n{}\n``` call here.", "No ```json\n{}\n``` call here.", []),
]

# The tools the parsers are given (qwen3_coder types its values by these schemas).
TYPED = parse_tools([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": {
        "type": "object", "properties": {
            "hour": {"type": "integer"}, "loud": {"type": "boolean"},
            "ratio": {"type": "number"}, "tags": {"type": "array"},
            "opts": {"type": "object"}, "label": {"type": "string"},
            "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}}},
])


def _ids() -> Any:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _assemble(deltas: list[ToolCallDelta]) -> list[dict[str, str]]:
    """What the openai client's stream helper builds from delta.tool_calls."""
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
        if d.id is not None:
            assert not call["id"], "id sent twice"
            call["id"] = d.id
        if d.name is not None:
            assert not call["name"], "name sent twice"
            call["name"] = d.name
        assert call["id"] and call["name"], "arguments before the call's id and name"
        call["arguments"] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)]


def _stream(parser: str, pieces: list[str]) -> tuple[str | None, list[dict[str, str]]]:
    streamer = get_tool_parser(parser).streamer(_ids(), tools=TYPED)
    content, deltas = "", []
    for delta in [*(streamer.feed(p) for p in pieces), streamer.finish()]:
        content += delta.content
        deltas.extend(delta.tool_calls)
    return content or None, _assemble(deltas)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_tool_parser_complete_and_streamed(
    parser: str, text: str, content: str | None, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    parsed = get_tool_parser(parser).parse(text, _ids(), tools=TYPED)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    # Kimi K2 writes each call's id (functions.NAME:INDEX); the others' are made here.
    assert [c.id for c in parsed.tool_calls] == [
        f"functions.{name}:{i}" if parser == "kimi_k2" else f"call_{i}" for i, (name, _) in enumerate(calls)]
    expected = [c.to_openai()["function"] | {"id": c.id} for c in parsed.tool_calls]
    splits = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        got_content, got_calls = _stream(parser, pieces)
        assert got_content == content, pieces
        assert got_calls == expected, pieces


def test_every_parser_has_a_case() -> None:
    assert {case[0] for case in CASES} == set(TOOL_PARSERS)


def test_streamed_call_is_sent_once_complete() -> None:
    streamer = get_tool_parser("hermes").streamer(_ids())
    assert streamer.feed("Sure. ").content == "Sure."
    assert not streamer.feed('<tool_call>{"name": "f", "arguments": {"a"')
    delta = streamer.feed(": 1}}</tool_call>")
    assert [d.to_openai() for d in delta.tool_calls] == [
        {"index": 0, "id": "call_0", "type": "function",
         "function": {"name": "f", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"a": 1}'}},
    ]


# hermes under the tools' grammar (streamer(constrained=True)): the grammar writes
# '<tool_call>' + up to two spaces/newlines + '{"name": "NAME", "arguments": ' + the
# arguments + '}' + whitespace + '</tool_call>'. (text, content, [(name, arguments text)])
PARIS_TEXT = '{"city": "Paris", "unit": "celsius"}'
TRICKY_TEXT = '{"q": "a } tricky ] \\"string\\" { </tool_call>", "filters": [{"k": [2, 3]}]}'
CONSTRAINED_CASES: list[tuple[str, str | None, list[tuple[str, str]]]] = [
    (f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS_TEXT}}}\n</tool_call>',
     None, [("get_weather", PARIS_TEXT)]),
    # Text before, two calls with the forced list's separator, text after.
    (f'Both.\n<tool_call>{{"name": "get_weather", "arguments": {PARIS_TEXT}}}</tool_call>\n'
     f'<tool_call> {{"name": "search", "arguments": {TRICKY_TEXT}}} </tool_call>\nDone.',
     "Both.Done.", [("get_weather", PARIS_TEXT), ("search", TRICKY_TEXT)]),
    # Cut short by max_tokens inside the arguments: the call keeps what was written.
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', None,
     [("get_weather", '{"city": "Pa')]),
    ('<tool_call>{"name": "get_weather", "arguments": ', None, [("get_weather", "")]),
    # ...and before the name was complete: no call was sent, the text is content.
    ('<tool_call>\n{"name": "get_wea', '<tool_call>\n{"name": "get_wea', []),
    # Stopped right after the arguments, or after their closing brace.
    (f'<tool_call>{{"name": "f", "arguments": {PARIS_TEXT}', None, [("f", PARIS_TEXT)]),
    (f'<tool_call>{{"name": "f", "arguments": {PARIS_TEXT}}}\n', None, [("f", PARIS_TEXT)]),
    # An opening the grammar does not write is parsed whole, as unconstrained hermes does.
    ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', None, [("f", '{"a": 1}')]),
    ('<tool_call>{"name": "f", "args": {}</tool_call>',
     '<tool_call>{"name": "f", "args": {}</tool_call>', []),
    # Not the grammar's tail after the arguments: the call stands, the rest is content.
    (f'<tool_call>{{"name": "f", "arguments": {PARIS_TEXT}}} and more', "and more",
     [("f", PARIS_TEXT)]),
    ("No call, 4 < 5.", "No call, 4 < 5.", []),
]


@pytest.mark.parametrize("name", ["hermes", "granite4"])
@pytest.mark.parametrize(("text", "content", "calls"), CONSTRAINED_CASES)
def test_constrained_hermes_streams_calls_as_written(
    text: str, content: str | None, calls: list[tuple[str, str]], name: str
) -> None:
    parser = get_tool_parser(name)
    parsed = parser.parse(text, _ids(), constrained=True)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls
    expected = [c.to_openai()["function"] | {"id": c.id} for c in parsed.tool_calls]
    for pieces in [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]:
        streamer = parser.streamer(_ids(), constrained=True)
        got, deltas = "", []
        for delta in [*(streamer.feed(p) for p in pieces), streamer.finish()]:
            got += delta.content
            deltas.extend(delta.tool_calls)
        assert (got or None, _assemble(deltas)) == (content, expected), pieces
        assert streamer.result() == parsed, pieces


def test_constrained_call_sends_arguments_as_they_arrive() -> None:
    streamer = get_tool_parser("hermes").streamer(_ids(), constrained=True)
    assert streamer.feed("Sure. ").content == "Sure."
    assert not streamer.feed('<tool_call>\n{"name": "get_wea')
    head = streamer.feed('ther", "arguments": ')
    assert [d.to_openai() for d in head.tool_calls] == [
        {"index": 0, "id": "call_0", "type": "function",
         "function": {"name": "get_weather", "arguments": ""}}]
    pieces = ['{"city"', ': "Pa', 'ris"}', "}", "\n</tool_call>"]
    sent = [[d.to_openai() for d in streamer.feed(p).tool_calls] for p in pieces]
    assert sent == [[{"index": 0, "function": {"arguments": '{"city"'}}],
                    [{"index": 0, "function": {"arguments": ': "Pa'}}],
                    [{"index": 0, "function": {"arguments": 'ris"}'}}], [], []]
    assert not streamer.finish()
    assert [(c.name, c.args()) for c in streamer.tool_calls] == [
        ("get_weather", {"city": "Paris"})]


def test_unknown_parser_names_the_choices() -> None:
    with pytest.raises(ValueError, match="deepseek_v3, deepseek_v31, glm45, granite, granite4, hermes, internlm, "
                       "kimi_k2, llama3_json, mistral, olmo3, openai, phi4_mini_json, pythonic, qwen3_coder"):
        get_tool_parser("nope")


# -- reasoning --------------------------------------------------------------------------

REASONING_CASES = [
    ("deepseek_r1", "Let me think: 2+2.</think>It is 4.", "Let me think: 2+2.", "It is 4."),
    ("deepseek_r1", "<think>\nhmm\n</think>\n\nFour.", "\nhmm\n", "\n\nFour."),
    ("deepseek_r1", "still thinking when cut off </thi", "still thinking when cut off </thi",
     None),
    ("deepseek_r1", "</think>No thoughts.", None, "No thoughts."),
    ("qwen3", "<think>\nThe user wants 4.\n</think>\n\nIt is 4.", "\nThe user wants 4.\n",
     "\n\nIt is 4."),
    ("qwen3", "It is 4, and <think> here is just text.", None,
     "It is 4, and <think> here is just text."),
    ("qwen3", "<think>cut off", "cut off", None),
    ("qwen3", "<thin", None, "<thin"),
    ("olmo3", "<think>Two and two.</think>Four.", "Two and two.", "Four."),
    ("olmo3", "Two and two.</think>Four.", "Two and two.", "Four."),
    ("exaone4", "\nhmm\n</think>\n\nFour.", "\nhmm\n", "\n\nFour."),
    ("deepseek_v3", "hmm</think>Four.", "hmm", "Four."),
    ("granite", "Here is my thought process:\nAdd them.\nHere is my response:\nFour.",
     "\nAdd them.\n", "\nFour."),
    ("granite", "Here's my thought process: add. Here's my response: 4", " add. ", " 4"),
    ("granite", "Here is my thought process: add. Here's my response: 4", " add. ", " 4"),
    ("granite", "Here is my thought process: cut off at Here is my resp",
     " cut off at Here is my resp", None),
    ("granite", "Four. Here is my thought process: none.", None,
     "Four. Here is my thought process: none."),
    ("granite", "Here", None, "Here"),
    ("mistral", "[THINK]2+2[/THINK]4", "2+2", "4"),
    ("mistral", "4, no [THINK] here", None, "4, no [THINK] here"),
    ("mistral", "[THINK]cut off [/THI", "cut off [/THI", None),
    ("openai_gptoss", "<|channel|>analysis<|message|>2+2<|end|><|start|>assistant<|channel|>final<|message|>4",
     "2+2", "4"),
    ("openai_gptoss", "<|channel|>final<|message|>4", None, "4"),
    ("glm45", "<think>Two and two.</think>Four.", "Two and two.", "Four."),
    ("glm45", "Four, no thinking.", None, "Four, no thinking."),
    ("openai_gptoss", "<|channel|>analysis<|message|>cut off <|en", "cut off <|en", None),
    ("openai_gptoss", "<|channel|>analysis<|message|>x<|end|><|start|>assist", "x", "<|start|>assist"),
    # A call's header stays in the content, for the openai tool parser.
    ("openai_gptoss", "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary "
     "to=functions.f <|constrain|>json<|message|>{}", "x",
     "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}"),
]


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), REASONING_CASES)
def test_reasoning_split_exact_complete_and_streamed(
    parser: str, text: str, reasoning: str | None, content: str | None
) -> None:
    split = get_reasoning_parser(parser).parse(text)
    assert (split.reasoning, split.content) == (reasoning, content)
    for pieces in [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]:
        streamer = get_reasoning_parser(parser).streamer()
        deltas = [*(streamer.feed(p) for p in pieces), streamer.finish()]
        assert "".join(d.reasoning for d in deltas) == (reasoning or "")
        assert "".join(d.content for d in deltas) == (content or "")


def test_reasoning_parsers_are_registered() -> None:
    assert set(REASONING_PARSERS) == {"deepseek_r1", "deepseek_v3", "qwen3", "olmo3", "exaone4",
                                      "granite", "mistral", "openai_gptoss", "glm45"}
    with pytest.raises(ValueError, match="deepseek_r1, deepseek_v3, exaone4, glm45, granite, mistral, olmo3, "
                       "openai_gptoss, qwen3"):
        get_reasoning_parser("nope")


_REASONING_FRAGMENTS = ["<think>", "</think>", "</thi", "Here is my", " thought process:",
                        "Here's my response:", " response:", "Here", "[THINK]", "[/THINK]",
                        "[/TH", "<|channel|>analysis<|message|>", "<|end|>", "<|en", "<|start|>",
                        "<|channel|>", "final<|message|>", "text", " ", "\n", "4"]


@settings(max_examples=80, deadline=None)
@given(reasoning=st.lists(st.sampled_from(_REASONING_FRAGMENTS), max_size=8),
       content=st.lists(st.sampled_from(_REASONING_FRAGMENTS), max_size=8),
       opened=st.booleans(), which=st.integers(0, 1), cut=st.integers(0, 200))
def test_a_reasoning_block_round_trips_through_every_parser(
    reasoning: list[str], content: list[str], opened: bool, which: int, cut: int
) -> None:
    """An output written as the format says (the opening marker, unless the prompt opened
    it; reasoning free of closing markers; a closing marker; any content) splits back
    into the reasoning and the content it was made of, whole and streamed."""
    for parser in REASONING_PARSERS.values():
        thought = "".join(reasoning)
        while _first_marker(thought, parser.ends) is not None:
            thought = thought.replace(_first_marker(thought, parser.ends), "")
        start = parser.starts[which % len(parser.starts)]
        head = start if not parser.starts_in_reasoning or opened else ""
        if not head and any(thought.startswith(m) for m in parser.starts):
            continue  # a leading opening marker is taken as the marker
        answer = "".join(content)
        if any(answer.startswith(h) for h in parser.content_starts):
            continue  # a header the format drops (harmony's final channel)
        text = head + thought + parser.ends[which % len(parser.ends)] + answer
        split = parser.parse(text)
        assert (split.reasoning, split.content) == (thought or None, answer or None), (
            parser.name, text)
        at = min(cut, len(text))
        streamer = parser.streamer()
        deltas = [streamer.feed(text[:at]), streamer.feed(text[at:]), streamer.finish()]
        assert "".join(d.reasoning for d in deltas) == thought, (parser.name, text)
        assert "".join(d.content for d in deltas) == answer, (parser.name, text)


def _first_marker(text: str, markers: tuple[str, ...]) -> str | None:
    return next((m for m in markers if m in text), None)


def test_thinking_switches_follow_each_template_kwarg() -> None:
    """Qwen3 thinks unless the request turns its switch off on a template that reads it;
    Granite and EXAONE think only when the request turns theirs on."""
    reads = {"enable_thinking", "thinking"}.__contains__
    qwen3, granite, exaone = (get_reasoning_parser(n) for n in ("qwen3", "granite", "exaone4"))
    assert not qwen3.thinking_off({}, reads)
    assert qwen3.thinking_off({"enable_thinking": False}, reads)
    assert not qwen3.thinking_off({"enable_thinking": False}, lambda name: False)
    assert granite.thinking_off({}, reads) and not granite.thinking_off({"thinking": True}, reads)
    assert granite.thinking_off({"enable_thinking": True}, reads)
    assert exaone.thinking_off({}, reads)
    assert not exaone.thinking_off({"enable_thinking": True}, reads)
    deepseek_v3 = get_reasoning_parser("deepseek_v3")  # vLLM's: DeepSeek-R1's split with thinking on
    assert deepseek_v3.thinking_off({}, reads) and not deepseek_v3.thinking_off({"thinking": True}, reads)
    assert not get_reasoning_parser("deepseek_r1").thinking_off({"enable_thinking": False}, reads)


# Pieces of every parser's syntax, so random texts hit partial markers, markers in odd
# places and half-written calls.
_FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<|tool_call|>", "[", "]", "{", "}", '"', ":", ",", " ",
    "\n", '{"name": "get_weather", ', '"arguments": {"city": "Paris"}', '"parameters": {}',
    "<|action_start|><|plugin|>", "<|action_end|>", "<|action_start|>", "<function=",
    "get_weather>", "<parameter=city>", "Paris", "</parameter>", "</function>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "function<｜tool▁sep｜>", "```json\n",
    "\n```", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", "[TOOL_CALLS]", "[ARGS]",
    "<|python_tag|>", "get_weather(city='Paris')", ";", "text", "<", "\\",
    "<function_calls>", "</function_calls>", "get_time(zone=null)",
]


@settings(max_examples=60, deadline=None)
@given(pieces=st.lists(st.sampled_from(_FRAGMENTS), max_size=14), cut=st.integers(0, 400))
def test_any_text_parses_and_streams_to_the_same_result(pieces: list[str], cut: int) -> None:
    """Whatever the model writes, every parser reads it without raising, and the stream
    (cut anywhere, or a character at a time) gives the complete parse."""
    text = "".join(pieces)
    cut = min(cut, len(text))
    for name, parser in TOOL_PARSERS.items():
        parsed = parser.parse(text, _ids(), tools=TYPED)
        expected = [c.to_openai()["function"] | {"id": c.id} for c in parsed.tool_calls]
        for split in ([text[:cut], text[cut:]], list(text)):
            assert _stream(name, split) == (parsed.content, expected), (name, split)
        for call in parsed.tool_calls:
            assert isinstance(call.args(), dict)


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_a_call_cut_anywhere_by_a_stop_string_is_never_a_call_with_non_json_arguments(
    parser: str,
) -> None:
    # tool_choice "auto" with `stop` reads calls from free text (issue 28): a stop string
    # may end the output at any character of a call, and what comes back must be content
    # or calls whose arguments are JSON objects, streamed or whole.
    for _, text, _, _ in (c for c in CASES if c[0] == parser and c[3]):
        for k in range(len(text) + 1):
            parsed = get_tool_parser(parser).parse(text[:k], _ids(), tools=TYPED)
            for call in parsed.tool_calls:
                assert isinstance(json.loads(call.arguments), dict), (text[:k], call)
            _, streamed = _stream(parser, list(text[:k]))
            for call in streamed:
                assert isinstance(json.loads(call["arguments"]), dict), (text[:k], call)
