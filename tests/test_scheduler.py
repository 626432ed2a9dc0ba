"""Scheduling decisions over scripted steps, then a whole-policy simulation against a fake
model whose outputs depend on the KV content it reads, so a wrong block share, an early
reuse or a lost token changes the tokens."""

from __future__ import annotations

import itertools
import random
from collections import deque

import pytest

from engine.core import (
    BlockPool,
    ProtocolError,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    run_with_pool,
)
from engine.errors import InvalidParamError, PromptTooLongError, RequestError
from engine.messages import (
    NULL_BLOCK,
    CacheBlocks,
    FreeRequest,
    RequestFailure,
    SampledToken,
    SchedulerRequest,
    StepPlan,
    StepResult,
    TokenDelta,
)
from engine.params import SamplingParams

EOS = 0
_PROMPT_BASE = itertools.count(1)


def _setup(
    *,
    budget: int = 16,
    seqs: int = 8,
    bs: int = 4,
    blocks: int = 64,
    policy: str = "fcfs",
    caching: bool = True,
    max_model_len: int = 1024,
    hasher: object = None,
) -> tuple[Scheduler, BlockPool]:
    config = SchedulerConfig(
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        block_size=bs,
        max_model_len=max_model_len,
        num_kv_blocks=blocks,
        policy=policy,
        enable_prefix_caching=caching,
    )
    extra = {"hasher": hasher} if hasher else {}
    return Scheduler(config), BlockPool(blocks, bs, enable_prefix_caching=caching, **extra)


def _add(
    sched: Scheduler,
    rid: str,
    prompt: int | tuple[int, ...],
    *,
    max_tokens: int = 16,
    priority: int = 0,
    wait_for: str | None = None,
    salt: str | None = None,
    **params: object,
):
    if isinstance(prompt, int):  # distinct tokens per request: no accidental prefix hits
        base = 100 * next(_PROMPT_BASE)
        prompt = tuple(range(base, base + prompt))
    tokens = prompt
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    return sched.add_request(
        SchedulerRequest(rid, tokens, sp, (EOS,), max_tokens, priority, 0.0, salt, wait_for)
    )


def _plan(sched: Scheduler, pool: BlockPool) -> StepPlan:
    return run_with_pool(sched.schedule(), pool)


def _chunks(plan: StepPlan) -> list[tuple[str, int, int, bool]]:
    return [(c.sample_id, c.start, c.num_tokens, c.sample) for c in plan.chunks]


def _result(plan: StepPlan, tokens: dict[str, int] | None = None, default: int = 7) -> StepResult:
    tokens = tokens or {}
    sampled = tuple(
        SampledToken(c.sample_id, tokens.get(c.sample_id, default), -0.5, ((default, -0.5),))
        for c in plan.chunks
        if c.sample
    )
    return StepResult(plan.step_id, sampled, 0.0)


def _update(sched: Scheduler, pool: BlockPool, plan: StepPlan, tokens: dict[str, int] | None = None):
    update = sched.update_from_output(plan, _result(plan, tokens))
    for call in update.allocator_calls:
        pool.handle(call)
    return {d.sample_id: d for d in update.deltas}


def _step(sched: Scheduler, pool: BlockPool, tokens: dict[str, int] | None = None):
    plan = _plan(sched, pool)
    return plan, _update(sched, pool, plan, tokens)


# -- budgets ------------------------------------------------------------------------------


def test_the_token_budget_is_split_running_first_then_waiting_in_order() -> None:
    sched, pool = _setup(budget=16)
    for rid in "abc":
        _add(sched, rid, 10)
    plan, _ = _step(sched, pool)
    assert _chunks(plan) == [("a", 0, 10, True), ("b", 0, 6, False)]
    assert [n.sample_id for n in plan.new_requests] == ["a", "b"]
    plan, _ = _step(sched, pool)
    # a decodes, b finishes its prompt, c gets what is left: decode and prefill mix.
    assert _chunks(plan) == [("a", 10, 1, True), ("b", 6, 4, True), ("c", 0, 10, True)]
    assert [n.sample_id for n in plan.new_requests] == ["c"]


