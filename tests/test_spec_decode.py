"""Speculative decoding (prompt lookup and Predicted Outputs): the output is the target
model's, greedy token for token and sampled in distribution, and no block is left behind."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import trio
from engine_helpers import collect, greedy, text, tiny_model, token_ids, wait_idle

import engine
from engine.config import EngineConfig
from engine.core.request import RequestStatus
from engine.core.spec import propose
from engine.errors import ConfigError
from engine.params import SamplingParams

OPTIONS: dict[str, Any] = dict(
    dtype="float32", max_num_seqs=32, max_num_batched_tokens=96, block_size=16,
    kv_cache_memory=8 * 1024 * 1024,
)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory)


def _copying_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase (so prompt lookup has something to propose), some
    random ones, of lengths that cross block edges."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        phrase = [rng.randrange(3, 300) for _ in range(rng.randint(3, 12))]
        body = phrase * rng.randint(2, 5) if i % 4 else [rng.randrange(3, 300) for _ in range(40)]
        prompts.append(body[: rng.randint(5, 70)])
    return prompts


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match() -> None:
    ctx = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    # The suffix 1 2 3 last occurred at 5 (not the suffix itself): 7 8 5 follows.
    assert propose(ctx, None, 3, 3, 1) == ((7, 8, 5), 8)
    assert propose(ctx, None, 10, 3, 1)[0] == (7, 8, 5, 1, 2, 3)
    assert propose([4, 5, 6], None, 3, 3, 1) == ((), -1)  # no earlier match
    assert propose([5, 6, 5], None, 2, 3, 2)[0] == ()  # only n=1 would match; min is 2
    assert propose([5, 6, 5], None, 2, 3, 1)[0] == (6, 5)
    # A prediction as the haystack: the continuation after the context's suffix in it,
    # the earliest one from where the last proposal started.
    assert propose([1, 2, 3, 4], [9, 3, 4, 10, 11, 12], 2, 3, 1, after=0) == ((10, 11), 3)
    prediction = [7, 1, 8, 1, 9, 1, 10]
    assert propose([5, 1], prediction, 2, 3, 1, after=0) == ((8, 1), 2)
    assert propose([5, 1], prediction, 2, 3, 1, after=3) == ((9, 1), 4)
    assert propose([5, 1], prediction, 2, 3, 1, after=7) == ((10,), 6)  # none later: the latest
    assert propose([1, 2], [2], 2, 3, 1)[0] == ()  # matched at its end: nothing follows


def test_speculative_config_is_checked_at_config_time_naming_the_field() -> None:
    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert config.speculative is not None
    assert (config.speculative.num_speculative_tokens, config.speculative.prompt_lookup_max,
            config.speculative.prompt_lookup_min) == (3, 4, 1)
    assert EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 2, '
                        '"prompt_lookup_min": 2}').speculative.prompt_lookup_max == 2
    for bad in ("{", "[1]", '{"method": "medusa", "num_speculative_tokens": 2}',
                '{"method": "ngram"}', '{"method": "ngram", "num_speculative_tokens": 0}',
                '{"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}',
                '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, '
                '"prompt_lookup_max": 2}',
                '{"method": "draft_model", "num_speculative_tokens": 2}',
                '{"method": "draft_model", "model": "x", "num_speculative_tokens": 2, '
                '"prompt_lookup_max": 2}',
                '{"method": "ngram", "model": "x", "num_speculative_tokens": 2}'):
        with pytest.raises(ConfigError) as info:
            EngineConfig(speculative_config=bad)
        assert info.value.field == "speculative_config"


async def _run_all(eng: Any, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[Any]]:
    results: list[list[Any]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        results[i] = await collect(eng, prompts[i], params[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return results


@pytest.mark.parametrize(("async_scheduling", "count", "max_tokens"), [(False, 6, 128), (True, 3, 32)])
async def test_greedy_output_is_the_same_with_and_without_prompt_lookup(
    model: Path, async_scheduling: bool, count: int, max_tokens: int
) -> None:
    prompts = _copying_prompts(count, seed=3)
    # Mixed in one batch: some requests speculate, a structured-output-free greedy one with
    # logprobs, one with penalties and min_tokens (applied per verified position).
    params = [greedy(max_tokens, logprobs=2) if i % 5 == 0 else
              greedy(max_tokens, repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=20)
              if i % 5 == 1 else greedy(max_tokens) for i in range(len(prompts))]
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        plain = await _run_all(eng, prompts, params)
    async with engine.open_engine(str(model), **OPTIONS, speculative_config=NGRAM,
                                  async_scheduling=async_scheduling) as eng:
        spec = await _run_all(eng, prompts, params)
        stats = await wait_idle(eng)
    for a, b in zip(plain, spec, strict=True):
        assert token_ids(b) == token_ids(a)
        lp_a = [(t.token_id, round(t.logprob, 3)) for o in a if o.logprobs for t in o.logprobs]
        lp_b = [(t.token_id, round(t.logprob, 3)) for o in b if o.logprobs for t in o.logprobs]
        assert lp_b == lp_a
    assert stats.spec_drafts > 0 and 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens
    assert sum(stats.spec_accepted_per_pos) == stats.spec_accepted_tokens
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_stop_strings_stop_tokens_and_aborts_mid_proposal_leave_no_block(model: Path) -> None:
    prompts = _copying_prompts(4, seed=5)
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        full = await _run_all(eng, prompts, [greedy(32)] * len(prompts))
    async with engine.open_engine(str(model), **OPTIONS, speculative_config=NGRAM) as eng:
        for p, f in zip(prompts, full, strict=True):
            ids, whole = token_ids(f), text(f)
            stop_id = ids[len(ids) // 2]
            out = await collect(eng, p, greedy(32, stop_token_ids=[stop_id]))
            assert token_ids(out) == ids[: ids.index(stop_id) + 1]
            stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
            if stop.strip():
                out = await collect(eng, p, greedy(32, stop=[stop]))
                assert text(out) == whole[: whole.index(stop)]
        # Aborts while proposals are in flight.
        with trio.move_on_after(0.3):
            await _run_all(eng, prompts[:2], [greedy(400)] * 2)
        stats = await wait_idle(eng)
    assert stats.spec_drafts > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_n_samples_and_a_grammar_request_beside_speculating_ones(model: Path) -> None:
    import re

    from engine.structured.spec import StructuredOutputs

    prompts = _copying_prompts(4, seed=7)
    seeded = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=32, ignore_eos=True)
    constrained = SamplingParams(temperature=1.0, seed=5, max_tokens=24,
                                 structured_outputs=StructuredOutputs(regex="(ab|cd){3,6}"))
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        plain = await collect(eng, prompts[1], seeded)
    async with engine.open_engine(str(model), **OPTIONS, speculative_config=NGRAM) as eng:
        spec, grammar, *_ = await _run_all(eng, [prompts[1], prompts[2], *prompts],
                                           [seeded, constrained, *[greedy(32)] * len(prompts)])
        stats = await wait_idle(eng)
    # Seeded samples: each position draws with the same per-step seed as without speculation.
    for i in range(3):
        assert len(token_ids(spec, i)) == 32
        assert token_ids(spec, i) == token_ids(plain, i)
    # The grammar request, beside requests that speculate, keeps its grammar.
    assert re.fullmatch("(ab|cd){3,6}", text(grammar)), text(grammar)
    assert stats.spec_drafts > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_preemption_with_proposals_gives_the_same_tokens_and_frees_every_block(model: Path) -> None:
    """A pool far too small for all requests at once: the newest are preempted (some with
    a proposal just verified) and recomputed, and still give the plain engine's tokens."""
    prompts = _copying_prompts(6, seed=9)
    small = dict(OPTIONS, kv_cache_memory=20 * 512 * 16)  # 20 blocks of 16 tokens
    async with engine.open_engine(str(model), **small) as eng:
        plain = await _run_all(eng, prompts, [greedy(64)] * len(prompts))
    async with engine.open_engine(str(model), **small, speculative_config=NGRAM) as eng:
        spec = await _run_all(eng, prompts, [greedy(64)] * len(prompts))
        stats = await wait_idle(eng)
    assert [token_ids(o) for o in spec] == [token_ids(o) for o in plain]
    assert stats.preemptions > 0 and stats.spec_drafts > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total


