"""Tool calls and reasoning under grammars, in the engine, on a tiny model.

The model has random weights and holds ``<tool_call>``, ``</tool_call>``, ``<think>`` and
``</think>`` as single tokens (``chat_fixtures.write_marker_model``), so a logit_bias on
one makes it open calls or end its reasoning at temperature 1, and many seeds are the
fuzzing. The oracles are the tool-call and reasoning parsers and ``jsonschema``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
import trio
from chat_fixtures import (
    HARMONY_MARKER_TOKENS,
    HARMONY_TEMPLATE,
    MAGISTRAL_MARKER_TOKENS,
    MARKER_TOKENS,
    MISTRAL_MARKER_TOKENS,
    THINK_TEMPLATE,
    TOOL_TEMPLATE,
    TOOLS,
    WEATHER_TOOL,
    marker_id,
    write_marker_model,
)
from engine_helpers import collect, wait_idle

import engine
from engine.chat.reasoning import get_reasoning_parser
from engine.chat.request import ChatSettings
from engine.chat.tool_parsers import get_tool_parser
from engine.chat.tools import Tool, auto_structural_tag, parse_tools, required_structural_tag
from engine.params import SamplingParams
from engine.structured import GrammarBackend, StructuredOutputs
from engine.structured.bitmask import bitmask_words

ENGINE_OPTIONS: dict[str, Any] = dict(
    dtype="float32", max_num_seqs=32, max_num_batched_tokens=512, block_size=16,
    kv_cache_memory=8 * 1024 * 1024, max_model_len=1024,
)
SEEDS = range(24)
MAX_TOKENS = 160
TOOL_LIST = parse_tools(TOOLS)
VALIDATORS = {t.name: jsonschema.Draft202012Validator(dict(t.parameters)) for t in TOOL_LIST}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_marker_model(tmp_path_factory.mktemp("markers") / "m", TOOL_TEMPLATE)


@pytest.fixture
async def eng(model: Path) -> Any:
    async with engine.open_engine(str(model), **ENGINE_OPTIONS) as running:
        yield running


def bias(eng: Any, **markers: float) -> dict[int, float]:
    """logit_bias favouring marker tokens (``call``, ``end_think``) and EOS (``eos``), so
    outputs open calls, end reasoning and finish well within MAX_TOKENS."""
    names = {"call": "<tool_call>", "end_think": "</think>", "think": "<think>"}
    out = {marker_id(eng.tokenizer, names[k]): v for k, v in markers.items() if k != "eos"}
    if "eos" in markers:
        out[eng.tokenizer.eos_token_id] = markers["eos"]
    return out


async def texts(eng: Any, spec: StructuredOutputs, logit_bias: dict[int, float],
                seeds: range = SEEDS, max_tokens: int = MAX_TOKENS,
                **params_extra: Any) -> list[tuple[str, str | None]]:
    """(text, finish_reason) of one request per seed at temperature 1, all in flight."""
    results: list[tuple[str, str | None]] = [("", None)] * len(seeds)

    async def one(i: int, seed: int) -> None:
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                                structured_outputs=spec, logit_bias=logit_bias,
                                **params_extra)
        outs = await collect(eng, "Answer:", params)
        results[i] = ("".join(o.text for o in outs), outs[-1].finish_reason)

    async with trio.open_nursery() as nursery:
        for i, seed in enumerate(seeds):
            nursery.start_soon(one, i, seed)
    return results


CALL_OPENING = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}


def ended(results: list[tuple[str, str | None]]) -> list[tuple[str, str | None]]:
    """``results``, having checked that three quarters or more ended on their own (the
    biases are tuned for that) and the rest ran to max_tokens. Which seeds run long
    depends on the batch's float rounding, so no seed is special."""
    assert all(reason in ("stop", "length") for _, reason in results), results
    assert sum(reason == "stop" for _, reason in results) >= 3 * len(results) // 4, results
    return results