def test_a_long_prompt_is_prefilled_in_chunks_and_only_the_last_samples() -> None:
    sched, pool = _setup(budget=8)
    _add(sched, "a", 20)
    starts = [_chunks(_step(sched, pool)[0]) for _ in range(4)]
    assert starts == [
        [("a", 0, 8, False)],
        [("a", 8, 8, False)],
        [("a", 16, 4, True)],
        [("a", 20, 1, True)],
    ]


def test_max_num_seqs_bounds_the_running_set() -> None:
    sched, pool = _setup(seqs=2)
    _add(sched, "a", 3, max_tokens=1)
    _add(sched, "b", 3)
    _add(sched, "c", 3)
    plan, deltas = _step(sched, pool)
    assert [c.sample_id for c in plan.chunks] == ["a", "b"]
    assert deltas["a"].finish_reason == "length"
    plan, _ = _step(sched, pool)
    assert [c.sample_id for c in plan.chunks] == ["b", "c"]
    assert plan.finished_ids == ("a",)


# -- preemption ---------------------------------------------------------------------------


def test_fcfs_preempts_the_newest_running_request_and_resumes_it_first() -> None:
    # 5 blocks of 2 tokens: two 4-token prompts take 4, and decoding runs out at once.
    sched, pool = _setup(bs=2, blocks=5, budget=32)
    _add(sched, "old", 4, max_tokens=6)
    _add(sched, "new", 4, max_tokens=6)
    plan, _ = _step(sched, pool)
    assert [c.sample_id for c in plan.chunks] == ["old", "new"]
    plan, _ = _step(sched, pool)  # position 4 needs a third block each: one is free
    assert _chunks(plan) == [("old", 4, 1, True)]
    assert sched.statistics().preemptions == 1
    new = sched.get_request("new")
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert len(new.output_token_ids) == 1  # its first output is kept and recomputed
    assert pool.block_table("new") == ()
    for _ in range(4):  # old runs to its end, taking the freed blocks; new cannot fit
        plan, deltas = _step(sched, pool)
        assert [c.sample_id for c in plan.chunks] == ["old"]
    assert deltas["old"].finish_reason == "length"
    plan, _ = _step(sched, pool)
    # new is recomputed from 0 over its prompt and its output, with no NewRequest.
    assert _chunks(plan) == [("new", 0, 5, True)]
    assert plan.new_requests == () and plan.finished_ids == ("old",)


def test_a_preempted_request_goes_back_ahead_of_requests_that_never_ran() -> None:
    sched, pool = _setup(bs=2, blocks=5, budget=32)
    _add(sched, "old", 4, max_tokens=6)
    _add(sched, "new", 4, max_tokens=6)
    _add(sched, "late", 4, max_tokens=2)
    plan, _ = _step(sched, pool)
    assert [c.sample_id for c in plan.chunks] == ["old", "new"]  # no block left for late
    plan, _ = _step(sched, pool)
    assert sched.get_request("new").status is RequestStatus.PREEMPTED
    order = []
    while sched.has_work:
        plan, _ = _step(sched, pool)
        order.extend(c.sample_id for c in plan.chunks if c.sample_id not in order)
    # new, preempted after late arrived, is at the front of the waiting queue: it runs
    # again before late runs at all.
    assert order == ["old", "new", "late"]


def test_priority_preempts_the_lowest_priority_even_if_older() -> None:
    sched, pool = _setup(bs=2, blocks=5, budget=32, policy="priority")
    _add(sched, "low", 4, priority=5)
    _add(sched, "high", 4, priority=0)
    plan, _ = _step(sched, pool)
    assert [c.sample_id for c in plan.chunks] == ["high", "low"]  # queue order is priority
    plan, _ = _step(sched, pool)  # each needs a third block at position 4: one is free
    assert [c.sample_id for c in plan.chunks] == ["high"]
    assert sched.get_request("low").status is RequestStatus.PREEMPTED