# Bounded documents (no free whitespace: xgrammar's compact JSON), so greedy finishes.
GRAMMAR_SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "size": {"enum": [1, 2, 3]}, "kind": {"const": "shirt"}},
     "required": ["color", "size", "kind"]},
    {"type": "object", "properties": {"ids": {"type": "array", "minItems": 2, "maxItems": 5,
                                              "items": {"type": "integer", "minimum": 0, "maximum": 99}},
                                      "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
     "required": ["ids", "flags"]},
    {"type": "array", "minItems": 3, "maxItems": 6,
     "items": {"type": "object", "properties": {"a": {"enum": ["x", "y"]}, "b": {"type": "boolean"}},
               "required": ["a", "b"]}},
]


async def test_structured_output_speculates_and_gives_the_plain_outputs(model: Path) -> None:
    """Requests under a JSON schema (and a regex) speculate with prompt lookup: the part of
    each proposal the grammar takes is verified, every row masked with the grammar's state
    after the proposal tokens before it, and the matcher advances over the kept tokens only.
    Greedy and seeded outputs equal the plain engine's, token for token, and validate under
    ``jsonschema`` (the regex ones under ``re.fullmatch``)."""
    import json
    import re

    import jsonschema

    from engine.structured.spec import StructuredOutputs

    # The prompts quote documents of each schema, so prompt lookup proposes from them.
    examples = ['{"color":"red","size":2,"kind":"shirt"} {"color":"blue","size":1,"kind":"shirt"}',
                '{"ids":[1,2,3],"flags":[true,false]} {"ids":[4,5],"flags":[]}',
                '[{"a":"x","b":true},{"a":"y","b":false},{"a":"x","b":false}]']
    regex = "(ab|cd){3,8}"
    prompts: list[Any] = []
    params: list[SamplingParams] = []
    for schema, example in zip(GRAMMAR_SCHEMAS, examples, strict=True):
        for seed in (None, 1, 2):
            prompts.append(f"Examples: {example}\nAnother one:")
            params.append(SamplingParams(
                temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=96,
                structured_outputs=StructuredOutputs(json=schema)))
    for seed in (None, 3):
        prompts.append("abababcdcdab cdabcd:")
        params.append(SamplingParams(temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=24,
                                     structured_outputs=StructuredOutputs(regex=regex)))
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        plain = await _run_all(eng, prompts, params)
    async with engine.open_engine(str(model), **OPTIONS, speculative_config=NGRAM) as eng:
        spec = await _run_all(eng, prompts, params)
        stats = await wait_idle(eng)
    for i, (a, b) in enumerate(zip(plain, spec, strict=True)):
        assert token_ids(b) == token_ids(a), i
        assert b[-1].finish_reason == "stop", (i, text(b))
        if i < 3 * len(GRAMMAR_SCHEMAS):
            jsonschema.validate(json.loads(text(b)), GRAMMAR_SCHEMAS[i // 3])
        else:
            assert re.fullmatch(regex, text(b)), text(b)
    assert stats.spec_drafts > 0 and stats.spec_accepted_tokens > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_a_matcher_checks_a_proposal_without_moving_and_rolls_back(model: Path, backend: str) -> None:
    """``Matcher.valid_prefix`` counts the proposal tokens the grammar takes (up to a refused
    one, and none from a stop token on) and leaves the matcher where it was (same mask);
    ``rollback`` undoes accepted tokens, a stop token's end included."""
    import torch

    from engine.models.tokenizer import Tokenizer
    from engine.structured import GrammarBackend
    from engine.structured.bitmask import bitmask_words
    from engine.structured.spec import StructuredOutputs

    tok = Tokenizer.from_folder(model)
    eos = tuple(tok.eos_token_ids)
    grammar = GrammarBackend(tok, vocab_size=tok.vocab_size, stop_token_ids=eos, backend=backend)
    spec = StructuredOutputs(regex="(ab|cd){2,3}")
    good = tok.encode("abcd", add_special_tokens=False)
    refused = tok.encode("x", add_special_tokens=False)[0]

    def mask(m: Any) -> torch.Tensor:
        row = torch.zeros((1, bitmask_words(tok.vocab_size)), dtype=torch.int32)
        m.fill(row, 0)
        return row

    m = grammar.matcher(spec)
    start = mask(m)
    assert m.valid_prefix([*good, refused, *good]) == len(good)
    assert m.valid_prefix([*good, eos[0], *good]) == len(good)  # nothing counted from a stop on
    assert m.valid_prefix([refused]) == 0
    assert m.accepted == 0 and torch.equal(mask(m), start)
    for t in good:
        assert m.accept(t)
    after = mask(m)
    assert not torch.equal(after, start)  # "abcd" is complete: EOS is allowed now
    assert m.accept(eos[0]) and m.ended
    m.rollback(1)
    assert not m.ended and m.complete() and torch.equal(mask(m), after)
    m.rollback(len(good))
    assert m.accepted == 0 and torch.equal(mask(m), start)
    with pytest.raises(ValueError):
        m.rollback(1)


# --- the prefix cache holds only verified tokens (the pure scheduler and block pool) -------


def _spec_scheduler(k: int) -> tuple[Any, Any]:
    from engine.core.block_pool import BlockPool
    from engine.core.scheduler import Scheduler, SchedulerConfig

    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
                             max_model_len=256, num_kv_blocks=32, num_speculative_tokens=k,
                             prompt_lookup_max=2, prompt_lookup_min=1)
    return Scheduler(config), BlockPool(32, 4, enable_prefix_caching=True)


def _step(sched: Any, pool: Any, tokens: list[int]) -> tuple[Any, Any]:
    from engine.core.scheduler import run_with_pool
    from engine.messages import SampledToken, StepResult

    plan = run_with_pool(sched.schedule(), pool)
    (chunk,) = plan.chunks
    result = StepResult(plan.step_id, tuple(SampledToken(chunk.sample_id, t, 0.0, ()) for t in tokens), 0.0)
    update = sched.update_from_output(plan, result)
    for call in update.allocator_calls:
        pool.handle(call)
    return chunk, update


def test_rejected_proposal_tokens_are_never_cached_and_are_recomputed() -> None:
    from engine.messages import CacheBlocks, SchedulerRequest

    sched, pool = _spec_scheduler(3)
    prompt = (7, 8, 9, 10, 7, 8)
    sched.add_request(SchedulerRequest("a", prompt, SamplingParams(temperature=0, max_tokens=20),
                                       (), 20, 0, 0.0, None, None))
    chunk, _ = _step(sched, pool, [9])  # the prompt; the model draws 9
    assert (chunk.start, chunk.num_tokens, chunk.draft_token_ids) == (0, 6, ())
    # Context 7 8 9 10 7 8 9: "8 9" occurred at 1, so 10 7 8 is proposed at positions 7..9.
    chunk, update = _step(sched, pool, [11])  # the model disagrees at once
    assert (chunk.start, chunk.num_tokens, chunk.draft_token_ids) == (6, 4, (10, 7, 8))
    req = sched.get_request("a")
    # Verified: position 6 (token 9). Block [4, 8) would hold the rejected 10: not cached.
    assert req.num_computed_tokens == 7 and req.output_token_ids == [9, 11]
    assert not [c for c in update.allocator_calls if isinstance(c, CacheBlocks)]
    chunk, _ = _step(sched, pool, [12])  # no earlier "9 11" or "11": a plain decode
    assert (chunk.start, chunk.num_tokens, chunk.draft_token_ids) == (7, 1, ())
    _step(sched, pool, [7])
    # Context ... 9 11 12 7: "12 7" never occurred, "7" last at 4: 8 9 11 is proposed.
    chunk, update = _step(sched, pool, [8, 9, 11, 5])  # all accepted, then the model's 5
    assert (chunk.start, chunk.draft_token_ids) == (9, (8, 9, 11))
    assert req.output_token_ids == [9, 11, 12, 7, 8, 9, 11, 5]
    assert req.num_computed_tokens == 6 + 8 - 1  # every token but the last drawn
    cached = [c.token_ids for c in update.allocator_calls if isinstance(c, CacheBlocks)]
    known = prompt + tuple(req.output_token_ids)
    assert cached == [known[8:12]]  # block [8, 12); [4, 8) went in when 11 was computed
    for call in sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED):
        pool.handle(call)
    assert pool.statistics().num_free_blocks == 32