def check_calls(text: str, parser: str = "hermes", reason: str | None = "stop") -> int:
    """Every call in ``text`` names a tool and its arguments validate; no opened call is
    left behind as content. Returns how many calls there were. With ``reason`` "length"
    the output may end inside a call, which is left out."""
    opening = CALL_OPENING[parser]
    if reason == "length" and opening in (get_tool_parser(parser).parse(text).content or ""):
        # The unfinished call opens at the last opening with nothing opened and unfinished
        # before it (its arguments' strings may hold the marker too).
        def clean(n: int) -> bool:
            return opening not in (get_tool_parser(parser).parse(text[:n]).content or "")
        cuts = [i for i in range(len(text)) if text.startswith(opening, i)]
        text = text[:max((i for i in cuts if clean(i)), default=len(text))]
    parsed = get_tool_parser(parser).parse(text)
    assert CALL_OPENING[parser] not in (parsed.content or ""), text
    for call in parsed.tool_calls:
        VALIDATORS[call.name].validate(json.loads(call.arguments))
    # What the grammar wrote, read as it streams (the model's own arguments text), is
    # the same content and calls.
    streamed = get_tool_parser(parser).parse(text, constrained=True)
    assert streamed.content == parsed.content, text
    assert [(c.name, json.loads(c.arguments)) for c in streamed.tool_calls] == \
        [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls], text
    return len(parsed.tool_calls)


async def test_an_auto_call_once_opened_always_parses_and_validates(eng: Any) -> None:
    spec = StructuredOutputs(structural_tag=auto_structural_tag(TOOL_LIST, "hermes"))
    # Each call is ~35 tokens. The biases are tuned so that about half the outputs open a
    # call or more and every output ends within the budget.
    results = ended(await texts(eng, spec, bias(eng, call=4.0, eos=3.5), max_tokens=400))
    calls = 0
    for text, reason in results:
        calls += check_calls(text, reason=reason)
    # Really exercised: calls were opened, and free text stayed free.
    assert calls >= len(SEEDS) // 2
    assert any(get_tool_parser("hermes").parse(t).content for t, _ in results)
    await wait_idle(eng)


async def test_without_parallel_calls_an_auto_output_ends_after_one_call(eng: Any) -> None:
    spec = StructuredOutputs(structural_tag=auto_structural_tag(TOOL_LIST, "hermes", False))
    one_call = 0
    for text, reason in ended(await texts(eng, spec, bias(eng, call=4.0, eos=1.0))):
        n = check_calls(text, reason=reason)
        assert n <= 1, text
        one_call += n
        if n:  # nothing but the call's own closing after it
            assert text.endswith("</tool_call>"), text
    assert one_call > len(SEEDS) // 2


@pytest.fixture(scope="module")
def mistral_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # As in Mistral's tokenizers, the markers are special tokens.
    return write_marker_model(tmp_path_factory.mktemp("mistral") / "m", TOOL_TEMPLATE,
                              MISTRAL_MARKER_TOKENS, special=True)


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "one call"])
async def test_a_mistral_auto_call_once_opened_always_parses_and_validates(
    mistral_model: Path, parallel: bool,
) -> None:
    """After [TOOL_CALLS] the random model writes a JSON list or name[ARGS]{...} (both
    shapes are offered); every call parses with the mistral parser and validates, and
    without parallel calls the output ends after one."""
    spec = StructuredOutputs(structural_tag=auto_structural_tag(TOOL_LIST, "mistral", parallel))
    async with engine.open_engine(str(mistral_model), **ENGINE_OPTIONS) as eng:
        # Tuned so that a third or more of the outputs call and all end within the budget
        # (parallel lists and repeated [TOOL_CALLS] run long unless EOS is likelier).
        opening, eos = (3.0, 4.0) if parallel else (4.0, 3.5)
        calls = {marker_id(eng.tokenizer, "[TOOL_CALLS]"): opening,
                 eng.tokenizer.eos_token_id: eos}
        # The markers are special tokens: the text keeps them (as the server asks for the
        # mistral parser).
        results = ended(await texts(eng, spec, calls, max_tokens=400, seeds=range(32),
                                    skip_special_tokens=False))
        await wait_idle(eng)
    shapes = set()
    for text, reason in results:
        n = check_calls(text, "mistral", reason)
        if n:
            shapes.add("named" if "[ARGS]" in text else "list")
        if not parallel:
            assert n <= 1, text
            if n:  # nothing after the call
                assert text.endswith(("]", "}")), text
    # Really exercised: calls were written, and free text stayed free. (The random model
    # seldom picks the name[ARGS] shape: none in 32 seeds on some seed ranges. The
    # grammar's acceptance of both shapes is checked on exact strings below.)
    assert shapes
    assert sum(check_calls(t, "mistral", r) for t, r in results) >= len(results) // 3
    assert any(get_tool_parser("mistral").parse(t).content for t, _ in results)