def test_a_refused_request_preempts_newer_ones_until_it_fits() -> None:
    sched, pool = _setup(bs=2, blocks=6, budget=32)
    for rid in ("a", "b", "c"):
        _add(sched, rid, 4)
    _step(sched, pool)  # 6 blocks: all taken
    plan, _ = _step(sched, pool)
    # a needs a block: c, the newest, is preempted; b takes c's other block.
    assert [c.sample_id for c in plan.chunks] == ["a", "b"]
    assert sched.statistics().preemptions == 1
    assert sched.statistics().waiting == 1


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    sched, pool = _setup(seqs=2, policy="priority")
    _add(sched, "a", 2, priority=1)
    _add(sched, "b", 2, priority=0)
    _add(sched, "c", 2, priority=1)
    plan, _ = _step(sched, pool)
    assert [c.sample_id for c in plan.chunks] == ["b", "a"]


def test_a_pool_smaller_than_configured_fails_loudly_instead_of_looping() -> None:
    sched, _ = _setup(bs=2, blocks=8)
    pool = BlockPool(2, 2)  # the config claims 8 blocks
    _add(sched, "a", 6)
    with pytest.raises(ProtocolError, match="num_kv_blocks"):
        _plan(sched, pool)


def test_prompts_that_cannot_fit_are_rejected_and_max_tokens_is_cut_to_fit() -> None:
    sched, _ = _setup(bs=4, blocks=4, max_model_len=100)  # the pool holds 16 tokens
    with pytest.raises(PromptTooLongError) as err:
        _add(sched, "a", 16)
    assert err.value.max_model_len == 16
    assert _add(sched, "b", 10, max_tokens=50).max_tokens == 6
    with pytest.raises(InvalidParamError, match="in use"):
        _add(sched, "b", 3)


# -- finishing ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "tokens", "outputs", "reason", "stop_reason"),
    [
        ({}, [5, EOS, 5], [5, EOS], "stop", None),
        ({"min_tokens": 2}, [EOS, 5, EOS], [EOS, 5, EOS], "stop", None),
        ({"ignore_eos": True, "max_tokens": 3}, [EOS, EOS, EOS], [EOS, EOS, EOS], "length", None),
        ({"stop_token_ids": [9]}, [5, 9], [5, 9], "stop", 9),
        ({"stop_token_ids": [9], "min_tokens": 1}, [9, 9], [9, 9], "stop", 9),
        ({"max_tokens": 2}, [5, 5], [5, 5], "length", None),
    ],
)
def test_finish_conditions(params, tokens, outputs, reason, stop_reason) -> None:
    sched, pool = _setup()
    max_tokens = params.pop("max_tokens", 16)
    _add(sched, "a", 3, max_tokens=max_tokens, **params)
    got: list[int] = []
    for token in tokens:
        _, deltas = _step(sched, pool, {"a": token})
        delta = deltas["a"]
        got.extend(delta.token_ids)
        if delta.finish_reason:
            break
    assert got == outputs
    assert (delta.finish_reason, delta.stop_reason) == (reason, stop_reason)
    assert not sched.has_work or sched.get_request("a") is None
    assert pool.num_free_blocks == pool.num_blocks


def test_the_context_length_ends_a_request_as_length() -> None:
    sched, pool = _setup(max_model_len=6)
    _add(sched, "a", 4, max_tokens=100)
    _, first = _step(sched, pool)
    _, second = _step(sched, pool)
    assert first["a"].finish_reason is None and second["a"].finish_reason == "length"


def test_logprobs_pass_through_only_when_asked() -> None:
    sched, pool = _setup()
    _add(sched, "plain", 3)
    _add(sched, "lp", 3, logprobs=1)
    _, deltas = _step(sched, pool)
    assert deltas["plain"].logprobs == ()
    assert deltas["lp"].logprobs == (SampledToken("lp", 7, -0.5, ((7, -0.5),)),)