def test_a_stop_token_inside_an_accepted_proposal_ends_it_there_and_frees_every_block() -> None:
    """Stop tokens and EOS end the output where they fall inside a verified proposal: the
    tokens after them (accepted by the model or not) are never output, only verified
    tokens' blocks are cached, and every block is free after the finish; min_tokens keeps
    a stop token inside the proposal from ending it early."""
    from engine.messages import CacheBlocks, SchedulerRequest

    stop7 = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[7])
    plain = SamplingParams(temperature=0, max_tokens=20)
    under_min = SamplingParams(temperature=0, max_tokens=20, min_tokens=4, stop_token_ids=[7])
    cases = [  # prompt, params, the model's draws, the delta's tokens, finish
        ((7, 8, 9, 10, 7, 8), stop7, [10, 7, 8, 3], [10, 7], "stop"),
        ((7, 8, 9, 10, 7, 8), plain, [10, 7, 8, 3], [10, 7, 8, 3], None),
        ((7, 8, 9, 2, 7, 8), plain, [2, 7, 8, 3], [2], "stop"),  # 2: EOS
        ((7, 8, 9, 10, 7, 8), under_min, [10, 7, 8, 3], [10, 7, 8, 3], None),
    ]
    for prompt, params, draws, out, reason in cases:
        sched, pool = _spec_scheduler(3)
        sched.add_request(SchedulerRequest("a", prompt, params, (2,), 20, 0, 0.0, None, None))
        _step(sched, pool, [9])
        chunk, update = _step(sched, pool, draws)  # "8 9" occurred at 1: its 3 followers proposed
        assert chunk.draft_token_ids == prompt[3:]
        (delta,) = update.deltas
        assert (list(delta.token_ids), delta.finish_reason) == (out, reason)
        cached = [t for c in update.allocator_calls if isinstance(c, CacheBlocks) for t in c.token_ids]
        verified = (*prompt, 9, *out)
        assert tuple(cached) == verified[4 : 4 + len(cached)]
        # Every full block of verified tokens: the prompt, 9 and the accepted proposal tokens
        # (the last output token is drawn, its KV not computed yet).
        assert len(cached) == (6 + len(out)) // 4 * 4 - 4
        for call in sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED):
            pool.handle(call)
        assert pool.statistics().num_free_blocks == 32