async def test_mistral_auto_calls_through_the_chat_api_come_back_as_calls(
    mistral_model: Path,
) -> None:
    """With --tool-call-parser mistral --enable-auto-tool-choice the chat path keeps the
    special markers in the text, constrains the call the model opens and reads it back:
    a call validates and ends the turn with "tool_calls", and no marker is left in the
    content."""
    settings = ChatSettings(tool_call_parser="mistral", enable_auto_tool_choice=True)
    async with engine.open_engine(str(mistral_model), **ENGINE_OPTIONS) as eng:
        calls = {marker_id(eng.tokenizer, "[TOOL_CALLS]"): 4.0, eng.tokenizer.eos_token_id: 3.5}

        async def one(seed: int) -> Any:
            params = SamplingParams(temperature=1.0, seed=seed, max_tokens=300,
                                    logit_bias=calls)
            result = await eng.chat([{"role": "user", "content": "Weather?"}], params,
                                    tools=TOOLS, settings=settings, parallel_tool_calls=False)
            return result.choices[0]

        replies = [await one(seed) for seed in range(8)]
        await wait_idle(eng)
    for reply in replies:
        assert "[TOOL_CALLS]" not in (reply.message.content or ""), reply
        assert reply.finish_reason == ("tool_calls" if reply.message.tool_calls else "stop")
        assert len(reply.message.tool_calls) <= 1, reply
        for call in reply.message.tool_calls:
            VALIDATORS[call.name].validate(call.args())
    assert 0 < sum(bool(r.message.tool_calls) for r in replies) < len(replies)


async def test_a_constraint_starts_only_after_the_reasoning(eng: Any) -> None:
    """think "open" (deepseek_r1: the prompt opened <think>): free reasoning, then the
    schema. "optional" (qwen3): an answer with or without a leading think block."""
    schema = dict(WEATHER_TOOL["function"]["parameters"])
    validator = jsonschema.Draft202012Validator(schema)
    for think, parser, markers in (("open", "deepseek_r1", {"end_think": 3.0}),
                                   ("optional", "qwen3", {"think": 2.0, "end_think": 3.0})):
        spec = StructuredOutputs(json=schema, think=think)
        thought = 0
        free = 0
        for text, reason in ended(await texts(eng, spec, bias(eng, **markers))):
            if reason == "length":  # may end inside the reasoning or the JSON
                continue
            split = get_reasoning_parser(parser).parse(text)
            assert split.content is not None, text
            validator.validate(json.loads(split.content))
            thought += split.reasoning is not None
            # The reasoning really was free text: not the schema's JSON (a one-token
            # reasoning such as "5" may happen to be JSON, so it counts, not fails).
            free += split.reasoning is not None and not _is_json(split.reasoning)
        assert thought > (len(SEEDS) // 2 if think == "open" else 0), think
        assert free >= thought // 2, think


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


async def test_a_forced_call_after_reasoning_is_split_and_validates(tmp_path: Path) -> None:
    """Through the embedded chat API with --reasoning-parser deepseek_r1 and a template
    that opens <think>: the reasoning comes back apart and the call validates."""
    path = write_marker_model(tmp_path / "think", THINK_TEMPLATE)
    settings = ChatSettings(reasoning_parser="deepseek_r1")
    async with engine.open_engine(str(path), **ENGINE_OPTIONS) as eng:
        end_think = {marker_id(eng.tokenizer, "</think>"): 3.0}

        async def one(seed: int, choice: Any) -> Any:
            # (The fallback tool prompt is ~790 tokens of the 1024.)
            params = SamplingParams(temperature=1.0, seed=seed, max_tokens=230,
                                    logit_bias=end_think)
            return await eng.chat([{"role": "user", "content": "Weather?"}], params,
                                  tools=TOOLS, tool_choice=choice, settings=settings,
                                  parallel_tool_calls=False)

        named = {"type": "function", "function": {"name": "get_weather"}}
        thought = ran_long = 0
        for seed in range(6):
            for choice in ("required", named):
                (reply,) = (await one(seed, choice)).choices
                # A seed whose first token is "</think>" thinks nothing (None).
                thought += bool(reply.message.reasoning_content)
                assert reply.message.content is None
                if reply.finish_reason == "length":  # reasoning long, call cut short
                    ran_long += 1
                    continue
                # A named call ends with "stop", as OpenAI and vLLM end one.
                ended = "tool_calls" if choice == "required" else "stop"
                assert reply.finish_reason == ended, reply
                (call,) = reply.message.tool_calls
                VALIDATORS[call.name].validate(json.loads(call.arguments))
        assert thought >= 6 and ran_long <= 3
        await wait_idle(eng)


def test_the_marker_tokens_are_single_tokens(model: Path) -> None:
    from engine.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(model)
    ids = [marker_id(tokenizer, m) for m in MARKER_TOKENS]
    assert len(set(ids)) == len(MARKER_TOKENS)


# -- the grammars themselves, token by token ----------------------------------------------


def _grammar_backend(name: str, folder: Path) -> tuple[str, GrammarBackend, Any]:
    from engine.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(folder)
    return name, GrammarBackend(
        tokenizer, vocab_size=tokenizer.vocab_size,
        stop_token_ids=(tokenizer.eos_token_id,), backend=name), tokenizer


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def grammar(request: pytest.FixtureRequest, model: Path) -> tuple[str, GrammarBackend, Any]:
    return _grammar_backend(request.param, model)


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def mistral_grammar(request: pytest.FixtureRequest,
                    mistral_model: Path) -> tuple[str, GrammarBackend, Any]:
    return _grammar_backend(request.param, mistral_model)


def _accepts(grammar: tuple[str, GrammarBackend, Any], spec: StructuredOutputs, text: str,
             *, end: bool = True) -> bool:
    _, backend, tokenizer = grammar
    matcher = backend.matcher(spec)
    ok = all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))
    return ok and (not end or matcher.accept(tokenizer.eos_token_id))


