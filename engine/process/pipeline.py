"""Pipeline parallelism's processes (issue 39): rank 0 is the first stage, in the engine;
the later stages (each a rank, or a tensor-parallel group of ranks) are the workers of a
:class:`~engine.process.workers.WorkerGroup`, started, placed (``mp`` or Ray), failed and
restarted as tensor parallelism's are. :class:`PipelineRunner` drives them with several
steps in flight::

    executor (model thread)              stage 1 ... stage N-1 (workers)
      submit(plan i):  RankStep(plan i, results since) --> every worker
                       stage 0's layers --isend(hidden, residual)--> stage 1 --> ... -->
      submit(plan i+1) ...                                   last stage: norm, head, sample
    executor (collect thread)
      collect(plan i): <-- RankDone from each worker; StageResult(result i) from the last
                       the result to the scheduler; its tokens to rank 0 at the next submit

The scheduler keeps up to N steps in flight, a request in at most one of them
(``SchedulerConfig.pipeline_stages``).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from engine.messages import RankReset, StepPlan, StepResult
from engine.process.grammars import GrammarMirror
from engine.process.workers import RankCommands, WorkerGroup, WorkerLostError

# Steps of the pipeline's trace kept (bench/pp.py reads them): a few thousand tuples.
TRACE_STEPS = 4096


class PipelineRunner(RankCommands):
    """Rank 0's runner (pipeline stage 0) with the later stages' workers: what the executor
    drives when ``--pipeline-parallel-size`` is above 1. The executor may keep several
    steps in flight (:attr:`batches_in_flight`): :meth:`submit` runs stage 0's part of a
    step in the model thread and returns once its hidden states are on their way;
    :meth:`collect`, from another thread, waits for the step's answers and returns the
    last stage's result. :meth:`execute` is both, one step at a time.

    The last stage samples. Its tokens come back with its result; rank 0 takes them
    (:meth:`ModelRunner.accept`) at its next :meth:`submit`, and sends them with that step
    to the workers of the stages between, so that every stage holds each request's tokens
    before the request's next chunk (the scheduler plans a request's next step only after
    its result came back)."""

    def __init__(self, runner: Any, group: WorkerGroup) -> None:
        self._runner = runner
        self.group = group
        self.grammars = GrammarMirror(runner.grammar)
        self.batches_in_flight = group.pp_size
        # Results collected, not yet taken by rank 0's runner nor sent to the workers.
        self._arrived: list[StepResult] = []
        self._lock = threading.Lock()
        # Rank 0's own result of each submitted step (failures of stage 0's part), by step.
        self._own: dict[int, StepResult] = {}
        # (step id, rank, start, end, recv seconds, send seconds) of the recent steps, for
        # bench/pp.py's trace; bounded, the oldest dropped.
        self.trace: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=TRACE_STEPS)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    @property
    def rank0(self) -> Any:
        return self._runner

    def submit(self, plan: StepPlan) -> None:
        """Stage 0's part of ``plan`` (the model thread): the plan to every worker, then
        rank 0's layers; returns once its hidden states are sent."""
        if self.group.broken:
            raise WorkerLostError("the pipeline's workers are down")
        why = self.group.first_death()
        if why is not None:
            self.group.broken = True
            raise WorkerLostError(why)
        with self._lock:
            results, self._arrived = tuple(self._arrived), []
        for result in results:
            self._runner.accept([(t.sample_id, t.token_id) for t in result.sampled],
                                [f.sample_id for f in result.failed])
        self.group.send_step(plan, self.grammars.for_plan(plan), results)
        times = self.group.place.stage.times
        start, send = time.time(), times.send_seconds
        own = self._runner.execute(plan)
        self.trace.append((plan.step_id, 0, start, time.time(), 0.0, times.send_seconds - send))
        self._own[plan.step_id] = own

    def collect(self, plan: StepPlan) -> StepResult:
        """The last stage's result of ``plan`` (any thread but the model thread's callers'
        own: it only reads the workers' connections)."""
        own = self._own.pop(plan.step_id, None)
        if own is not None and own.failed and len(own.failed) == len(
                {c.sample_id for c in plan.chunks}):
            # Stage 0's part raised (its cause is logged): the later stages wait for hidden
            # states that will not come; the group is replaced.
            self.group.broken = True
            raise WorkerLostError(f"pipeline stage 0 failed step {plan.step_id}: "
                                  f"{own.failed[0].reason}")
        result, traces = self.group.collect_step(plan.step_id)
        for rank, trace in enumerate(traces, start=1):
            if trace:
                self.trace.append((plan.step_id, rank, *trace))
        with self._lock:
            self._arrived.append(result)
        return result

    def execute(self, plan: StepPlan) -> StepResult:
        self.submit(plan)
        return self.collect(plan)

    def reset(self) -> None:
        """Forget every request on every stage; a broken group is replaced."""
        self._runner.reset()
        self.grammars.reset()
        with self._lock:
            self._arrived = []
        self._own.clear()
        self.group.place.stage.drop_sent()
        if self.group.alive():
            try:
                self.group.command(RankReset())
                self.group.finish_command()
                return
            except WorkerLostError:
                pass
        self.group.restart()

    def worker_pids(self) -> list[int]:
        return self.group.pids()

    def close(self) -> None:
        self.group.close()