def test_an_abort_while_a_proposal_is_verified_drops_its_tokens_and_frees_every_block() -> None:
    from engine.core.scheduler import run_with_pool
    from engine.messages import SampledToken, SchedulerRequest, StepResult

    sched, pool = _spec_scheduler(3)
    sched.add_request(SchedulerRequest("a", (7, 8, 9, 10, 7, 8), SamplingParams(temperature=0, max_tokens=20),
                                       (), 20, 0, 0.0, None, None))
    _step(sched, pool, [9])
    plan = run_with_pool(sched.schedule(), pool)  # the verification step, in flight
    (chunk,) = plan.chunks
    assert chunk.draft_token_ids == (10, 7, 8)
    for call in sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED):
        pool.handle(call)
    result = StepResult(plan.step_id, tuple(SampledToken("a", t, 0.0, ()) for t in (10, 7, 8, 5)), 0.0)
    update = sched.update_from_output(plan, result)
    assert update.deltas == () and update.allocator_calls == ()
    assert pool.statistics().num_free_blocks == 32
    assert not sched.has_work or run_with_pool(sched.schedule(), pool).finished_ids == ("a",)


# --- sampled outputs follow the target distribution -----------------------------------------

# Upper 0.1% points of the chi-square distribution with 3 degrees of freedom (4 categories).
CHI2_3DF_999 = 16.27