def _args(grammar: tuple[str, GrammarBackend, Any], obj: dict[str, Any]) -> str:
    # xgrammar writes ", " and ": " between JSON items; llguidance compact separators.
    compact = grammar[0] == "guidance"
    return json.dumps(obj, separators=(",", ":") if compact else None)


def test_auto_tags_free_text_and_hold_an_opened_call_to_its_tool(grammar: Any) -> None:
    paris = _args(grammar, {"city": "Paris", "unit": "celsius"})
    call = f'<tool_call>\n{{"name": "get_weather", "arguments": {paris}}}\n</tool_call>'
    one_line = f'<tool_call>{{"name": "get_weather", "arguments": {paris}}}</tool_call>'
    hermes = StructuredOutputs(structural_tag=auto_structural_tag(TOOL_LIST, "hermes"))
    assert _accepts(grammar, hermes, "No call at all.")
    assert _accepts(grammar, hermes, f"Let me check. {call}\n{one_line} Done.")
    for opened in ('<tool_call>{"name": "get_pizza"', '<tool_call>{"arguments": {}',
                   '<tool_call>\n{"name": "get_weather", "arguments": {"town"',
                   f'<tool_call>{{"name": "get_time", "arguments": {paris}'):
        assert not _accepts(grammar, hermes, opened, end=False), opened
    # An opened call must be closed before the output may end.
    assert not _accepts(grammar, hermes, call[:-3])
    single = StructuredOutputs(structural_tag=auto_structural_tag(TOOL_LIST, "hermes", False))
    assert _accepts(grammar, single, "Sure. " + call)
    assert not _accepts(grammar, single, call + " more", end=False)
    llama = StructuredOutputs(structural_tag=auto_structural_tag(TOOL_LIST, "llama3_json"))
    utc = _args(grammar, {"zone": "UTC", "hour24": True})
    assert _accepts(grammar, llama, f'{{"name": "get_time", "parameters": {utc}}}')
    assert not _accepts(grammar, llama, '{"name": "get_weather", "parameters": {"zone"', end=False)


