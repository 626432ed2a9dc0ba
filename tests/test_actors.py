"""The actor engine's guarantees: cancellation frees blocks, a crash fails everything
cleanly, and a slow consumer stalls nobody. Tiny float32 model, real actors."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import trio
from engine_helpers import (
    WAIT_LIMIT_SECONDS,
    collect,
    greedy,
    random_prompts,
    tiny_model,
    token_ids,
    wait_idle,
    wait_until,
)

import engine
from engine.actors.allocator import KVAllocator
from engine.actors.executor import Executor
from engine.actors.router import MailboxState, OutputMailbox
from engine.actors.scheduler import SchedulerActor
from engine.core import admission
from engine.core.admission import AdmissionLimits, admit, submit_request
from engine.core.block_pool import BlockPool
from engine.core.scheduler import Scheduler
from engine.core.scheduler_config import SchedulerConfig
from engine.errors import EngineDeadError, InvalidParamError, QueueFullError
from engine.messages import (
    DetokenizerRequest,
    RequestOutput,
    SampledToken,
    StepOutputs,
    StepPlan,
    StepResult,
    TokenLogprob,
)
from engine.runner.model_runner import ModelRunner

# 16-token step budget: a 100-token prompt is prefilled over 7 steps, so there is a
# prefill phase to cancel in. A 4 MiB pool keeps start-up fast.
OPTIONS: dict[str, Any] = dict(
    dtype="float32", max_num_seqs=8, max_num_batched_tokens=16, block_size=16,
    kv_cache_memory=4 * 1024 * 1024,
)
LONG_PROMPT = random_prompts(1, vocab=300, lo=100, hi=100, seed=7)[0]
# A request that is cancelled or left asks for 300 tokens: running to its end would take 7
# prefill and 299 decode steps, so a step count far below that shows it was aborted (its
# blocks would be free at the end either way).
LEFT_MAX_TOKENS = 300
NATURAL_STEPS = 7 + 299


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory)


async def _still_serves(eng: Any) -> None:
    outputs = await collect(eng, [5, 6, 7], greedy(3))
    assert len(token_ids(outputs)) == 3


async def _cancel_when(eng: Any, ready: Any, *, after_outputs: int = 0) -> bool:
    """Run one request in a cancel scope; cancel it once ``ready()`` holds and it gave
    ``after_outputs`` outputs. Returns whether the Cancelled reached the scope."""
    seen = 0
    with trio.CancelScope() as scope:

        async def cancel_when_ready() -> None:
            await wait_until(lambda: ready() and seen >= after_outputs)
            scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_when_ready)
            stream = await eng.submit(LONG_PROMPT, greedy(LEFT_MAX_TOKENS))
            async with stream:
                async for _ in stream:
                    seen += 1
            pytest.fail("the request finished before it was cancelled")
    return scope.cancelled_caught


@pytest.mark.parametrize(
    "point", ["waiting", "prefill", "first_output", "decoding"]
)
async def test_cancelling_the_consumer_frees_the_request_blocks(model: Path, point: str) -> None:
    async with engine.open_engine(str(model), **dict(OPTIONS, max_num_seqs=1)) as eng:
        stats = eng.statistics
        if point == "waiting":
            # max_num_seqs=1 and a long request ahead: ours waits in the queue.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(collect, eng, LONG_PROMPT, greedy(30))
                await wait_until(lambda: stats().running == 1)
                assert await _cancel_when(eng, lambda: stats().waiting == 1)
        elif point == "prefill":
            assert await _cancel_when(eng, lambda: stats().kv_blocks_free < stats().kv_blocks_total)
        elif point == "first_output":
            assert await _cancel_when(eng, lambda: True, after_outputs=1)
        else:
            assert await _cancel_when(eng, lambda: True, after_outputs=5)
        after = await wait_idle(eng)
        assert after.kv_blocks_free == after.kv_blocks_total
        assert after.steps < NATURAL_STEPS // 2
        await _still_serves(eng)


@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "tokenized-in-a-thread"])
async def test_cancelling_submit_at_every_checkpoint_leaves_nothing_behind(
    model: Path, threaded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if threaded:
        monkeypatch.setattr(admission, "THREAD_PROMPT_CHARS", 0)
    prompt = " ".join(["the quick brown fox"] * 10)  # text: tokenized inside submit
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        router = eng._handles.router
        inside = 0
        # Cancel after 0, 1, 2, ... scheduling points: inside submit (at its first checkpoint,
        # or while a thread tokenizes) or, once submit got through, in the caller.
        for checkpoints in range(8):
            stream = None
            with trio.CancelScope() as scope:

                async def cancel_soon(n: int = checkpoints, scope: trio.CancelScope = scope) -> None:
                    for _ in range(n):
                        await trio.lowlevel.checkpoint()
                    scope.cancel()

                async with trio.open_nursery() as nursery:
                    if checkpoints == 0:
                        scope.cancel()  # already cancelled when submit starts
                    else:
                        nursery.start_soon(cancel_soon)
                    stream = await eng.submit(prompt, greedy(LEFT_MAX_TOKENS))
            if stream is None:  # cancelled inside submit: nothing may be open or queued
                assert scope.cancelled_caught
                assert router.statistics().open_requests == 0
                assert eng._handles.queue_depth() == 0
                inside += 1
            else:
                await stream.aclose()  # submit got through: leaving aborts it
                assert router.statistics().open_requests == 0
        assert inside >= 1
        stats = await wait_idle(eng)
        assert stats.steps < NATURAL_STEPS // 2
        await _still_serves(eng)


async def test_leaving_a_generate_loop_early_aborts_the_request(model: Path) -> None:
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        async with eng.generate(LONG_PROMPT, greedy(LEFT_MAX_TOKENS)) as outputs:
            async for _ in outputs:
                break
        async for _ in eng.generate(LONG_PROMPT, greedy(LEFT_MAX_TOKENS)):
            break  # no `async with`: the dropped iterator aborts when collected
        stats = await wait_idle(eng)
        assert stats.requests_finished == 2
        assert stats.steps < NATURAL_STEPS // 2
        stream = await eng.submit(LONG_PROMPT, greedy(LEFT_MAX_TOKENS))
        await stream.aclose()
        stats = await wait_idle(eng)
        assert stats.requests_finished == 3
        assert stats.steps < NATURAL_STEPS // 2


async def test_abort_from_outside_ends_the_stream_with_abort(model: Path) -> None:
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        stream = await eng.submit(LONG_PROMPT, greedy(40, stop=["never"]), request_id="victim")
        outputs: list[RequestOutput] = []
        async with stream:
            async for out in stream:
                outputs.append(out)
                eng.abort("victim")
                eng.abort("victim")  # idempotent
        await wait_idle(eng)
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    assert len(token_ids(outputs)) < 40


async def test_a_crashed_actor_fails_every_request_with_engine_dead_error(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = ModelRunner.execute
    calls = 0

    def execute_then_crash(self: ModelRunner, plan: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > 12:  # let all three requests get going first
            raise RuntimeError("device on fire")
        return original(self, plan)

    monkeypatch.setattr(ModelRunner, "execute", execute_then_crash)

    def caused_by_the_crash(exc: EngineDeadError) -> bool:
        return isinstance(exc.__cause__, RuntimeError) and "on fire" in str(exc.__cause__)

    async def consume(eng: Any, prompt: list[int]) -> None:
        # Shielded so that the first failure does not cancel the others: each request
        # must end with its own EngineDeadError, not hang (a hang fails as TooSlowError).
        with trio.CancelScope(shield=True), trio.fail_after(WAIT_LIMIT_SECONDS):
            await collect(eng, prompt, greedy(40))

    dead = pytest.RaisesExc(EngineDeadError, check=caused_by_the_crash)
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        with pytest.RaisesGroup(dead, dead, dead):
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(consume, eng, LONG_PROMPT[i:])
        assert eng.dead
        assert isinstance(eng.dead_reason, RuntimeError)
        with pytest.raises(EngineDeadError):
            await eng.submit("Hello", greedy(4))
    # Leaving the block after the crash is clean: nothing hangs, nothing else raised.


async def test_closing_the_engine_fails_open_streams(model: Path) -> None:
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        stream = await eng.submit(LONG_PROMPT, greedy(200))
    with pytest.raises(EngineDeadError, match="engine closed"):
        async for _ in stream:
            pass
    assert eng.dead
    with pytest.raises(EngineDeadError):
        await eng.submit("Hello", greedy(4))


async def test_a_consumer_that_stops_reading_does_not_stall_others(model: Path) -> None:
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        expected = token_ids(await collect(eng, LONG_PROMPT, greedy(24)))
        stalled = await eng.submit(LONG_PROMPT, greedy(24))
        async with stalled:
            # Nobody reads `stalled` while three other requests run to the end.
            others = [random_prompts(1, vocab=300, lo=10, hi=30, seed=s)[0] for s in (1, 2, 3)]
            with trio.fail_after(WAIT_LIMIT_SECONDS):  # stalled: TooSlowError, not a hang
                async with trio.open_nursery() as nursery:
                    for prompt in others:
                        nursery.start_soon(collect, eng, prompt, greedy(30))
            await wait_until(lambda: eng.statistics().running == 0)
            outputs = [out async for out in stalled]
        stats = await wait_idle(eng)
    assert token_ids(outputs) == expected
    assert len(outputs) < 24  # unread outputs were merged, not queued one per token
    assert outputs[-1].finish_reason == "length"
    assert stats.requests_finished == 5


async def test_a_full_queue_rejects_new_requests(model: Path) -> None:
    async with engine.open_engine(str(model), **dict(OPTIONS, max_num_seqs=1, max_queued_requests=1)) as eng:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect, eng, LONG_PROMPT, greedy(30))
            await wait_until(lambda: eng.statistics().running == 1)
            nursery.start_soon(collect, eng, [5, 6, 7], greedy(2))
            await wait_until(lambda: eng.statistics().waiting == 1)
            with pytest.raises(QueueFullError):
                await eng.submit([5, 6, 7], greedy(2))
        await wait_idle(eng)


async def test_a_logit_bias_outside_the_vocabulary_is_rejected_and_the_engine_lives(
    model: Path,
) -> None:
    # It used to pass admission and fail the sampler's step, killing the engine.
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        vocab = eng.tokenizer.vocab_size  # the tiny model's config and tokenizer agree
        with pytest.raises(InvalidParamError, match="logit_bias") as info:
            await eng.submit([5, 6, 7], greedy(2, logit_bias={vocab: 1.0}))
        assert info.value.param == "logit_bias"
        assert not eng.dead
        await _still_serves(eng)
        await collect(eng, [5, 6, 7], greedy(2, logit_bias={vocab - 1: 1.0}))


def _admitted(request_id: str, n: int) -> Any:
    submit = submit_request([5, 6], engine.SamplingParams(n=n), request_id=request_id,
                            priority=0, cache_salt=None, arrival_time=0.0)
    return admit(submit, (5, 6), AdmissionLimits(64, 300, 8, (2,)), waiting=0,
                 serial=0)


def test_a_mailbox_merges_unread_outputs_per_sample() -> None:
    box = OutputMailbox(_admitted("r", 2))
    lp = TokenLogprob(1, -0.5, ())
    box.put(RequestOutput("r", 0, "a", (1,), False, None, None, (lp,), None))
    box.put(RequestOutput("r", 1, "x", (7,), False, None, None, (lp,), None))
    box.put(RequestOutput("r", 0, "b", (2,), True, "length", None, (lp,), engine.Usage(3, 2)))
    assert box.pending == 2 and box.merged == 1 and box.state is MailboxState.OPEN
    merged = box._pending[0]
    assert (merged.text, merged.token_ids, merged.finished) == ("ab", (1, 2), True)
    assert merged.logprobs == (lp, lp) and merged.usage == engine.Usage(3, 2)


async def test_a_cancelled_executor_waits_for_the_step_its_thread_is_running() -> None:
    started, release = threading.Event(), threading.Event()
    finished: list[int] = []

    class SlowRunner:
        def execute(self, plan: StepPlan) -> StepResult:
            started.set()
            release.wait(WAIT_LIMIT_SECONDS)
            finished.append(plan.step_id)  # stands for the KV-cache writes of the step
            return StepResult(plan.step_id, (), 0.0)

    plan_send, plan_recv = trio.open_memory_channel[StepPlan](0)
    result_send, _result_recv = trio.open_memory_channel[StepResult](1)
    executor = Executor(SlowRunner(), plan_recv, result_send)
    scope = trio.CancelScope()
    stopped = trio.Event()

    async def run_executor() -> None:
        with scope:
            await executor.run()
        stopped.set()

    async with trio.open_nursery() as nursery, plan_send:
        nursery.start_soon(run_executor)
        await plan_send.send(StepPlan(0, (), (), ()))
        await wait_until(started.is_set)
        scope.cancel()
        # Real time, not a checkpoint: an abandoned thread would let the actor stop now.
        await trio.sleep(0.05)
        assert not stopped.is_set() and finished == []
        release.set()
        with trio.fail_after(WAIT_LIMIT_SECONDS):
            await stopped.wait()
    assert finished == [0]


async def test_a_step_is_handed_over_before_the_previous_steps_outputs_are_detokenized() -> None:
    # Without async scheduling, step 2 must reach the executor while the detokenizer has
    # not yet taken step 1's tokens: the front end's work then runs beside step 2. The
    # channels are unbuffered and this test plays executor and detokenizer, so a scheduler
    # that sent the outputs first would wait on the detokenizer for ever.
    inbox_send, inbox = trio.open_memory_channel[Any](float("inf"))
    call_send, call_recv = trio.open_memory_channel[Any](0)
    reply_send, reply_recv = trio.open_memory_channel[Any](0)
    plan_send, plans = trio.open_memory_channel[Any](0)
    detok_send, detok = trio.open_memory_channel[Any](0)
    actor = SchedulerActor(
        Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=16,
                                  max_model_len=300, num_kv_blocks=8)),
        inbox=inbox, to_allocator=call_send, from_allocator=reply_recv, to_executor=plan_send,
        to_detokenizer=detok_send, async_scheduling=False)
    admitted = _admitted("r", 1)
    sample_id = admitted.samples[0].sample_id
    async with trio.open_nursery() as nursery:
        nursery.start_soon(KVAllocator(BlockPool(8, 16), call_recv, reply_send).run)
        nursery.start_soon(actor.run)
        with trio.fail_after(WAIT_LIMIT_SECONDS):
            inbox_send.send_nowait(admitted)
            assert isinstance(await detok.receive(), DetokenizerRequest)
            first = await plans.receive()
            inbox_send.send_nowait(StepResult(first.step_id, (SampledToken(sample_id, 9, 0.0, ()),), 0.0))
            second = await plans.receive()
            assert [c.sample_id for c in second.chunks] == [sample_id]
            outputs = await detok.receive()
            assert isinstance(outputs, StepOutputs) and outputs.step_id == first.step_id
            assert [d.token_ids for d in outputs.deltas] == [(9,)]
        nursery.cancel_scope.cancel()