@pytest.mark.usefixtures("one_thread")
def test_sampled_tokens_under_verification_follow_the_target_distribution(tmp_path: Path) -> None:
    """4000 seeded draws of the first two output tokens, each verified against a proposal
    of the second most likely first token: the first token's frequencies match the target
    model's distribution (transformers' logits, top-4 at temperature 1), and so do the second
    token's among the draws that accepted the proposal (the target's distribution after it).
    Chi-square at the 0.1% level, 3 degrees of freedom. Accepting the proposal blindly, or
    resampling wrongly after a rejection, moves the first token's frequencies far off."""
    import json

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from engine.messages import NewRequest, ScheduledChunk, StepPlan
    from engine.models.config import ModelConfig
    from engine.models.testing import write_tiny_model
    from engine.ops import get_ops
    from engine.runner.model_runner import ModelRunner

    folder = write_tiny_model(tmp_path / "llama", "llama")
    prompt = (5, 17, 42, 99, 7, 123)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def target(tokens: tuple[int, ...]) -> dict[int, float]:
        with torch.no_grad():
            logits = hf(torch.tensor([tokens])).logits[0, -1]
        top = torch.topk(logits, 4)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist(), strict=True))

    p0 = target(prompt)
    draft = sorted(p0, key=p0.get)[-2]
    p1 = target((*prompt, draft))

    loaded = type("Loaded", (), {})()
    loaded.config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    loaded.weights = load_file(str(folder / "model.safetensors"))
    loaded.dtype = torch.float32
    batch = 100
    runner = ModelRunner(loaded, device="cpu", ops=get_ops("torch"), num_blocks=4, block_size=4,
                         max_num_batched_tokens=batch * 7, max_num_seqs=batch)
    first: dict[int, int] = {}
    second: dict[int, int] = {}
    trials = 4000
    done: tuple[str, ...] = ()
    for step in range(trials // batch):
        ids = [f"r{step}-{i}" for i in range(batch)]
        # Every trial computes the same positions: one shared table, identical writes.
        news = tuple(NewRequest(r, prompt, SamplingParams(temperature=1.0, top_k=4, max_tokens=4,
                                                          seed=step * batch + i, ignore_eos=True), ())
                     for i, r in enumerate(ids))
        chunks = tuple(ScheduledChunk(r, 0, 7, (0, 1), True, (draft,)) for r in ids)
        result = runner.execute(StepPlan(step, news, chunks, done))
        done = tuple(ids)
        assert not result.failed
        drawn: dict[str, list[int]] = {}
        for s in result.sampled:
            drawn.setdefault(s.sample_id, []).append(s.token_id)
        for tokens in drawn.values():
            assert len(tokens) == (2 if tokens[0] == draft else 1)
            first[tokens[0]] = first.get(tokens[0], 0) + 1
            if tokens[0] == draft:
                second[tokens[1]] = second.get(tokens[1], 0) + 1

    def chi2(counts: dict[int, int], p: dict[int, float]) -> float:
        assert set(counts) <= set(p)
        n = sum(counts.values())
        return sum((counts.get(t, 0) - n * q) ** 2 / (n * q) for t, q in p.items())

    assert sum(second.values()) > 400  # the proposal was accepted often enough to test
    assert chi2(first, p0) < CHI2_3DF_999, (first, p0)
    assert chi2(second, p1) < CHI2_3DF_999, (second, p1)


# --- OpenAI Predicted Outputs over HTTP ------------------------------------------------------


def test_chat_prediction_proposes_tokens_and_usage_counts_them(model: Path) -> None:
    import openai
    from http_server import ServerThread

    import engine.api

    def open_engine() -> Any:
        return engine.api.open_engine(str(model), served_model_name="tiny", max_model_len=256,
                                      kv_cache_memory=8 * 2**20)

    ask = [{"role": "user", "content": "Rewrite: the cat sat on the mat, the cat sat."}]
    greedy_chat = {"model": "tiny", "messages": ask, "temperature": 0, "max_tokens": 40,
                   "extra_body": {"ignore_eos": True}}
    with ServerThread(open_engine) as srv, openai.OpenAI(
            base_url=srv.base_url + "/v1", api_key="unused", max_retries=0) as client:
        plain = client.chat.completions.create(**greedy_chat)
        answer = plain.choices[0].message.content
        assert plain.usage.completion_tokens_details is None  # no prediction: no counts
        predicted = client.chat.completions.create(
            **greedy_chat, prediction={"type": "content", "content": answer})
        details = predicted.usage.completion_tokens_details
        # The answer is the model's; the prediction only saved forwards.
        assert predicted.choices[0].message.content == answer
        assert details.accepted_prediction_tokens > 10
        assert details.rejected_prediction_tokens >= 0
        wrong = client.chat.completions.create(
            **greedy_chat, prediction={"type": "content", "content": [
                {"type": "text", "text": "Something else entirely, "}, {"type": "text", "text": answer[::-1]}]})
        assert wrong.choices[0].message.content == answer
        chunks = list(client.chat.completions.create(
            **greedy_chat, stream=True, stream_options={"include_usage": True},
            prediction={"type": "content", "content": answer}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
        assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens == \
            details.accepted_prediction_tokens
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**greedy_chat, prediction={"type": "text", "content": "x"})
        assert info.value.body["param"] == "prediction"


def _bench_workloads() -> dict[str, Any]:
    """bench/spec.py's chat workloads (the code one left the plain output before row-wise
    verification attention)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "spec.py"
    module_spec = importlib.util.spec_from_file_location("bench_spec", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.WORKLOADS


@pytest.mark.slow
async def test_smollm2_quantized_greedy_is_the_same_with_prompt_lookup_and_with_a_prediction() -> None:
    """SmolLM2 as served by default (bf16, the GGUF's Q4_1 blocks kept, the C kernels):
    greedy over 128 tokens with prompt lookup and with a prediction equals plain greedy,
    token for token, on bench/spec.py's workloads and a third chat. The requests run one
    at a time, as the bench does: a step of 16 rows or more multiplies the quantized
    weights on the AMX-BF16 path, whose numbers differ from the int8 path's (see
    tests/test_batch_invariance.py), so batches of different widths may round apart.
    With the verification rows attended in the padded SDPA (as before issue 24's fix) the
    prompt-lookup output leaves the plain one at the code workload's 44th token."""
    workloads = _bench_workloads()
    code = ("def area(width, height):\n    return width * height\n\n\n"
            "def perimeter(width, height):\n    return 2 * (width + height)\n")
    chats = [
        (workloads["code"][0], workloads["code"][1]),
        (workloads["quotes"][0], workloads["quotes"][1]),
        ([{"role": "user", "content": "Rename width to w in this code and return all of it:\n\n" + code}], code),
    ]
    # Every request starts cold: a prefix-cache hit computes the prompt's last tokens in a
    # narrower step than the whole prompt's (the quantized matmuls' int8 path instead of
    # AMX-BF16, the decode kernel's attention instead of the padded SDPA; see
    # tests/test_batch_invariance.py), which alone moves the code workload's greedy output
    # at its 44th token, speculation or not.
    options = dict(kv_cache_memory=64 * 2**20, enable_prefix_caching=False)
    async with engine.open_engine(None, **options) as eng:
        assert (eng._parts.quantization, eng._parts.dtype) == ("gguf", "bfloat16")  # the bench's path
        plain = [await collect(eng, chat, greedy(128)) for chat, _ in chats]
        predicted = [await collect(eng, chat, greedy(128, prediction=source)) for chat, source in chats]
        stats_plain = await wait_idle(eng)
    async with engine.open_engine(None, **options, speculative_config=NGRAM) as eng:
        spec = [await collect(eng, chat, greedy(128)) for chat, _ in chats]
        stats = await wait_idle(eng)
    for a, b, c in zip(plain, spec, predicted, strict=True):
        assert token_ids(b) == token_ids(a)
        assert token_ids(c) == token_ids(a)
    assert all(o[-1].usage.prediction_tokens[0] > 0 for o in predicted)
    assert stats.spec_accepted_tokens > 0 and stats_plain.spec_accepted_tokens > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats_plain.kv_blocks_free == stats_plain.kv_blocks_total
