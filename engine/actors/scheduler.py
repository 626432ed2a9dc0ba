"""The scheduler actor: a shell over :class:`engine.core.scheduler.Scheduler`.

It turns messages into calls on the pure scheduler, forwards the allocator calls that the
scheduler yields to the KV-allocator actor (one at a time, waiting for each reply), sends
plans to the executor and token deltas to the detokenizer.

Async scheduling: with ``async_scheduling`` the actor plans step N+1 as soon as step N
has been handed to the executor, and hands it over as soon as the executor is free, so the
worker thread goes from one forward to the next without waiting for Python. The pure
scheduler counts a placeholder token for each sample in flight, so N+1 can be planned
before N's tokens are known; a request that N finishes wastes at most one planned token.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

import trio

from engine.core.request import RequestStatus
from engine.core.scheduler import ScheduleGenerator, Scheduler
from engine.errors import RequestError
from engine.messages import (
    AbortRequests,
    AllocatorCall,
    AllocatorReply,
    SchedulerRequest,
    StepOutputs,
    StepPlan,
    StepResult,
    StopStringHit,
    TokenDelta,
)

SchedulerInbox = SchedulerRequest | StepResult | AbortRequests | StopStringHit


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


class SchedulerActor:
    """Actor: owns the pure scheduler and the order of steps.

    Its inbox (fan-in, unbounded: see :func:`engine.actors.system.run_actors`) carries new
    samples from the processor, step results from the executor, aborts from the callers and
    stop-string hits from the detokenizer. Everything already delivered is handled before
    the next step is planned, so an abort frees its blocks before that step.
    """

    def __init__(
        self,
        core: Scheduler,
        *,
        inbox: trio.MemoryReceiveChannel[SchedulerInbox],
        to_allocator: trio.MemorySendChannel[AllocatorCall],
        from_allocator: trio.MemoryReceiveChannel[AllocatorReply],
        to_executor: trio.MemorySendChannel[StepPlan],
        to_detokenizer: trio.MemorySendChannel[StepOutputs],
        async_scheduling: bool = True,
    ) -> None:
        self._core = core
        self._inbox = inbox
        self._to_allocator = to_allocator
        self._from_allocator = from_allocator
        self._to_executor = to_executor
        self._to_detokenizer = to_detokenizer
        # One step running plus one planned ahead; without async scheduling, one at a time.
        self._max_in_flight = 2 if async_scheduling else 1
        self._in_flight: collections.deque[StepPlan] = collections.deque()
        self._steps = 0
        self._planned_ahead = 0

    def statistics(self) -> SchedulerActorStatistics:
        core = self._core.statistics()
        return SchedulerActorStatistics(
            running=core.running,
            waiting=core.waiting,
            preemptions=core.preemptions,
            steps=self._steps,
            planned_ahead=self._planned_ahead,
            requests_finished=core.finished,
            steps_in_flight=len(self._in_flight),
            scheduled_tokens=core.scheduled_tokens,
        )

    def queue_depth(self) -> int:
        """Samples waiting to be scheduled (admission control reads this). Samples still in
        the inbox are not counted (the inbox also holds step results and aborts, and cannot
        be inspected); the scheduler drains it before each step, so the limit is exceeded at
        most by what arrives within one step."""
        return self._core.statistics().waiting

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with (
            self._inbox,
            self._to_allocator,
            self._from_allocator,
            self._to_executor,
            self._to_detokenizer,
        ):
            task_status.started()
            while True:
                await self._handle_delivered()
                if await self._plan_step():
                    continue
                try:
                    message = await self._inbox.receive()
                except trio.EndOfChannel:
                    return
                await self._handle(message)

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
        if len(self._in_flight) >= self._max_in_flight or not self._core.has_work:
            return False
        plan = await self._drive(self._core.schedule())
        if not (plan.chunks or plan.finished_ids):
            return False  # nothing to run until a step in flight returns
        if self._in_flight:
            self._planned_ahead += 1
        self._in_flight.append(plan)
        self._steps += 1
        await self._to_executor.send(plan)
        return True

    async def _handle(self, message: SchedulerInbox) -> None:
        if isinstance(message, StepResult):
            plan = self._in_flight.popleft()
            update = self._core.update_from_output(plan, message)
            await self._call_all(update.allocator_calls)
            if update.deltas or message.prompt_logprobs:
                await self._to_detokenizer.send(
                    StepOutputs(plan.step_id, update.deltas, message.prompt_logprobs)
                )
        elif isinstance(message, SchedulerRequest):
            await self._add(message)
        elif isinstance(message, AbortRequests):
            await self._finish(message.request_ids, RequestStatus.FINISHED_ABORTED)
        else:
            await self._finish((message.request_id,), RequestStatus.FINISHED_STOPPED)

    async def _add(self, request: SchedulerRequest) -> None:
        try:
            self._core.add_request(request)
        except RequestError:
            # The processor checks every limit first; only a clash of engine ids (a
            # caller's id reused while its aborted samples are still live) lands here.
            # The sample ends at once rather than crashing the engine.
            abort = TokenDelta(request.request_id, (), (), "abort", None)
            await self._to_detokenizer.send(StepOutputs(-1, (abort,)))

    async def _finish(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        live = tuple(r for r in request_ids if self._core.get_request(r) is not None)
        await self._call_all(self._core.finish_requests(live, status))
        if live and status is RequestStatus.FINISHED_ABORTED:
            # The detokenizer ends each sample's stream with an "abort" output (a stop
            # string already ended its own stream, so it needs nothing).
            deltas = tuple(TokenDelta(r, (), (), "abort", None) for r in live)
            await self._to_detokenizer.send(StepOutputs(-1, deltas))

    async def _call(self, call: AllocatorCall) -> AllocatorReply:
        await self._to_allocator.send(call)
        return await self._from_allocator.receive()

    async def _call_all(self, calls: Iterable[AllocatorCall]) -> None:
        for call in calls:
            await self._call(call)

    async def _drive(self, gen: ScheduleGenerator) -> StepPlan:
        """Run a sans-IO ``schedule()`` generator against the allocator actor."""
        try:
            call = next(gen)
            while True:
                call = gen.send(await self._call(call))
        except StopIteration as stop:
            return stop.value
