"""Structured output on the tiny model: every finished output matches its constraint.

The tiny model has random weights, so at temperature 1 it wanders over everything the
grammar allows; many seeds per constraint are the fuzzing. The oracles are independent of
the grammar libraries: ``jsonschema`` for schemas, ``re.fullmatch`` for regexes, equality
for choices, and a hand check of a small grammar's language.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import trio
from engine_helpers import (
    collect,
    greedy,
    random_prompts,
    tiny_model,
    token_ids,
    wait_idle,
    wait_until,
)
from engine_helpers import text as output_text

import engine
from engine.errors import InvalidParamError, RequestFailedError
from engine.messages import NewRequest, pack, unpack
from engine.params import SamplingParams
from engine.structured import GrammarBackend, StructuredOutputs

# As tests/test_engine_e2e.py: a 4 MiB pool keeps start-up fast; 64 sequences let a whole
# batch of seeds run in one step.
ENGINE_OPTIONS: dict[str, Any] = dict(
    dtype="float32", max_num_seqs=64, max_num_batched_tokens=256, block_size=16,
    kv_cache_memory=4 * 1024 * 1024,
)
SEEDS = range(24)
# Enough for every bounded document below to finish; the tests assert they did ("stop").
MAX_TOKENS = 160

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested objects, required and optional keys": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 8},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 6},
                               "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
                "required": ["zip"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["name", "address"],
    },
    "arrays with min and max items": {
        "type": "object",
        "properties": {
            "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                    "minItems": 2, "maxItems": 4},
            "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        },
        "required": ["ids", "flags"],
    },
    "enums and const": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"enum": [1, 2, 3, None]},
                       "kind": {"const": "shirt"}},
        "required": ["color", "size", "kind"],
    },
    "bounded numbers": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 65},
                       "score": {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 3},
                       "ratio": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["age", "score", "ratio"],
    },
    "string pattern and lengths": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                       "tag": {"type": "string", "minLength": 2, "maxLength": 3}},
        "required": ["code", "tag"],
    },
    "anyOf and refs": {
        "$defs": {"point": {"type": "object",
                            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                            "required": ["x"]}},
        "type": "array",
        "items": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "null"},
                            {"type": "string", "maxLength": 3}]},
        "minItems": 1, "maxItems": 3,
    },
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory)


def constrained(spec: StructuredOutputs, seed: int, *, max_tokens: int = MAX_TOKENS,
                **extra: Any) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=spec, **extra)


async def outputs_for(eng: Any, spec: StructuredOutputs, seeds: range = SEEDS,
                      prompt: Any = "Answer:", **extra: Any) -> list[tuple[str, str | None]]:
    """(text, finish_reason) of one request per seed, all in flight together."""
    results: list[tuple[str, str | None]] = [("", None)] * len(seeds)

    async def one(i: int, seed: int) -> None:
        outs = await collect(eng, prompt, constrained(spec, seed, **extra))
        results[i] = ("".join(o.text for o in outs), outs[-1].finish_reason)

    async with trio.open_nursery() as nursery:
        for i, seed in enumerate(seeds):
            nursery.start_soon(one, i, seed)
    return results


# -- the constraint value ------------------------------------------------------------------


def test_exactly_one_constraint_is_set() -> None:
    with pytest.raises(InvalidParamError, match="exactly one") as none:
        StructuredOutputs()
    assert none.value.param == "structured_outputs"
    with pytest.raises(InvalidParamError, match="regex, choice"):
        StructuredOutputs(regex="a", choice=["a"])
    with pytest.raises(InvalidParamError, match="not a valid JSON schema"):
        StructuredOutputs(json={"type": "strin"})
    with pytest.raises(InvalidParamError, match="choice"):
        StructuredOutputs(choice=[])
    with pytest.raises(InvalidParamError, match="choice"):
        StructuredOutputs(choice=["a", 3])  # type: ignore[list-item]
    with pytest.raises(InvalidParamError, match="ignore_eos") as eos:
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputs(regex="a"))
    assert eos.value.param == "ignore_eos"
    with pytest.raises(InvalidParamError) as wrong_type:
        SamplingParams(structured_outputs={"json": {}})  # type: ignore[arg-type]
    assert wrong_type.value.param == "structured_outputs"


def test_a_schema_keeps_its_key_order_and_rides_messages_through_msgpack() -> None:
    spec = StructuredOutputs(json={"type": "object", "properties": {"b": {}, "a": {}}})
    assert list(spec.schema["properties"]) == ["b", "a"]
    assert spec == StructuredOutputs(json=spec.json)  # dict or its text: one key
    for each in (spec, StructuredOutputs(choice=["x", "y"]), StructuredOutputs(json_object=True)):
        message = NewRequest("r", (1, 2), SamplingParams(structured_outputs=each), (0,))
        assert unpack(pack(message)) == message


# -- compiling -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grammar(model: Path) -> GrammarBackend:
    from engine.models.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(model)
    return GrammarBackend(tok, vocab_size=tok.vocab_size, stop_token_ids=tuple(tok.eos_token_ids))


def test_a_repeated_spec_compiles_once(grammar: GrammarBackend) -> None:
    spec = StructuredOutputs(json={"type": "object", "properties": {"q": {"type": "integer"}}})
    before = grammar.statistics()
    first = grammar.compile(spec)
    for _ in range(5):
        assert grammar.compile(StructuredOutputs(json=dict(spec.schema))) is first
    after = grammar.statistics()
    assert after.compiles - before.compiles == 1
    assert after.cache_hits - before.cache_hits == 5
    assert after.requests["json"] - before.requests.get("json", 0) == 6
    assert after.compile_buckets[-1] == after.compiles


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutputs(regex="a("), "regex"),
        (StructuredOutputs(grammar='root ::= "a" |'), "grammar"),
        (StructuredOutputs(grammar='start ::= "a"'), "grammar"),  # no root rule
        # Neither backend enforces uniqueItems: refused, never silently ignored.
        (StructuredOutputs(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
        (StructuredOutputs(json={"not": {"type": "string"}}), "not"),
    ],
)
def test_what_no_backend_can_enforce_is_the_requests_error(
    grammar: GrammarBackend, spec: StructuredOutputs, message: str
) -> None:
    with pytest.raises(InvalidParamError, match=message) as refused:
        grammar.compile(spec)
    assert refused.value.param == "structured_outputs"


def test_auto_falls_back_to_llguidance_where_xgrammar_refuses(
    model: Path, grammar: GrammarBackend
) -> None:
    # xgrammar (strict: no properties beyond those listed) refuses a minimum of properties
    # it cannot reach; llguidance takes it.
    spec = StructuredOutputs(json={"type": "object", "minProperties": 2})
    assert grammar.compile(spec).backend == "guidance"
    assert grammar.compile(StructuredOutputs(regex="ab?")).backend == "xgrammar"
    from engine.models.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(model)
    only_xgrammar = GrammarBackend(tok, vocab_size=tok.vocab_size, stop_token_ids=(0,),
                                   backend="xgrammar")
    with pytest.raises(InvalidParamError, match="minItems|minProperties|xgrammar"):
        only_xgrammar.compile(spec)


# -- generation ----------------------------------------------------------------------------


@pytest.fixture
async def eng(model: Path) -> Any:
    async with engine.open_engine(str(model), **ENGINE_OPTIONS) as running:
        yield running


async def test_every_output_validates_against_its_json_schema(eng: Any) -> None:
    for name, schema in SCHEMAS.items():
        results = await outputs_for(eng, StructuredOutputs(json=schema))
        validator = jsonschema.Draft202012Validator(schema)
        for text, reason in results:
            assert reason == "stop", (name, text)
            validator.validate(json.loads(text))
        assert len({text for text, _ in results}) > 4, name  # really sampled, not one path
    await wait_idle(eng)


async def test_json_object_outputs_parse_as_objects(eng: Any) -> None:
    # The tiny model rarely closes a free string; a bias towards quotes and braces (which
    # the grammar still polices) keeps the documents short enough to finish.
    bias = {i: 4.0 for i in range(eng.tokenizer.vocab_size)
            if eng.tokenizer.decode([i]) in ('"', '}', '"}', '":', '{"')}
    results = await outputs_for(eng, StructuredOutputs(json_object=True), logit_bias=bias,
                                max_tokens=400)
    for text, reason in results:
        assert reason == "stop", text
        assert isinstance(json.loads(text), dict)


async def test_regex_outputs_fullmatch(eng: Any) -> None:
    pattern = r"(yes|no), [a-z]{2,5} [0-9]{1,3}(\.[0-9])?"
    for text, reason in await outputs_for(eng, StructuredOutputs(regex=pattern)):
        assert reason == "stop"
        assert re.fullmatch(pattern, text), text


async def test_choice_outputs_are_one_of_the_choices(eng: Any) -> None:
    choices = ["positive", "negative", 'a "quoted" one', "back\\slash"]
    seen = set()
    for text, reason in await outputs_for(eng, StructuredOutputs(choice=choices)):
        assert reason == "stop"
        assert text in choices
        seen.add(text)
    assert len(seen) > 1


# Balanced parentheses around a word: not a regular language, so the check below is a
# small recursive reader of its own.
PARENS_GRAMMAR = r"""
root ::= group
group ::= "(" (group | word) ")" | word
word ::= [a-c] [a-c]? [a-c]?
"""


def parses_parens(text: str) -> bool:
    depth = 0
    while text.startswith("("):
        depth, text = depth + 1, text[1:]
    if not text.endswith(")" * depth):
        return False
    inner = text[: len(text) - depth]
    return re.fullmatch("[a-c]{1,3}", inner) is not None


async def test_ebnf_grammar_outputs_parse_with_that_grammar(eng: Any) -> None:
    depths = set()
    for text, reason in await outputs_for(eng, StructuredOutputs(grammar=PARENS_GRAMMAR)):
        assert reason == "stop"
        assert parses_parens(text), text
        depths.add(text.count("("))
    assert len(depths) > 1  # nested and flat both occur


async def test_each_of_n_samples_follows_its_own_grammar(eng: Any) -> None:
    spec = StructuredOutputs(json=SCHEMAS["enums and const"])
    outs = await collect(eng, "Go:", SamplingParams(n=6, seed=3, max_tokens=MAX_TOKENS,
                                                    structured_outputs=spec))
    texts = ["".join(o.text for o in outs if o.index == i) for i in range(6)]
    for text in texts:
        jsonschema.validate(json.loads(text), spec.schema)
    assert len(set(texts)) > 1


async def test_max_tokens_still_ends_a_constrained_sample_with_length(eng: Any) -> None:
    spec = StructuredOutputs(json=SCHEMAS["nested objects, required and optional keys"])
    outs = await collect(eng, "x", SamplingParams(max_tokens=3, seed=1, structured_outputs=spec))
    assert outs[-1].finish_reason == "length"
    assert sum(len(o.token_ids) for o in outs) == 3


async def test_logprobs_of_a_constrained_sample_list_only_allowed_tokens(eng: Any) -> None:
    spec = StructuredOutputs(choice=["positive", "negative"])
    outs = await collect(eng, "x", SamplingParams(seed=2, max_tokens=20, logprobs=5,
                                                  structured_outputs=spec))
    entries = [lp for o in outs for lp in o.logprobs]
    assert entries
    for entry in entries:
        assert all(v > float("-inf") for _, v in entry.top)


async def test_a_grammar_leaving_nothing_to_sample_fails_only_that_request(eng: Any) -> None:
    # After "ok" the grammar allows only EOS, which min_tokens forbids: nothing is left.
    # (A JSON schema: admission bounds a choice's or a regex's length, not a schema's.)
    spec = StructuredOutputs(json={"enum": ["ok"]})
    free = greedy(8)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(collect, eng, [5, 6, 7], free)
        with pytest.raises(RequestFailedError, match="complete after .* min_tokens asks for 10"):
            await collect(eng, "x", SamplingParams(min_tokens=10, max_tokens=20,
                                                   structured_outputs=spec))
    assert len(token_ids(await collect(eng, [5, 6, 7], free))) == 8
    await wait_idle(eng)


async def test_min_tokens_beyond_a_bounded_regex_or_choice_is_refused_at_submit(eng: Any) -> None:
    # Issue 27: guided_regex "a" with min_tokens 5 was a 500 "no token can be sampled".
    for spec in (StructuredOutputs(regex="a"), StructuredOutputs(choice=["ok", "no"])):
        with pytest.raises(InvalidParamError) as bad:
            await eng.submit("x", SamplingParams(min_tokens=5, structured_outputs=spec))
        assert bad.value.param == "min_tokens"
    # Within the bound it runs ("a{1,8}" can take 8 one-byte tokens).
    outs = await collect(eng, "x", SamplingParams(min_tokens=2, max_tokens=12, seed=0,
                                                  structured_outputs=StructuredOutputs(regex="a{1,8}")))
    assert re.fullmatch("a{2,8}", output_text(outs)) and outs[-1].finish_reason == "stop"
    await wait_idle(eng)


async def test_an_invalid_constraint_is_refused_at_submit_and_the_engine_serves_on(eng: Any) -> None:
    with pytest.raises(InvalidParamError) as bad:
        await eng.submit("x", SamplingParams(structured_outputs=StructuredOutputs(regex="[")))
    assert bad.value.param == "structured_outputs"
    text, reason = (await outputs_for(eng, StructuredOutputs(regex="[ab]{3}"), seeds=range(1)))[0]
    assert reason == "stop" and re.fullmatch("[ab]{3}", text)


# -- mixed batches -------------------------------------------------------------------------


async def _free_tokens_beside_constrained(eng: Any, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy free requests run together with as many constrained ones."""
    free: list[list[int]] = [[] for _ in prompts]
    spec = StructuredOutputs(json=SCHEMAS["arrays with min and max items"])

    async def run_free(i: int) -> None:
        free[i] = token_ids(await collect(eng, prompts[i], greedy(12)))

    async def run_constrained(i: int) -> None:
        # 60 tokens: a 50-token prompt and its output fit the small pool below.
        outs = await collect(eng, prompts[i], constrained(spec, seed=i, max_tokens=60))
        if outs[-1].finish_reason == "stop":
            jsonschema.validate(json.loads("".join(o.text for o in outs)), spec.schema)

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(run_constrained, i)
            nursery.start_soon(run_free, i)
    return free