def test_abort_frees_blocks_and_tells_the_runner_in_the_next_plan() -> None:
    sched, pool = _setup()
    _add(sched, "a", 9)
    plan = _plan(sched, pool)
    calls = sched.finish_requests(["a", "unknown"], RequestStatus.FINISHED_ABORTED)
    for call in calls:
        pool.handle(call)
    assert pool.num_free_blocks == pool.num_blocks
    assert sched.update_from_output(plan, _result(plan)).deltas == ()  # its token is dropped
    assert _plan(sched, pool).finished_ids == ("a",)
    assert not sched.has_work
    with pytest.raises(ValueError, match="not a finished status") as info:
        sched.finish_requests(["a"], RequestStatus.RUNNING)
    assert not isinstance(info.value, RequestError)  # a caller's misuse, not a request's


# -- async scheduling ---------------------------------------------------------------------


def test_async_planning_schedules_the_placeholder_position() -> None:
    sched, pool = _setup()
    _add(sched, "a", 5, max_tokens=3)
    p0 = _plan(sched, pool)
    p1 = _plan(sched, pool)  # before p0's result: position 5 holds an unknown token
    assert _chunks(p0) == [("a", 0, 5, True)] and _chunks(p1) == [("a", 5, 1, True)]
    assert _update(sched, pool, p0)["a"].token_ids == (7,)
    p2 = _plan(sched, pool)
    assert _chunks(p2) == [("a", 6, 1, True)]
    # Three outputs are drawn (one received, two in flight): nothing more to plan.
    assert _chunks(_plan(sched, pool)) == []
    assert _update(sched, pool, p1)["a"].finish_reason is None
    assert _update(sched, pool, p2)["a"].finish_reason == "length"
    assert pool.num_free_blocks == pool.num_blocks


def test_async_tokens_of_a_request_finished_meanwhile_are_dropped() -> None:
    sched, pool = _setup()
    _add(sched, "a", 5)
    p0, p1 = _plan(sched, pool), _plan(sched, pool)
    assert _update(sched, pool, p0, {"a": EOS})["a"].finish_reason == "stop"
    assert _update(sched, pool, p1) == {}
    assert _plan(sched, pool).finished_ids == ("a",)


def test_async_a_preempted_request_keeps_the_token_drawn_in_flight() -> None:
    sched, pool = _setup(bs=2, blocks=5, budget=32)
    _add(sched, "a", 4, max_tokens=5)
    _add(sched, "b", 4, max_tokens=5)
    p0 = _plan(sched, pool)  # 4 blocks
    p1 = _plan(sched, pool)  # position 4 of each: one block left, b is preempted
    assert [c.sample_id for c in p1.chunks] == ["a"]
    assert sched.get_request("b").status is RequestStatus.PREEMPTED
    deltas = _update(sched, pool, p0, {"a": 11, "b": 12})
    assert deltas["b"].token_ids == (12,)  # the runner appended it; so does the scheduler
    assert sched.get_request("b").output_token_ids == [12]
    _update(sched, pool, p1)


# -- n > 1 --------------------------------------------------------------------------------


def test_a_sibling_waits_for_the_prompt_then_shares_its_blocks() -> None:
    sched, pool = _setup(budget=64)
    prompt = tuple(range(1, 11))
    _add(sched, "s0", prompt)
    _add(sched, "s1", prompt, wait_for="s0")
    plan, _ = _step(sched, pool)
    assert [c.sample_id for c in plan.chunks] == ["s0"]
    plan, _ = _step(sched, pool)
    # Two full prompt blocks come from the cache; the last partial one is computed.
    assert ("s1", 8, 2, True) in _chunks(plan)
    shared = pool.block_table("s0")[:2]
    assert pool.block_table("s1")[:2] == shared
    assert [pool.ref_count(b) for b in shared] == [2, 2]
    assert pool.statistics().prefix_cache_hits == 8


def test_without_prefix_caching_siblings_do_not_wait() -> None:
    sched, pool = _setup(caching=False)
    _add(sched, "s0", 5)
    _add(sched, "s1", 5, wait_for="s0")
    assert [c.sample_id for c in _plan(sched, pool).chunks] == ["s0", "s1"]


def test_an_update_for_a_plan_not_in_flight_is_a_protocol_error() -> None:
    sched, pool = _setup()
    _add(sched, "a", 3)
    plan = _plan(sched, pool)
    _update(sched, pool, plan)
    with pytest.raises(ProtocolError, match="not in flight"):
        sched.update_from_output(plan, _result(plan))