def test_mistral_auto_tags_take_both_shapes_and_hold_them_to_the_tools(
    mistral_grammar: Any,
) -> None:
    """[TOOL_CALLS] (a special token) opens a JSON list or name[ARGS]{...}: the names are
    the tools', the arguments their schemas', a list closes; text around calls is free."""
    paris = _args(mistral_grammar, {"city": "Paris", "unit": "celsius"})
    utc = _args(mistral_grammar, {"zone": "UTC", "hour24": True})
    weather = f'{{"name": "get_weather", "arguments": {paris}}}'
    time = f'{{"name": "get_time", "arguments": {utc}}}'
    many = StructuredOutputs(structural_tag=auto_structural_tag(TOOL_LIST, "mistral"))
    assert _accepts(mistral_grammar, many, "No call at all.")
    assert _accepts(mistral_grammar, many, f"Let me check. [TOOL_CALLS] [{weather}] Done.")
    assert _accepts(mistral_grammar, many, f"[TOOL_CALLS][{weather}, {time}]")
    assert _accepts(mistral_grammar, many,
                    f"[TOOL_CALLS]get_time[ARGS]{utc}[TOOL_CALLS]get_weather[ARGS]{paris}")
    for opened in ('[TOOL_CALLS][{"name": "get_pizza"', "[TOOL_CALLS]get_pizza",
                   '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"town"',
                   f"[TOOL_CALLS]get_time[ARGS]{paris}", "[TOOL_CALLS] hello"):
        assert not _accepts(mistral_grammar, many, opened, end=False), opened
    assert not _accepts(mistral_grammar, many, f"[TOOL_CALLS][{weather}")  # never closed
    one = StructuredOutputs(structural_tag=auto_structural_tag(TOOL_LIST, "mistral", False))
    assert _accepts(mistral_grammar, one, f"Sure. [TOOL_CALLS] [{weather}]")
    assert _accepts(mistral_grammar, one, f"[TOOL_CALLS]get_time[ARGS]{utc}")
    for more in (f"[TOOL_CALLS][{weather}, ", f"[TOOL_CALLS][{weather}] ok",
                 f"[TOOL_CALLS]get_time[ARGS]{utc}[TOOL_CALLS]"):
        assert not _accepts(mistral_grammar, one, more, end=False), more
    # The markers went in as their special tokens (marker_id: one token each).
    _, _, tokenizer = mistral_grammar
    assert {marker_id(tokenizer, m) for m in MISTRAL_MARKER_TOKENS} <= set(
        tokenizer.encode(f"[TOOL_CALLS]get_time[ARGS]{utc}", add_special_tokens=False))


def test_required_calls_in_the_parsers_syntax_and_nothing_else(grammar: Any) -> None:
    paris = _args(grammar, {"city": "Paris", "unit": "celsius"})
    utc = _args(grammar, {"zone": "UTC", "hour24": True})
    weather = f'<tool_call>\n{{"name": "get_weather", "arguments": {paris}}}\n</tool_call>'
    time = f'<tool_call>{{"name": "get_time", "arguments": {utc}}}</tool_call>'
    many = StructuredOutputs(structural_tag=required_structural_tag(TOOL_LIST, "hermes"))
    assert _accepts(grammar, many, weather)
    assert _accepts(grammar, many, f"{weather}\n{time}\n{weather}")
    assert not _accepts(grammar, many, "")  # at least one call
    assert not _accepts(grammar, many, "Sure", end=False)  # and no text
    assert not _accepts(grammar, many, weather + " ok", end=False)
    one = StructuredOutputs(structural_tag=required_structural_tag(TOOL_LIST, "hermes", False))
    assert _accepts(grammar, one, time)
    assert not _accepts(grammar, one, f"{time}\n<", end=False)
    llama = StructuredOutputs(structural_tag=required_structural_tag(TOOL_LIST, "llama3_json"))
    call = f'{{"name": "get_time", "parameters": {utc}}}'
    assert _accepts(grammar, llama, f"{call}; {call}")
    assert required_structural_tag(TOOL_LIST, "pythonic") is None



@pytest.mark.parametrize("parser", ["granite4", "internlm"])
async def test_required_calls_in_a_special_token_syntax_come_back_as_calls(
    tmp_path_factory: pytest.TempPathFactory, parser: str,
) -> None:
    """tool_choice "required" with a parser whose markers are special tokens: the chat
    path writes the calls in that syntax and keeps the markers in the text, so the parser
    reads each output back as one valid call ending the turn."""
    markers = {"granite4": ("<tool_call>", "</tool_call>"),
               "internlm": INTERNLM_MARKER_TOKENS}[parser]
    folder = write_marker_model(tmp_path_factory.mktemp(parser) / "m", TOOL_TEMPLATE,
                                markers, special=True)
    settings = ChatSettings(tool_call_parser=parser, enable_auto_tool_choice=True)
    replies: list[Any] = [None] * 4
    async with engine.open_engine(str(folder), **ENGINE_OPTIONS) as eng:

        async def one(seed: int) -> None:
            params = SamplingParams(temperature=1.0, seed=seed, max_tokens=150)
            result = await eng.chat([{"role": "user", "content": "Weather?"}], params,
                                    tools=TOOLS, tool_choice="required", settings=settings,
                                    parallel_tool_calls=False)
            replies[seed] = result.choices[0]

        async with trio.open_nursery() as nursery:
            for seed in range(len(replies)):
                nursery.start_soon(one, seed)
        await wait_idle(eng)
    for reply in replies:
        assert reply.finish_reason == "tool_calls", reply
        (call,) = reply.message.tool_calls
        VALIDATORS[call.name].validate(call.args())
        assert not reply.message.content, reply