@pytest.mark.parametrize("async_scheduling", [True, False])
async def test_free_requests_beside_constrained_ones_give_the_tokens_they_give_alone(
    model: Path, async_scheduling: bool
) -> None:
    prompts = random_prompts(8, vocab=300, lo=20, hi=50, seed=4)
    options = dict(ENGINE_OPTIONS, async_scheduling=async_scheduling)
    async with engine.open_engine(str(model), **options) as eng:
        alone = [token_ids(await collect(eng, p, greedy(12))) for p in prompts]
        together = await _free_tokens_beside_constrained(eng, prompts)
        await wait_idle(eng)
    assert together == alone
    # A pool too small for all 16 at once: requests are preempted and recomputed, the
    # constrained ones keep their matchers across it.
    small = dict(options, kv_cache_memory=10 * 16 * 512)
    async with engine.open_engine(str(model), **small) as eng:
        after_preemption = await _free_tokens_beside_constrained(eng, prompts)
        stats = await wait_idle(eng)
    assert stats.preemptions > 0
    assert after_preemption == alone


# -- aborts, stop strings and the prefix cache ---------------------------------------------


def held_matchers(eng: Any) -> dict[str, Any]:
    """Sample id -> the matcher the model runner keeps for it (None before its first
    sampling step). Copied in one C call: the executor's thread may change the dict."""
    return {sid: state.matcher for sid, state in dict(eng._parts.runner._requests).items()}


