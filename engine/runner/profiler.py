"""vLLM's profiler (``--profiler-config``): the engine's steps traced between a start and a
stop, on the thread that runs them.

``torch.profiler`` records the ops of the thread that started it, and every step of a
process runs on its one model thread (engine.actors.model_thread), so :meth:`start`,
:meth:`stop` and each :meth:`step` are called there, in step order, between steps. A
trace holds each step as a ``engine step`` range (its plan's token count in the name)
with the torch ops under it, and, with ``torch_profiler_with_stack``, the Python stacks
that launched them; the C kernels of the CPU path show as the Python calls into them.

``delay_iterations`` steps pass after a start before the trace begins, and with
``max_iterations`` the trace ends by itself after that many steps, as vLLM counts them.
Each trace is written when it ends, as ``{name}.{time_ns}.pt.trace.json[.gz]`` in
``torch_profiler_dir`` (the names of torch's TensorBoard handler; Perfetto and
``chrome://tracing`` read them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from engine.config import ProfilerConfig

logger = logging.getLogger(__name__)


class StepProfiler:
    """One process's profiler, driven from its model thread (profiler "cuda" needs a CUDA
    device: engine.process.parts checks it before the model loads)."""

    def __init__(self, config: ProfilerConfig, name: str, device: torch.device) -> None:
        self.config = config
        self.name = name
        self.device = device
        self.traces: list[str] = []  # the files written, oldest first
        self._profile: Any = None  # the torch.profiler.profile of the trace being taken
        self._cuda_range = False  # profiler "cuda": inside cudaProfilerStart/Stop
        self._delay: int | None = None  # steps still to pass before the trace begins
        self._left = 0  # steps still to trace with max_iterations
        self._step = 0

    @property
    def active(self) -> bool:
        """Started and not yet stopped (tracing, or counting down its delay)."""
        return self._delay is not None or self._profile is not None or self._cuda_range

    def start(self) -> None:
        """Begin a trace (after ``delay_iterations`` steps); a second start while one
        runs changes nothing."""
        if self.active:
            logger.warning("profiler: already started; the start is ignored")
            return
        self._delay = self.config.delay_iterations
        if self._delay == 0:
            self._begin()

    def stop(self) -> list[str]:
        """End the trace and write it; the files written since the last stop (empty when
        nothing was traced: not started, or stopped before its delay passed)."""
        if not self.active:
            logger.warning("profiler: not started; the stop is ignored")
        self._delay = None
        self._end()
        written, self.traces = self.traces, []
        return written

    @contextlib.contextmanager
    def step(self, tokens: int) -> Iterator[None]:
        """Around one step of ``tokens`` scheduled tokens."""
        if self._delay == 0:
            self._begin()
        elif self._delay is not None:  # a step to pass before the trace begins
            self._delay -= 1
        if self._profile is None and not self._cuda_range:
            yield
            return
        self._step += 1
        with torch.profiler.record_function(f"engine step {self._step}: {tokens} tokens"):
            yield
        if self.config.max_iterations:
            self._left -= 1
            if self._left == 0:
                self._delay = None
                self._end()

    def _begin(self) -> None:
        self._delay = None
        self._left = self.config.max_iterations
        self._step = 0
        if self.config.profiler == "cuda":
            torch.cuda.profiler.start()
            self._cuda_range = True
            return
        c = self.config
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        os.makedirs(c.torch_profiler_dir, exist_ok=True)
        self._profile = torch.profiler.profile(
            activities=activities, record_shapes=c.torch_profiler_record_shapes,
            profile_memory=c.torch_profiler_with_memory, with_stack=c.torch_profiler_with_stack,
            with_flops=c.torch_profiler_with_flops, on_trace_ready=self._written)
        self._profile.start()
        logger.info("profiler: tracing %s's steps into %s", self.name, c.torch_profiler_dir)

    def _end(self) -> None:
        if self._cuda_range:
            torch.cuda.profiler.stop()
            self._cuda_range = False
        profile, self._profile = self._profile, None
        if profile is not None:
            profile.stop()  # on_trace_ready writes the trace

    def _written(self, profile: Any) -> None:
        c = self.config
        suffix = ".pt.trace.json.gz" if c.torch_profiler_use_gzip else ".pt.trace.json"
        path = os.path.join(c.torch_profiler_dir, f"{self.name}.{time.time_ns()}{suffix}")
        t0 = time.perf_counter()
        profile.export_chrome_trace(path)  # gzipped by its name, as torch's handler does
        paths = [path]
        if self.device.type == "cuda" and c.torch_profiler_dump_cuda_time_total:
            table = profile.key_averages().table(sort_by="self_cuda_time_total", row_limit=50)
            paths.append(os.path.join(c.torch_profiler_dir, f"profiler_out_{self.name}.txt"))
            with open(paths[-1], "w") as f:
                f.write(table)
        self.traces.extend(paths)
        logger.info("profiler: %s written in %.1f s", ", ".join(paths), time.perf_counter() - t0)