# InternLM 2.5's action markers, special tokens in its tokenizer.
INTERNLM_MARKER_TOKENS = ("<|action_start|>", "<|plugin|>", "<|action_end|>")


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def internlm_grammar(request: pytest.FixtureRequest,
                     tmp_path_factory: pytest.TempPathFactory) -> tuple[str, GrammarBackend, Any]:
    folder = write_marker_model(tmp_path_factory.mktemp("internlm") / "m", TOOL_TEMPLATE,
                                INTERNLM_MARKER_TOKENS, special=True)
    return _grammar_backend(request.param, folder)


def test_internlm_calls_are_held_to_the_tools_in_its_special_token_frame(
    internlm_grammar: Any,
) -> None:
    """auto: text is free until <|action_start|>, then a plugin call to a tool with its
    schema's arguments, closed by <|action_end|>; required: such calls and nothing else.
    What the grammar takes, the internlm parser reads as those calls."""
    paris = _args(internlm_grammar, {"city": "Paris", "unit": "celsius"})
    utc = _args(internlm_grammar, {"zone": "UTC", "hour24": True})
    weather = (f'<|action_start|><|plugin|>\n{{"name": "get_weather", "parameters": {paris}}}'
               "<|action_end|>")
    time = f'<|action_start|><|plugin|>{{"name": "get_time", "parameters": {utc}}}<|action_end|>'
    auto = StructuredOutputs(structural_tag=auto_structural_tag(TOOL_LIST, "internlm"))
    required = StructuredOutputs(structural_tag=required_structural_tag(TOOL_LIST, "internlm"))
    assert _accepts(internlm_grammar, auto, "No call at all.")
    assert _accepts(internlm_grammar, auto, f"Let me check. {weather}")
    assert _accepts(internlm_grammar, required, f"{weather}\n{time}")
    for opened in ("<|action_start|><|interpreter|>", '<|action_start|><|plugin|>{"name": "x"',
                   '<|action_start|><|plugin|>{"name": "get_time", "parameters": {"city"'):
        assert not _accepts(internlm_grammar, auto, opened, end=False), opened
    assert not _accepts(internlm_grammar, auto, weather[:-len("<|action_end|>")])
    assert not _accepts(internlm_grammar, required, "Sure", end=False)
    calls = get_tool_parser("internlm").parse(f"Let me check. {weather}\n{time}").tool_calls
    assert [(c.name, c.args()) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"zone": "UTC", "hour24": True})]
    _, _, tokenizer = internlm_grammar
    assert {marker_id(tokenizer, m) for m in INTERNLM_MARKER_TOKENS} <= set(
        tokenizer.encode(weather, add_special_tokens=False))


@pytest.mark.parametrize("kind", ["json", "regex", "choice", "grammar", "structural_tag"])
def test_every_kind_of_constraint_waits_for_the_reasoning_to_end(grammar: Any, kind: str) -> None:
    value: Any = {"json": {"type": "object", "properties": {"n": {"type": "integer"}},
                           "required": ["n"]},
                  "regex": "[0-9]+", "choice": ("yes", "no"), "grammar": 'root ::= "x" [0-9]',
                  "structural_tag": auto_structural_tag([Tool("f", {"type": "object"})],
                                                        "hermes")}[kind]
    good = {"json": _args(grammar, {"n": 1}), "regex": "42", "choice": "yes", "grammar": "x7",
            "structural_tag": 'Ok <tool_call>{"name": "f", "arguments": {}}</tool_call>'}[kind]
    bad = {"json": '{"m"', "regex": "x", "choice": "maybe", "grammar": "y",
           "structural_tag": '<tool_call>{"name": "g"'}[kind]
    # (Under llguidance reasoning is text: a special token other than </think> is refused.)
    reasoning = 'Hmm, {"n": "not json yet" and </thin'
    opened = StructuredOutputs(**{kind: value}, think="open")
    assert _accepts(grammar, opened, f"{reasoning}k>\n\n{good}")
    assert _accepts(grammar, opened, f"<think>{reasoning}k>{good}")
    assert not _accepts(grammar, opened, f"{reasoning}k>\n\n{bad}", end=False)
    assert not _accepts(grammar, opened, reasoning)  # EOS only once the constraint is met
    optional = StructuredOutputs(**{kind: value}, think="optional")
    assert _accepts(grammar, optional, f"<think>{reasoning}k>\n{good}")
    assert _accepts(grammar, optional, good)
    assert not _accepts(grammar, optional, f"<think>{reasoning}k>{bad}", end=False)