async def wait_matchers_freed(eng: Any) -> engine.EngineStatistics:
    """Idle, and the runner has forgotten every sample (the scheduler tells it in a plan
    of its own once the last one finished)."""
    stats = await wait_idle(eng)
    await wait_until(lambda: not held_matchers(eng))
    return stats


@pytest.mark.parametrize("async_scheduling", [True, False])
async def test_an_aborted_constrained_request_frees_its_matchers_and_blocks(
    model: Path, async_scheduling: bool
) -> None:
    # 100 letters: far from the grammar's end when the abort comes.
    spec = StructuredOutputs(regex="[a-z]{100}")
    options = dict(ENGINE_OPTIONS, async_scheduling=async_scheduling)
    async with engine.open_engine(str(model), **options) as eng:
        stream = await eng.submit("Answer:", constrained(spec, seed=1, n=2), request_id="victim")
        outputs: list[Any] = []
        held: dict[str, Any] = {}
        async with stream:
            async for out in stream:
                outputs.append(out)
                if not held and {o.index for o in outputs} == {0, 1}:
                    held = held_matchers(eng)  # each sample drew a token: each has a matcher
                    eng.abort("victim")
        assert {re.sub(r"#\d+", "", sample) for sample in held} == {"victim.0", "victim.1"}
        assert None not in held.values()
        stats = await wait_matchers_freed(eng)
        assert stats.kv_blocks_free == stats.kv_blocks_total
        assert [o.finish_reason for o in outputs if o.finished] == ["abort", "abort"]
        for i in range(2):
            assert re.fullmatch("[a-z]{1,99}", output_text(outputs, i))
        # The engine serves constrained requests on, and those free their matchers too.
        for answer, reason in await outputs_for(eng, StructuredOutputs(regex="[ab]{3}"),
                                                seeds=range(4)):
            assert reason == "stop" and re.fullmatch("[ab]{3}", answer)
        await wait_matchers_freed(eng)


