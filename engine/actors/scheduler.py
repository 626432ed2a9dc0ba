"""The scheduler actor: a shell over :class:`engine.core.scheduler.Scheduler`.

It turns messages into calls on the pure scheduler, forwards the allocator calls that the
scheduler yields to the KV-allocator actor (one at a time, waiting for each reply), sends
plans to the executor and token deltas to the detokenizer.

Async scheduling: with ``async_scheduling`` the actor plans step N+1 as soon as step N
has been handed to the executor, and hands it over as soon as the executor is free, so the
worker thread goes from one forward to the next without waiting for Python. The pure
scheduler counts a placeholder token for each sample in flight, so N+1 can be planned
before N's tokens are known; a request that N finishes wastes at most one planned token.

Without it, a step's token deltas go to the detokenizer only after the next step has been
planned and handed over: detokenizing, routing and the HTTP writes of step N (32 SSE
frames at concurrency 32) then run while step N+1 computes, instead of in the gap between
the two, where every trio task that became runnable ran before the plan was sent. A stop
string found in step N's text therefore ends its sample one step later (the detokenizer
drops what comes after it), as it already could when the detokenizer's stop hit raced the
next plan.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import trio

from engine.actors.model_thread import run_in_model_thread
from engine.core.request import RequestStatus
from engine.core.scheduler import Scheduler, drive
from engine.errors import RequestError
from engine.messages import (
    AbortSamples,
    AdmittedRequest,
    AllocatorCall,
    AllocatorReply,
    BlocksFetched,
    ClearPrefixCache,
    ControlPause,
    ControlProfiler,
    DetokenizerRequest,
    FetchBlocks,
    PauseControlled,
    PrefixCacheCleared,
    PrefixCacheReset,
    PrefixLookedUp,
    ProfilerControlled,
    ResetPrefixCache,
    SamplesAborted,
    StepOutputs,
    StepPlan,
    StepResult,
    StopStringHit,
)

logger = logging.getLogger(__name__)

# Bucket edges of the tokens-per-step histogram (vLLM's iteration_tokens_total): powers of
# two up to a large step budget. A step counts as vLLM counts an iteration: the prompt
# tokens it computed plus the tokens it gave out (a prefill that samples counts its prompt
# and its first token; a decode step, its token), and a step that gave nothing and
# computed no prompt (one that only dropped finished requests) is not counted.
ITERATION_TOKEN_BUCKETS = tuple(2**i for i in range(15))

SchedulerInbox = (AdmittedRequest | StepResult | AbortSamples | StopStringHit | ResetPrefixCache
                  | ControlProfiler | ControlPause | BlocksFetched)


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerActorStatistics:
    running: int
    waiting: int
    preemptions: int  # cumulative
    steps: int  # plans with work sent to the executor, cumulative
    planned_ahead: int  # of those, planned while the previous step was still running
    requests_finished: int  # cumulative, aborts included
    steps_in_flight: int
    scheduled_tokens: int  # cumulative: tokens computed, prefix-cache hits excluded
    # Steps by their tokens (see ITERATION_TOKEN_BUCKETS): counts per bucket (the last
    # counts steps above the largest edge), and their sum, for a histogram.
    iteration_token_counts: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0
    # Speculative decoding, cumulative (vLLM's spec_decode counters): steps that verified a
    # proposal, tokens proposed, tokens accepted, accepted tokens by place in the proposal.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # LoRA adapters (names, sorted) of the running and of the waiting requests (vLLM's
    # lora_requests_info).
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    # The KV store (--kv-transfer-config), cumulative and in tokens (vLLM's
    # external_prefix_cache_queries / _hits): prompts looked up there, and tokens read.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0


class SchedulerActor:
    """Actor: owns the pure scheduler and the order of steps.

    Its inbox (fan-in, unbounded: see :func:`engine.actors.system.run_actors`) carries
    admitted requests and aborts from the callers' tasks, step results from the executor
    and stop-string hits from the detokenizer. Everything already delivered is handled
    before the next step is planned, so an abort frees its blocks before that step.
    """

    def __init__(
        self,
        core: Scheduler,
        *,
        inbox: trio.MemoryReceiveChannel[SchedulerInbox],
        to_allocator: trio.MemorySendChannel[AllocatorCall],
        from_allocator: trio.MemoryReceiveChannel[AllocatorReply],
        to_executor: trio.MemorySendChannel[StepPlan],
        to_detokenizer: trio.MemorySendChannel[DetokenizerRequest | StepOutputs | SamplesAborted],
        async_scheduling: bool = True,
        release_grammar: Callable[[Any], None] | None = None,
        max_in_flight: int | None = None,
        profiler: Any = None,
        runner: Any = None,
        to_store: trio.MemorySendChannel[FetchBlocks] | None = None,
        paused: tuple[bool, int] = (False, -1),
    ) -> None:
        self._core = core
        # The KV-store actor (engine.actors.kv_store), with core.kv_tier: reads of prompt
        # blocks from the shared folder; None when the engine reads none.
        self._to_store = to_store
        # The model runner, for sleep mode (its sleep / wake_up run on the model thread
        # between steps); None: a sleep above level 0 is answered with an error.
        self._runner = runner
        # Paused (ControlPause): no step is planned. A pause with mode "wait" holds the
        # requests that arrive until the ones before it have finished (``_held``); the
        # pause waiting for its conditions is ``_pausing``. ``_sleep_level``: -1 awake.
        # Restarted in place after a crash, a pause (or a level 0 sleep) the engine was in
        # goes on (``paused``: the engine's pause and sleep level), as does a model asleep.
        self._paused, self._sleep_level = paused[0], paused[1] if paused[0] else -1
        self._pausing: ControlPause | None = None
        self._held: list[AdmittedRequest] = []
        self._reload_then_resume = False  # a reload found generation running
        if self._sleeping():
            self._paused = True
            self._sleep_level = 2 if "weights" in runner.sleeping else 1
        # engine.runner.profiler.StepProfiler (--profiler-config), driven on the model
        # thread between steps; None: ControlProfiler is answered with an error.
        self._profiler = profiler
        # Each structured sample holds its grammar in the grammar backend's cache (taken
        # at admission: engine.structured.backend); released here when the sample ends.
        self._release_grammar = release_grammar
        self._grammar_of: dict[str, Any] = {}  # sample id -> its StructuredOutputs
        self._inbox = inbox
        self._to_allocator = to_allocator
        self._from_allocator = from_allocator
        self._to_executor = to_executor
        self._to_detokenizer = to_detokenizer
        # One step running plus one planned ahead; without async scheduling, one at a time;
        # with a pipeline of N stages, N (``max_in_flight``: one batch per stage).
        self._max_in_flight = max_in_flight or (2 if async_scheduling else 1)
        self._in_flight: collections.deque[StepPlan] = collections.deque()
        # Beside each step in flight: the prompt tokens its chunks compute (counted with
        # the tokens it gives out when its result comes back).
        self._in_flight_prompt: collections.deque[int] = collections.deque()
        self._steps = 0
        self._planned_ahead = 0
        self._scheduled_at: dict[str, float] = {}  # sample id -> first planned, until its first delta
        self._iteration_counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self._iteration_sum = 0
        self._arriving = 0  # samples sent to the inbox, not yet added
        # Step outputs handled but not yet sent to the detokenizer: they go once the next
        # step is planned (see the module docstring), or before anything else goes there.
        self._undelivered: collections.deque[StepOutputs] = collections.deque()

    def statistics(self) -> SchedulerActorStatistics:
        core, tier = self._core.statistics(), self._core.kv_tier
        return SchedulerActorStatistics(
            running=core.running,
            waiting=core.waiting + self._arriving,
            preemptions=core.preemptions,
            steps=self._steps,
            planned_ahead=self._planned_ahead,
            requests_finished=core.finished,
            steps_in_flight=len(self._in_flight),
            scheduled_tokens=core.scheduled_tokens,
            iteration_token_counts=tuple(self._iteration_counts),
            iteration_tokens_sum=self._iteration_sum,
            spec_drafts=core.spec_drafts,
            spec_draft_tokens=core.spec_draft_tokens,
            spec_accepted_tokens=core.spec_accepted_tokens,
            spec_accepted_per_pos=core.spec_accepted_per_pos,
            running_loras=core.running_loras, waiting_loras=core.waiting_loras,
            external_prefix_cache_queries=tier.queries if tier is not None else 0,
            external_prefix_cache_hits=tier.hits if tier is not None else 0,
        )

    def queue_depth(self) -> int:
        """Samples waiting to be scheduled, those still in the inbox included (admission
        control reads this)."""
        return self._core.statistics().waiting + self._arriving

    def arriving(self, request: AdmittedRequest) -> None:
        """Called by the sender of ``request`` as it puts it in the inbox (the inbox cannot
        be inspected), so that statistics and admission control count it at once."""
        self._arriving += len(request.samples)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with (
            self._inbox,
            self._to_allocator,
            self._from_allocator,
            self._to_executor,
            self._to_detokenizer,
        ):
            task_status.started()
            try:
                while True:
                    await self._handle_delivered()
                    if self._pausing is not None:
                        await self._settle_pause()
                    if self._max_in_flight > 1:
                        # Async: the next step already runs, and handing over the one
                        # after waits for it; the outputs must not wait with it.
                        await self._deliver_outputs()
                    planned = await self._plan_step()
                    await self._deliver_outputs()
                    if planned:
                        continue
                    try:
                        message = await self._inbox.receive()
                    except trio.EndOfChannel:
                        return
                    await self._handle(message)
            finally:
                if self._to_store is not None:
                    self._to_store.close()
                self._release_all()
                self._runner = None  # as the executor's: a stopped actor keeps no model alive
                if self._profiler is not None and self._profiler.active:
                    # A trace still running as the engine stops is written, and the
                    # process's model thread (which outlives this engine) traces no more.
                    with trio.CancelScope(shield=True):
                        await run_in_model_thread(self._profiler.stop)

    def _release_all(self) -> None:
        """The actor stops (the engine closes, or restarts after a crash): its samples, and
        those still in its inbox, hold their grammars no more."""
        for sample_id in list(self._grammar_of):
            self._release(sample_id)
        while self._release_grammar is not None:
            try:
                message = self._inbox.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return
            if isinstance(message, AdmittedRequest):
                for sample in message.samples:
                    if sample.params.structured_outputs is not None:
                        self._release_grammar(sample.params.structured_outputs)

    async def _handle_delivered(self) -> None:
        while True:
            try:
                message = self._inbox.receive_nowait()
            except trio.WouldBlock:
                return
            except trio.EndOfChannel:
                return  # the blocking receive in run() sees it too
            await self._handle(message)

    async def _plan_step(self) -> bool:
        """Plan and hand over one step if allowed and useful; true if one was sent."""
        if self._frozen() or len(self._in_flight) >= self._max_in_flight or not self._core.has_work:
            return False
        plan = await drive(self._core.schedule(), self._call)
        if not (plan.chunks or plan.finished_ids or plan.preempted_ids or plan.kv_loads):
            return False  # nothing to run until a step in flight returns
        if self._in_flight:
            self._planned_ahead += 1
        now = time.monotonic()
        for new in plan.new_requests:
            if self._core.get_request(new.sample_id) is not None:  # not a beam's row
                self._scheduled_at[new.sample_id] = now
        self._in_flight.append(plan)
        self._in_flight_prompt.append(self._prompt_tokens(plan))
        self._steps += 1
        await self._to_executor.send(plan)
        return True

    async def _handle(self, message: SchedulerInbox) -> None:
        if isinstance(message, StepResult):
            plan = self._in_flight.popleft()
            prompt_tokens = self._in_flight_prompt.popleft()
            update = self._core.update_from_output(plan, message)
            self._count_iteration(prompt_tokens + sum(len(d.token_ids) for d in update.deltas))
            for delta in update.deltas:
                if delta.finish_reason is not None:
                    self._release(delta.sample_id)
            await self._call_all(update.allocator_calls)
            if update.deltas or message.prompt_logprobs:
                scheduled = tuple(
                    (d.sample_id, self._scheduled_at.pop(d.sample_id))
                    for d in update.deltas if d.sample_id in self._scheduled_at
                )
                self._undelivered.append(
                    StepOutputs(plan.step_id, update.deltas, message.prompt_logprobs, scheduled))
        elif isinstance(message, AdmittedRequest):
            if self._pausing is not None and self._pausing.mode == "wait":
                self._held.append(message)  # after the requests the pause waits for
            else:
                await self._add(message)
        elif isinstance(message, BlocksFetched):
            request = self._core.get_request(message.sample_id)
            if request is not None and self._core.kv_tier is not None:
                self._core.kv_tier.fetched(request, message)
        elif isinstance(message, AbortSamples):
            await self._unhold(message.sample_ids)
            await self._finish(message.sample_ids, RequestStatus.FINISHED_ABORTED)
        elif isinstance(message, ControlPause):
            await self._control_pause(message)
        elif isinstance(message, ResetPrefixCache):
            if message.reset_running:
                await drive(self._core.preempt_running(), self._call)
            reply = await self._call(ClearPrefixCache())
            assert isinstance(reply, PrefixCacheCleared)  # the allocator's protocol
            await self._deliver_outputs()
            await self._to_detokenizer.send(PrefixCacheReset(message.token, reply.done))
        elif isinstance(message, ControlProfiler):
            answer = await self._control_profiler(message)
            await self._deliver_outputs()
            await self._to_detokenizer.send(answer)
        else:
            await self._finish((message.sample_id,), RequestStatus.FINISHED_STOPPED)

    # -- pause and sleep -------------------------------------------------------------------

    async def _control_pause(self, message: ControlPause) -> None:
        if message.action == "reload":
            if self._pausing is not None:
                await self._answer_pause(message, error="a pause is under way", conflict=True)
                return
            # Frozen until the steps in flight are back, then reloaded (_settle_pause);
            # generation goes on afterwards unless it was paused before.
            self._reload_then_resume = not self._paused
            self._paused = True
            self._pausing = message
            await self._settle_pause()
            return
        if message.action == "pause":
            if self._pausing is not None:
                await self._answer_pause(message, error="another pause is under way", conflict=True)
                return
            if message.level >= 1 and (self._runner is None or not hasattr(self._runner, "sleep")):
                await self._answer_pause(message, error="this engine's runner cannot sleep")
                return
            self._paused = True
            self._pausing = message
            if message.mode == "abort":
                await self._finish(self._core.live_sample_ids(), RequestStatus.FINISHED_ABORTED)
            await self._settle_pause()
            return
        if self._pausing is not None:  # a resume or a wake overtakes a pause still draining
            pausing, self._pausing = self._pausing, None
            await self._answer_pause(pausing, error=f"a {message.action} came before the pause "
                                     "was done", conflict=True)
        if message.action == "wake" and self._runner is not None and getattr(self._runner, "sleeping", None):
            try:
                await run_in_model_thread(self._runner.wake_up, message.tags)
                self._forget_reads()
            except Exception as exc:  # the checkpoint unreadable now, say: still asleep
                logger.exception("sleep mode: waking %s failed", message.tags or "everything")
                await self._answer_pause(message, error=f"waking up failed: {exc}")
                return
        elif message.action == "resume" and self._sleeping():
            await self._answer_pause(message, error="the model sleeps: wake it up instead")
            return
        if not self._sleeping():
            self._paused, self._sleep_level = False, -1
            await self._release_held()
        await self._answer_pause(message)

    async def _settle_pause(self) -> None:
        """Finish the pause under way once its conditions hold: no step in flight, and
        with mode "wait" no request left from before it. Then, by its fields, the running
        requests are preempted (a sleep keeping them: their KV is forgotten), the prefix
        cache dropped and the model put to sleep."""
        message = self._pausing
        if message is None or self._in_flight:
            return
        if message.mode == "wait" and self._core.live_sample_ids():
            return
        self._pausing = None
        await self._release_held()  # in the queue now, frozen with the rest
        if message.action == "reload":
            await self._reload(message)
            return
        cleared, error = False, None
        if message.level >= 1 and message.mode == "keep":
            await drive(self._core.preempt_running(), self._call)
        if message.level >= 1 or (message.clear_cache and message.mode != "keep"):
            reply = await self._call(ClearPrefixCache())
            assert isinstance(reply, PrefixCacheCleared)  # the allocator's protocol
            cleared = reply.done
        if message.level >= 1 and not cleared:
            error = "the prefix cache could not be dropped: requests hold KV blocks"
        elif message.level >= 1:
            try:
                released = await run_in_model_thread(self._runner.sleep, message.level)
                logger.info("sleep mode: level %d; resident memory fell by %.1f MiB", message.level,
                            released / 2**20)
            except Exception as exc:
                logger.exception("sleep mode: level %d failed", message.level)
                error = f"sleep failed: {exc}"
        if error is None and message.level >= 0:
            self._sleep_level = message.level
        await self._answer_pause(message, cleared=cleared, error=error)

    async def _reload(self, message: ControlPause) -> None:
        """The model rebuilt from its checkpoint read again: the running requests are
        preempted and the prefix cache dropped first, so no KV computed with the old
        weights is read with the new."""
        await drive(self._core.preempt_running(), self._call)
        reply = await self._call(ClearPrefixCache())
        assert isinstance(reply, PrefixCacheCleared)  # the allocator's protocol
        error = None if reply.done else "the prefix cache could not be dropped"
        if error is None:
            try:
                await run_in_model_thread(self._runner.reload_weights)
                self._forget_reads()
                logger.info("reload_weights: the model was built again from its checkpoint")
            except Exception as exc:  # the checkpoint unreadable, say: the old model stays
                logger.exception("reload_weights failed")
                error = f"reloading the weights failed: {exc}"
        if self._reload_then_resume and not self._sleeping():
            self._paused = False
        await self._answer_pause(message, cleared=reply.done, error=error)

    def _forget_reads(self) -> None:
        """The weights may have changed: the KV store's blocks read so far are not taken."""
        if self._core.kv_tier is not None:
            self._core.kv_tier.forget_reads()

    def _frozen(self) -> bool:
        """Paused, and not draining for a pause with mode "wait" (whose requests run on)."""
        return self._paused and not (self._pausing is not None and self._pausing.mode == "wait")

    def _sleeping(self) -> bool:
        return bool(self._runner is not None and getattr(self._runner, "sleeping", None))

    async def _answer_pause(self, message: ControlPause, *, cleared: bool = False,
                            error: str | None = None, conflict: bool = False) -> None:
        sleeping = tuple(sorted(getattr(self._runner, "sleeping", ()) or ()))
        await self._deliver_outputs()
        await self._to_detokenizer.send(PauseControlled(
            message.token, self._paused, self._sleep_level, sleeping, cleared, error, conflict))

    async def _release_held(self) -> None:
        held, self._held = self._held, []
        for request in held:
            await self._add(request)

    async def _unhold(self, sample_ids: Iterable[str]) -> None:
        """Aborts of requests a pause holds: those requests join the queue first, so the
        abort finds them (and their streams end as any aborted one's)."""
        wanted = set(sample_ids)
        if not self._held or not wanted:
            return
        hit = [r for r in self._held if wanted.intersection(s.sample_id for s in r.samples)]
        if hit:
            self._held = [r for r in self._held if r not in hit]
            for request in hit:
                await self._add(request)

    async def _control_profiler(self, message: ControlProfiler) -> ProfilerControlled:
        """Start or stop the profiler on the model thread, after the steps handed over
        before it (its jobs run in order)."""
        if self._profiler is None:
            return ProfilerControlled(message.token, error="profiling is off: the engine was "
                                      "started without --profiler-config")
        try:
            if message.start:
                await run_in_model_thread(self._profiler.start)
                return ProfilerControlled(message.token)
            traces = await run_in_model_thread(self._profiler.stop)
        except Exception as exc:  # a folder it cannot write, say: the caller is told
            logger.exception("profiler: the %s failed", "start" if message.start else "stop")
            return ProfilerControlled(message.token, error=f"the profiler failed: {exc}")
        return ProfilerControlled(message.token, tuple(traces))

    async def _deliver_outputs(self) -> None:
        """Send the step outputs held back, oldest first."""
        while self._undelivered:
            await self._to_detokenizer.send(self._undelivered.popleft())

    def _prompt_tokens(self, plan: StepPlan) -> int:
        """The prompt tokens ``plan``'s chunks compute (a recomputed output is none)."""
        total = 0
        for chunk in plan.chunks:
            request = self._core.chunk_request(chunk.sample_id)
            if request is not None:
                end = min(chunk.start + chunk.num_tokens, request.num_prompt_tokens)
                total += max(0, end - chunk.start)
        return total

    def _count_iteration(self, tokens: int) -> None:
        if tokens:
            self._iteration_counts[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, tokens)] += 1
            self._iteration_sum += tokens

    async def _add(self, request: AdmittedRequest) -> None:
        # The detokenizer hears of each sample before any of its tokens: same channel, sent
        # first (after the outputs held back, which keep their order with what follows).
        await self._deliver_outputs()
        for spec in request.outputs:
            await self._to_detokenizer.send(spec)
        refused = []
        for sample in request.samples:
            spec = sample.params.structured_outputs
            if spec is not None and self._release_grammar is not None:
                self._grammar_of[sample.sample_id] = spec
            try:
                self._core.add_request(sample)
            except RequestError:
                # Admission checked every limit and numbered the sample ids, so nothing
                # should land here; if something does, the sample ends at once rather
                # than crashing the engine.
                refused.append(sample.sample_id)
                self._release(sample.sample_id)
        self._arriving -= len(request.samples)  # counted from here on by the core
        if refused:
            await self._to_detokenizer.send(SamplesAborted(tuple(refused)))
        if self._to_store is not None:
            for sample in request.samples:
                await self._fetch(sample.sample_id)

    async def _fetch(self, sample_id: str) -> None:
        """Have the store actor read the blocks of a new request's prompt past what the
        prefix cache holds (engine.core.kv_tier); the request waits for them."""
        tier, request = self._core.kv_tier, self._core.get_request(sample_id)
        lookup = tier.lookup(request) if tier is not None and request is not None else None
        if lookup is None:
            return
        reply = await self._call(lookup)
        assert isinstance(reply, PrefixLookedUp)  # the allocator's protocol
        fetch = tier.fetch(request, reply.num_blocks)
        if fetch is not None:
            await self._to_store.send(fetch)

    async def _finish(self, sample_ids: Iterable[str], status: RequestStatus) -> None:
        live = tuple(r for r in sample_ids if self._core.get_request(r) is not None)
        for sample_id in live:
            self._scheduled_at.pop(sample_id, None)
            self._release(sample_id)
        await self._call_all(self._core.finish_requests(live, status))
        if live and status is RequestStatus.FINISHED_ABORTED:
            await self._deliver_outputs()
            await self._to_detokenizer.send(SamplesAborted(live))

    def _release(self, sample_id: str) -> None:
        spec = self._grammar_of.pop(sample_id, None)
        if spec is not None and self._release_grammar is not None:
            self._release_grammar(spec)

    async def _call(self, call: AllocatorCall) -> AllocatorReply:
        await self._to_allocator.send(call)
        return await self._from_allocator.receive()

    async def _call_all(self, calls: Iterable[AllocatorCall]) -> None:
        for call in calls:
            await self._call(call)