# -- simulation ---------------------------------------------------------------------------

VOCAB = 12  # small, so EOS (0) and stop tokens come up within a few steps
_MOD = (1 << 61) - 1


def _mix(prev: int, token: int, pos: int) -> int:
    """The fake model's KV entry at ``pos``: depends on the entry before it, as read."""
    return (prev * 1_000_003 + token * 7919 + pos + 1) % _MOD


def _draw(state: int, index: int, params: SamplingParams, eos: tuple[int, ...]) -> int:
    token = state % VOCAB
    banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
    while index < params.min_tokens and token in banned:  # the sampler's min_tokens mask
        token = (token + 1) % VOCAB
    return token


def _alone(prompt: tuple[int, ...], params: SamplingParams, max_tokens: int) -> tuple[list[int], str]:
    """The oracle: the request's tokens run alone, with no cache and no blocks."""
    state, tokens, out = 0, list(prompt), []
    for pos, token in enumerate(tokens):
        state = _mix(state, token, pos)
    while True:
        token = _draw(state, len(out), params, (EOS,))
        out.append(token)
        late = len(out) > params.min_tokens
        if late and ((not params.ignore_eos and token == EOS) or token in params.stop_token_ids):
            return out, "stop"
        if len(out) == max_tokens:
            return out, "length"
        state = _mix(state, token, len(tokens))
        tokens.append(token)