@pytest.mark.parametrize(
    ("spec", "stop"),
    [
        # The stop string would come in the middle of the grammar's language...
        (StructuredOutputs(regex="(yes|no), [a-z]{2,5}"), ","),
        # ... or with the grammar's last token, where only EOS would be left.
        (StructuredOutputs(choice=["positive", "negative"]), "ive"),
    ],
)
async def test_a_stop_string_beside_a_constraint_is_refused_before_anything_runs(
    eng: Any, spec: StructuredOutputs, stop: str
) -> None:
    # It used to end the output as "yes" or "posit" with finish_reason "stop", text the
    # constraint does not match (issue 28).
    with pytest.raises(InvalidParamError) as info:
        await eng.submit("Answer:", SamplingParams(max_tokens=MAX_TOKENS, stop=[stop])
                         .replace(structured_outputs=spec))
    assert info.value.param == "stop"
    stats = await wait_matchers_freed(eng)
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == 0


async def test_a_constrained_request_hitting_the_prefix_cache_gives_the_same_valid_output(
    eng: Any,
) -> None:
    prompt = random_prompts(1, vocab=300, lo=70, hi=70, seed=5)[0]  # four full blocks and more
    spec = StructuredOutputs(json=SCHEMAS["enums and const"])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=spec)
    first = await collect(eng, prompt, params)
    before = eng.statistics()
    second = await collect(eng, prompt, params)
    after = await wait_matchers_freed(eng)
    assert after.prefix_cache_hits - before.prefix_cache_hits == 64
    for outs in (first, second):
        assert outs[-1].finish_reason == "stop"
        jsonschema.validate(json.loads(output_text(outs)), spec.schema)
    assert token_ids(second) == token_ids(first)
