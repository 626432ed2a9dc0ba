"""The executor actor: runs each step's plan on the model runner in the process's model
thread (:mod:`engine.actors.model_thread`)."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Protocol

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
        profiler: Any = None,
    ) -> None:
        self._runner = runner
        # engine.runner.profiler.StepProfiler (--profiler-config), or None: each step runs
        # inside its step() on the model thread.
        self._profiler = profiler
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
        try:
            if getattr(self._runner, "batches_in_flight", 1) > 1:
                await self._run_pipelined(task_status)
            else:
                await self._run_steps(task_status)
        finally:
            # A stopped executor keeps no model alive: an engine held after its close (its
            # actors are kept for their counters) lets its runner go.
            self._runner = None

    async def _run_steps(self, task_status: trio.TaskStatus[None]) -> None:
        with self._plans, self._results:
            task_status.started()
            async for plan in self._plans:
                t0 = time.perf_counter()
                async with self._limiter:
                    if self._profiler is None:
                        result = await run_in_model_thread(self._runner.execute, plan)
                    else:
                        result = await run_in_model_thread(self._profiled, plan)
                t1 = time.perf_counter()
                await self._results.send(result)
                self._steps += 1
                self._forward += result.forward_seconds
                self._execute += t1 - t0
                self._busy += time.perf_counter() - t0

    def _profiled(self, plan: StepPlan) -> StepResult:
        with self._profiler.step(sum(c.num_tokens for c in plan.chunks)):
            return self._runner.execute(plan)

    async def _run_pipelined(self, task_status: trio.TaskStatus[None]) -> None:
        """Pipeline parallelism: a step's first stage runs in the model thread
        (``runner.submit``) and the executor takes the next plan as soon as that returns;
        a second task waits for each step's result (``runner.collect``, in a thread of its
        own: it only reads the workers' answers) and hands it back, in plan order. The
        scheduler bounds the steps in flight (one per stage)."""
        runner: Any = self._runner
        # math.inf: bounded by the scheduler's steps in flight (batches_in_flight).
        submitted_send, submitted_recv = trio.open_memory_channel[tuple[StepPlan, float]](math.inf)

        async def collect_all() -> None:
            with submitted_recv, self._results:
                async for plan, t0 in submitted_recv:
                    # Not abandoned on cancel: the answers must be read in order.
                    result = await trio.to_thread.run_sync(runner.collect, plan)
                    await self._results.send(result)
                    self._steps += 1
                    self._forward += result.forward_seconds
                    self._busy += time.perf_counter() - t0

        with self._plans:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(collect_all)
                task_status.started()
                with submitted_send:
                    async for plan in self._plans:
                        t0 = time.perf_counter()
                        async with self._limiter:
                            await run_in_model_thread(runner.submit, plan)
                        self._execute += time.perf_counter() - t0
                        await submitted_send.send((plan, t0))