# -- reasoning formats other than <think> tags --------------------------------------------

@pytest.fixture(scope="module")
def magistral_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_marker_model(tmp_path_factory.mktemp("magistral") / "m", TOOL_TEMPLATE,
                              MAGISTRAL_MARKER_TOKENS, special=True)


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def magistral_grammar(request: pytest.FixtureRequest,
                      magistral_model: Path) -> tuple[str, GrammarBackend, Any]:
    return _grammar_backend(request.param, magistral_model)


STRING_SCHEMA = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8}},
                 "required": ["s"], "additionalProperties": False}


def test_granite_reasoning_is_free_text_up_to_either_response_marker(grammar: Any) -> None:
    """Granite's markers are text in two spellings: the constraint starts after
    "Here is my response:" or "Here's my response:", and applies at once to an output
    that does not open with a thought-process marker."""
    spec = StructuredOutputs(json=STRING_SCHEMA, think=get_reasoning_parser("granite").think)
    good, bad = _args(grammar, {"s": "ok"}), '{"t"'
    thought = 'Maybe {"s": 1}, or Here is my resp... no.'
    for start in ("Here is my thought process:", "Here's my thought process:"):
        for end in ("Here is my response:", "Here's my response:"):
            assert _accepts(grammar, spec, f"{start}{thought}{end}\n{good}"), (start, end)
            assert not _accepts(grammar, spec, f"{start}{thought}{end}{bad}", end=False)
    assert _accepts(grammar, spec, good)
    assert not _accepts(grammar, spec, f"Here is my response:{good}", end=False)
    assert not _accepts(grammar, spec, f"Here is my thought process:{thought}")


def test_mistral_reasoning_markers_are_special_tokens_the_grammar_lets_through(
    magistral_grammar: Any,
) -> None:
    """[THINK] and [/THINK] are special tokens: under a JSON constraint the reasoning
    prefix takes them as tokens, while other special tokens stay out of the JSON."""
    _, _, tokenizer = magistral_grammar
    spec = StructuredOutputs(json=STRING_SCHEMA, think=get_reasoning_parser("mistral").think)
    good = _args(magistral_grammar, {"s": "ok"})
    opened = "[THINK]Two and two, {\"s\"[/THINK]"
    assert len(tokenizer.encode("[THINK][/THINK]", add_special_tokens=False)) == 2
    assert _accepts(magistral_grammar, spec, f"{opened}{good}")
    assert _accepts(magistral_grammar, spec, good)
    assert not _accepts(magistral_grammar, spec, f"{opened}[TOOL_CALLS]", end=False)
    assert not _accepts(magistral_grammar, spec, '{"s": "[TOOL_CALLS]"}', end=False)
    assert not _accepts(magistral_grammar, spec, f"{opened}{{\"t\"", end=False)
    # What the sampler may pick: [/THINK] inside the reasoning, no special token inside
    # the JSON string after it (xgrammar would match one as its text).
    think, end_think, calls = (marker_id(tokenizer, m) for m in MAGISTRAL_MARKER_TOKENS)
    assert _allowed(magistral_grammar, spec, "[THINK]Two and")[end_think]
    string = _args(magistral_grammar, {"s": "a"})
    after = _allowed(magistral_grammar, spec, opened + string[:string.index('a"}')])
    assert after[tokenizer.encode("a", add_special_tokens=False)[0]]
    assert not any(after[t] for t in (think, end_think, calls))


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def harmony_grammar(request: pytest.FixtureRequest,
                    tmp_path_factory: pytest.TempPathFactory) -> tuple[str, GrammarBackend, Any]:
    folder = write_marker_model(tmp_path_factory.mktemp("harmony") / "m", HARMONY_TEMPLATE,
                                HARMONY_MARKER_TOKENS, special=True)
    return _grammar_backend(request.param, folder)