class FakeRunner:
    """Keeps each request's tokens and a paged KV cache of ``_mix`` entries, like the real
    runner keeps real ones; checks every chunk against what it knows."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.requests: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}

    def _slot(self, table: tuple[int, ...], pos: int) -> tuple[int, int]:
        return table[pos // self.bs], pos % self.bs

    def execute(self, plan: StepPlan) -> StepResult:
        for rid in plan.finished_ids:
            del self.requests[rid]
        for new in plan.new_requests:
            assert new.sample_id not in self.requests
            self.requests[new.sample_id] = (list(new.prompt_token_ids), new.params, [])
        sampled = []
        for c in plan.chunks:
            tokens, params, outputs = self.requests[c.sample_id]
            end = c.start + c.num_tokens
            assert end <= len(tokens) and c.sample == (end == len(tokens))
            prev = 0
            if c.start:
                block, off = self._slot(c.block_ids, c.start - 1)
                prev = self.kv[block][off]
                assert prev is not None, "read a KV slot nobody wrote"
            for pos in range(c.start, end):
                prev = _mix(prev, tokens[pos], pos)
                block, off = self._slot(c.block_ids, pos)
                self.kv[block][off] = prev
            if c.sample:
                token = _draw(prev, len(outputs), params, (EOS,))
                tokens.append(token)
                outputs.append(token)
                sampled.append(SampledToken(c.sample_id, token, 0.0, ()))
        return StepResult(plan.step_id, tuple(sampled), 0.0)


def _random_requests(rng: random.Random, count: int, limit: int) -> list[tuple[str, tuple[int, ...], SamplingParams, int, str | None]]:
    shared = tuple(rng.randrange(1, VOCAB) for _ in range(12))  # a common system prompt
    out = []
    while len(out) < count:
        length = rng.randint(1, 20)
        head = shared[: rng.choice([0, 4, 8, 12])]
        prompt = (head + tuple(rng.randrange(1, VOCAB) for _ in range(length)))[:24]
        max_tokens = rng.randint(1, 20)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            min_tokens=rng.choice([0, 0, min(3, max_tokens)]),
            ignore_eos=rng.random() < 0.3,
            stop_token_ids=rng.choice([(), (5,)]),
        )
        resolved = min(max_tokens, limit - len(prompt))
        rid = f"r{len(out)}"
        out.append((rid, prompt, params, resolved, None))
        if rng.random() < 0.2 and len(out) < count:  # n = 2: the sibling waits for rid
            out.append((f"{rid}-1", prompt, params, resolved, rid))
    return out


def _colliding(parent: int | None, salt: str | None, tokens: tuple[int, ...]) -> int:
    return 0  # every block in one bucket: only verification keeps the cache right


@pytest.mark.parametrize(
    ("seed", "policy", "depth", "caching", "hasher"),
    [
        (1, "fcfs", 0, True, None),
        (2, "fcfs", 1, True, None),
        (3, "priority", 1, True, None),
        (4, "fcfs", 1, False, None),
        (5, "priority", 0, True, None),
        (6, "fcfs", 1, True, _colliding),
        (7, "priority", 1, True, _colliding),
    ],
)
def test_every_request_gets_its_solo_tokens_under_preemption(seed, policy, depth, caching, hasher) -> None:
    rng = random.Random(seed)
    bs, blocks, budget, seqs = 4, 12, 16, 6  # a 48-token pool for up to 44-token requests
    sched, pool = _setup(
        bs=bs, blocks=blocks, budget=budget, seqs=seqs, policy=policy, caching=caching, hasher=hasher
    )
    runner = FakeRunner(blocks, bs)
    pending = deque(_random_requests(rng, 24, blocks * bs))
    specs = {r[0]: r for r in pending}
    outputs: dict[str, list[int]] = {rid: [] for rid in specs}
    reasons: dict[str, str] = {}
    aborted: set[str] = set()
    in_flight: deque[tuple[StepPlan, StepResult]] = deque()

    def deliver() -> None:
        plan, result = in_flight.popleft()
        update = sched.update_from_output(plan, result)
        for call in update.allocator_calls:
            pool.handle(call)
        for delta in update.deltas:
            assert delta.sample_id not in reasons
            outputs[delta.sample_id].extend(delta.token_ids)
            if delta.finish_reason:
                reasons[delta.sample_id] = delta.finish_reason

    for _ in range(2000):  # a livelock fails the test instead of hanging it
        while pending and (rng.random() < 0.5 or not sched.has_work):
            rid, prompt, params, max_tokens, wait_for = pending.popleft()
            priority = rng.randrange(3)
            sched.add_request(SchedulerRequest(rid, prompt, params, (EOS,), max_tokens, priority, 0.0, None, wait_for))
        if rng.random() < 0.03:
            live = sorted(r for r in specs if r not in reasons and r not in aborted and sched.get_request(r))
            if live:
                victim = rng.choice(live)
                aborted.add(victim)
                for call in sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED):
                    pool.handle(call)
        if not (sched.has_work or in_flight or pending):
            break
        if sched.has_work and len(in_flight) <= depth:
            plan = run_with_pool(sched.schedule(), pool)
            assert len(plan.chunks) <= seqs and sum(c.num_tokens for c in plan.chunks) <= budget
            result = runner.execute(plan)
            if plan.chunks:
                in_flight.append((plan, result))
            elif not in_flight and not plan.finished_ids:
                assert pending, "nothing planned, nothing in flight, yet work is left"
            if len(in_flight) > depth or not plan.chunks:
                if in_flight:
                    deliver()
        elif in_flight:
            deliver()
    else:
        pytest.fail("the simulation did not finish")

    for rid, (_, prompt, params, max_tokens, _) in specs.items():
        expected, reason = _alone(prompt, params, max_tokens)
        if rid in aborted:
            assert outputs[rid] == expected[: len(outputs[rid])]
        else:
            assert (outputs[rid], reasons[rid]) == (expected, reason), rid
    assert pool.num_free_blocks == blocks and not runner.requests
    assert sched.statistics().preemptions > 0
    if caching:
        assert pool.statistics().prefix_cache_hits > 0


def test_deltas_are_token_delta_messages() -> None:
    sched, pool = _setup()
    _add(sched, "a", 2)
    plan = _plan(sched, pool)
    update = sched.update_from_output(plan, _result(plan))
    assert isinstance(update.deltas[0], TokenDelta)


def test_a_decode_inside_the_last_block_needs_no_allocator_round_trip() -> None:
    sched, pool = _setup(bs=4)
    _add(sched, "a", 5)
    _step(sched, pool)  # prefill: positions 0..4 in two blocks

    calls: list[object] = []

    class CountingPool:
        def handle(self, call):
            calls.append(call)
            return pool.handle(call)

    for position in (5, 6, 7, 8):
        plan = run_with_pool(sched.schedule(), CountingPool())
        assert _chunks(plan) == [("a", position, 1, True)]
        _update(sched, pool, plan)
    assert [type(c).__name__ for c in calls] == ["AllocateSlots"]  # only for position 8


def test_scheduler_config_comes_from_the_engine_config_and_is_checked() -> None:
    from engine.config import EngineConfig

    engine = EngineConfig(max_num_seqs=3, block_size=8, scheduling_policy="priority")
    config = SchedulerConfig.from_engine_config(engine, max_model_len=100, num_kv_blocks=10)
    assert (config.max_num_seqs, config.block_size, config.policy) == (3, 8, "priority")
    assert config.max_request_len == 80  # the pool, not the context, is the limit here
    with pytest.raises(ValueError, match="policy") as info:
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=1, block_size=1, max_model_len=1, num_kv_blocks=1, policy="lifo")
    assert not isinstance(info.value, RequestError)  # a caller's misuse, not a request's
    with pytest.raises(ValueError, match="num_kv_blocks") as info:
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=1, block_size=1, max_model_len=1, num_kv_blocks=0)
    assert not isinstance(info.value, RequestError)


# -- failed requests ----------------------------------------------------------------------


def test_a_failed_request_finishes_as_error_frees_its_blocks_and_caches_nothing() -> None:
    sched, pool = _setup(budget=16, bs=4)
    _add(sched, "bad", 8)
    _add(sched, "ok", 8)
    plan = _plan(sched, pool)
    sampled = tuple(SampledToken("ok", 7, -0.5, ()) for c in plan.chunks if c.sample_id == "ok")
    result = StepResult(plan.step_id, sampled, 0.0, failed=(RequestFailure("bad", "NaN logits"),))
    update = sched.update_from_output(plan, result)
    cached = [c.sample_id for c in update.allocator_calls if isinstance(c, CacheBlocks)]
    freed = [c.sample_id for c in update.allocator_calls if isinstance(c, FreeRequest)]
    assert cached == ["ok"] and freed == ["bad"]
    deltas = {d.sample_id: d for d in update.deltas}
    assert deltas["bad"] == TokenDelta("bad", (), (), "error", "NaN logits")
    assert deltas["ok"].token_ids == (7,)
    for call in update.allocator_calls:
        pool.handle(call)
    assert sched.get_request("bad") is None
    # The runner learns in the next plan that it may drop the failed request.
    assert "bad" in _plan(sched, pool).finished_ids


def test_a_sliding_window_model_holds_a_bounded_number_of_blocks() -> None:
    """Every layer slides a 6-token window: a request keeps only the blocks its next chunk
    can still see, whatever its length; released places read as NULL_BLOCK in the plans."""
    window, bs, budget = 6, 4, 8
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=budget, block_size=bs, max_model_len=1024,
        num_kv_blocks=64, sliding_window=window,
    )  # fmt: skip
    sched, pool = Scheduler(config), BlockPool(64, bs)
    _add(sched, "long", 40, max_tokens=30)
    held = []
    while sched.has_work:
        plan = _plan(sched, pool)
        for chunk in plan.chunks:
            table = pool.block_table(chunk.sample_id)
            first_seen = max(0, chunk.start - window + 1) // bs
            # Blocks the chunk can see are the pool's real ones; earlier places are null.
            assert chunk.block_ids[first_seen:] == table[first_seen:]
            assert set(chunk.block_ids[: sched.get_request(chunk.sample_id).num_released_blocks]) <= {NULL_BLOCK}
        held.append(pool.statistics().num_blocks - pool.num_free_blocks)
        for call in sched.update_from_output(plan, _result(plan)).allocator_calls:
            pool.handle(call)
    # A chunk of 8 starting anywhere sees at most its 5 keys before it: 13 tokens, 4 blocks
    # (5 when unaligned); 70 tokens unwindowed would hold 18.
    assert max(held) <= 5 and pool.num_free_blocks == 64
