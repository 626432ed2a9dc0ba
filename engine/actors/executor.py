"""The executor actor: runs each step's plan on the model runner in the process's model
thread (:mod:`engine.actors.model_thread`)."""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

import trio

from engine.actors.model_thread import run_in_model_thread
from engine.messages import StepPlan, StepResult


class StepRunner(Protocol):
    """What the executor needs of :class:`engine.runner.model_runner.ModelRunner`."""

    def execute(self, plan: StepPlan) -> StepResult: ...


@dataclasses.dataclass(frozen=True, slots=True)
class ExecutorStatistics:
    steps: int
    forward_seconds: float  # inside runner.execute's forward + sampling (StepResult)
    execute_seconds: float  # whole runner.execute calls, as seen from the trio side
    busy_seconds: float  # from taking a plan to handing back its result


class Executor:
    """Actor: takes :class:`StepPlan` s, hands back :class:`StepResult` s, one at a time.

    The runner writes the KV cache, so a step is never abandoned: the wait for the model
    thread is not cancellable, and a cancelled executor waits for the step in flight to
    return. One ``CapacityLimiter(1)`` per device serializes steps even if
    a second executor were started on the same runner.
    """

    def __init__(
        self,
        runner: StepRunner,
        plans: trio.MemoryReceiveChannel[StepPlan],
        results: trio.MemorySendChannel[StepResult],
        *,
        limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        self._runner = runner
        self._plans = plans
        self._results = results
        self._limiter = limiter if limiter is not None else trio.CapacityLimiter(1)
        self._steps = 0
        self._forward = 0.0
        self._execute = 0.0
        self._busy = 0.0

    def statistics(self) -> ExecutorStatistics:
        return ExecutorStatistics(self._steps, self._forward, self._execute, self._busy)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self._plans, self._results:
            task_status.started()
            async for plan in self._plans:
                t0 = time.perf_counter()
                async with self._limiter:
                    result = await run_in_model_thread(self._runner.execute, plan)
                t1 = time.perf_counter()
                await self._results.send(result)
                self._steps += 1
                self._forward += result.forward_seconds
                self._execute += t1 - t0
                self._busy += time.perf_counter() - t0