def test_a_schema_after_harmony_reasoning_starts_after_the_final_channel_header(
    harmony_grammar: Any,
) -> None:
    """gpt-oss's analysis channel, then the final channel's header, are runs of special
    tokens and text: under a JSON constraint the reasoning prefix takes them as written
    (the special tokens as tokens) and the schema starts after <|message|>; other special
    tokens stay out of the reasoning's end and of the JSON; an answer without reasoning is
    the JSON alone."""
    _, _, tokenizer = harmony_grammar
    spec = StructuredOutputs(json=STRING_SCHEMA, think=get_reasoning_parser("openai_gptoss").think)
    good = _args(harmony_grammar, {"s": "ok"})
    analysis = "<|channel|>analysis<|message|>Two and two, {\"s\" is the key.<|end|>"
    final = "<|start|>assistant<|channel|>final<|message|>"
    assert _accepts(harmony_grammar, spec, f"{analysis}{final}{good}")
    assert _accepts(harmony_grammar, spec, good)
    # Another channel's header does not end the reasoning: the answer after it cannot end.
    assert not _accepts(harmony_grammar, spec, f"{analysis}<|start|>assistant<|channel|>commentary<|message|>{good}")
    assert not _accepts(harmony_grammar, spec, f"{analysis}{final}{{\"t\"", end=False)
    assert not _accepts(harmony_grammar, spec, f"{analysis}{final}<|call|>", end=False)
    start, end, message, channel = (marker_id(tokenizer, m) for m in
                                    ("<|start|>", "<|end|>", "<|message|>", "<|channel|>"))
    assert _allowed(harmony_grammar, spec, "<|channel|>analysis<|message|>Two and")[end]
    assert _allowed(harmony_grammar, spec, f"{analysis}<|start|>assistant")[channel]
    string = _args(harmony_grammar, {"s": "a"})
    after = _allowed(harmony_grammar, spec, analysis + final + string[:string.index('a"}')])
    assert after[tokenizer.encode("a", add_special_tokens=False)[0]]
    assert not any(after[t] for t in (start, end, message, channel))


def _allowed(grammar: tuple[str, GrammarBackend, Any], spec: StructuredOutputs,
             text: str) -> list[bool]:
    """Which tokens the matcher's mask allows after ``text``."""
    _, backend, tokenizer = grammar
    matcher = backend.matcher(spec)
    assert all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))
    row = torch.zeros((1, bitmask_words(backend.vocab_size)), dtype=torch.int32)
    matcher.fill(row, 0)
    words = row[0].numpy().view("uint32")
    return [bool(words[t // 32] >> (t % 32) & 1) for t in range(backend.vocab_size)]


async def test_a_mistral_reasoning_answer_under_a_schema_comes_back_split(
    magistral_model: Path,
) -> None:
    """Through the embedded chat API with the mistral reasoning parser: the special
    markers stay in the text for the parser (skip_special_tokens is turned off), the
    reasoning comes back apart and the answer validates against the schema."""
    settings = ChatSettings(reasoning_parser="mistral")
    validator = jsonschema.Draft202012Validator(STRING_SCHEMA)
    async with engine.open_engine(str(magistral_model), **ENGINE_OPTIONS) as eng:
        biases = {marker_id(eng.tokenizer, "[THINK]"): 4.0,
                  marker_id(eng.tokenizer, "[/THINK]"): 3.0}
        thought = 0
        for seed in range(8):
            params = SamplingParams(temperature=1.0, seed=seed, max_tokens=120,
                                    logit_bias=biases,
                                    structured_outputs=StructuredOutputs(json=STRING_SCHEMA))
            (reply,) = (await eng.chat([{"role": "user", "content": "Say ok."}], params,
                                       settings=settings)).choices
            if reply.finish_reason == "length":
                continue
            assert "[THINK]" not in (reply.message.content or ""), reply
            validator.validate(json.loads(reply.message.content))
            thought += reply.message.reasoning_content is not None
        assert thought >= 2
        await wait_idle(eng)
