"""An engine on a trio run in a thread of its own, for synchronous callers (:class:`engine.LLM`).

::

    caller thread(s)                        "engine.LLM" thread: trio.run
    ----------------                        ----------------------------------------
    EngineThread(model, options) ---------> open_engine(...) as engine   (loads here)
       <-------- the Engine, or the error --
    call(work) -- job (from_thread) ------> jobs loop: start_soon(job.run) in a nursery
       events.get()  <--- progress events --  work(engine, emit) in the job's cancel scope
       events.get()  <--- Finished(outcome) -
    Ctrl-C: cancel(job) (from_thread) -----> the job's scope cancelled: its requests abort
    close() -- cancel (from_thread) -------> the jobs loop's scope: leaves open_engine

The caller blocks in ``queue.SimpleQueue.get``, which a signal interrupts, so Ctrl-C
reaches the caller's thread (Python delivers signals to the main thread) while the batch
runs; the caller then cancels its job and waits for the job to unwind before it raises
``KeyboardInterrupt`` (its requests aborted, their KV blocks freed before the engine's
next step). No asyncio loop is touched: a caller under a running loop (Jupyter) blocks in
the same way, and trio runs in its own thread.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import outcome
import trio

from engine.actors.model_thread import release_openmp_team
from engine.api.engine import Engine
from engine.api.open import open_engine
from engine.errors import EngineDeadError

logger = logging.getLogger("engine")

T = TypeVar("T")

# How often a waiting caller checks that the engine thread is still alive: a guard for a
# thread that died without answering (a bug in trio itself); answers come at once.
_LIVENESS_SECONDS = 1.0

Emit = Callable[[Any], None]
Work = Callable[[Engine, Emit], Awaitable[T]]


class _Finished:
    """A job's last event: its outcome, or None when it was cancelled before finishing."""

    __slots__ = ("outcome",)

    def __init__(self, result: outcome.Outcome[Any] | None) -> None:
        self.outcome = result


class _Job:
    """One call from a caller thread: ``work`` runs on the trio thread, its events and
    its end come back through ``events``."""

    def __init__(self, work: Work[Any]) -> None:
        self.work = work
        self.events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._scope: trio.CancelScope | None = None
        # Both set on the trio thread; ``handed`` is read by the caller once a later
        # callback there has run (they run in order).
        self._cancelled = False
        self.handed = False
        self.finished = False  # the caller's thread has seen its last event

    def cancel(self) -> None:
        """On the trio thread: cancel the job, before or after it starts."""
        self._cancelled = True
        if self._scope is not None:
            self._scope.cancel()

    async def run(self, engine: Engine) -> None:
        result: outcome.Outcome[Any] | None = None
        try:
            with trio.CancelScope() as self._scope:
                if self._cancelled:
                    self._scope.cancel()
                try:
                    result = outcome.Value(await self.work(engine, self.events.put))
                except Exception as exc:  # the caller's to raise, in its own thread
                    result = outcome.Error(exc)
        finally:
            self.events.put(_Finished(result))


class EngineThread:
    """Opens an engine (:func:`open_engine` with ``model`` and ``options``) on a trio run
    in a new thread, and waits until it is loaded; raises what opening it raised.

    :meth:`call` runs an async function of the engine there and returns its result in
    the calling thread; several threads may call at once (their jobs run concurrently on
    the one engine). :meth:`close` stops the engine and ends the thread; idempotent."""

    def __init__(self, model: str | Path | None, options: dict[str, Any], *,
                 name: str = "engine.LLM") -> None:
        self._lock = threading.Lock()
        self._closed = False
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope: trio.CancelScope | None = None
        self._jobs: trio.MemorySendChannel[_Job] | None = None
        release_openmp_team()  # this caller waits: its idle team would slow the model's
        started: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(model, options, started),
                                        name=name, daemon=True)
        self._thread.start()
        try:
            first = started.get()
        except KeyboardInterrupt:  # Ctrl-C while loading: stop it, once it has loaded
            self.close()
            raise
        if isinstance(first, BaseException):
            self._thread.join()
            raise first
        self.engine: Engine = first

    # -- the trio thread -----------------------------------------------------------------

    def _run(self, model: str | Path | None, options: dict[str, Any],
             started: queue.SimpleQueue[Any]) -> None:
        ready = False

        def on_ready(engine: Engine) -> None:
            nonlocal ready
            ready = True
            started.put(engine)

        failure: BaseException = EngineDeadError("the LLM was closed while its model loaded")
        try:
            trio.run(self._main, model, options, on_ready)
        except Exception as exc:
            failure = exc
            if ready:
                logger.error("the engine thread failed: %r", exc, exc_info=exc)
        finally:
            if not ready:
                started.put(failure)  # the constructor raises it

    async def _main(self, model: str | Path | None, options: dict[str, Any],
                    on_ready: Callable[[Engine], None]) -> None:
        async with open_engine(model, **options) as engine:
            # Unbounded: each caller thread has at most one job queued at a time (it waits
            # for its answer), so the buffer holds at most as many jobs as threads.
            send, receive = trio.open_memory_channel[_Job](math.inf)
            with receive, trio.CancelScope() as scope:
                with self._lock:
                    if self._closed:
                        return
                    self._token = trio.lowlevel.current_trio_token()
                    self._scope, self._jobs = scope, send
                on_ready(engine)
                try:
                    async with trio.open_nursery() as nursery:
                        async for job in receive:
                            nursery.start_soon(job.run, engine)
                finally:
                    # Closed: jobs handed over but never started are answered too.
                    while True:
                        try:
                            receive.receive_nowait().events.put(_Finished(None))
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break

    # -- the callers' threads ------------------------------------------------------------

    def call(self, work: Work[T], on_event: Emit | None = None) -> T:
        """``await work(engine, emit)`` on the engine's thread; each ``emit(event)`` there
        becomes ``on_event(event)`` here. Ctrl-C (``KeyboardInterrupt`` in this thread),
        or any other exception here (``on_event`` raising), cancels the work and waits
        until it has unwound before it propagates."""
        job = _Job(work)
        jobs = self._jobs_send()
        release_openmp_team()  # (see engine.actors.model_thread): this thread waits now

        def hand() -> None:
            try:
                jobs.send_nowait(job)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise EngineDeadError("the LLM is closed") from None
            job.handed = True

        try:
            self._to_trio(hand)
            return self._wait(job, on_event)
        finally:
            if not job.finished:  # Ctrl-C here, or on_event raised: nobody waits for it
                self._cancel(job)

    def run_sync(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the engine's thread (reading its statistics, ...)."""
        return self._to_trio(fn)

    def _jobs_send(self) -> trio.MemorySendChannel[_Job]:
        with self._lock:
            if self._closed or self._jobs is None:
                raise EngineDeadError("the LLM is closed")
            return self._jobs

    def _to_trio(self, fn: Callable[..., T], *args: Any) -> T:
        if trio.lowlevel.in_trio_task():
            # It would block the caller's own event loop until the call ends.
            raise RuntimeError("engine.LLM is synchronous: from trio code use "
                               "engine.open_engine, or call it in trio.to_thread.run_sync")
        token = self._token
        if token is None:
            raise EngineDeadError("the LLM is closed")
        try:
            return trio.from_thread.run_sync(fn, *args, trio_token=token)
        except trio.RunFinishedError:
            raise EngineDeadError("the LLM is closed") from None

    def _wait(self, job: _Job, on_event: Emit | None) -> Any:
        while True:
            try:
                event = job.events.get(timeout=_LIVENESS_SECONDS)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise EngineDeadError("the engine's thread has ended") from None
                continue
            if isinstance(event, _Finished):
                job.finished = True
                if event.outcome is None:
                    raise EngineDeadError("the LLM was closed while this call ran")
                return event.outcome.unwrap()
            if on_event is not None:
                on_event(event)

    def _cancel(self, job: _Job) -> None:
        """Cancel ``job`` and wait until it has unwound (its requests aborted)."""
        try:
            self._to_trio(job.cancel)
        except EngineDeadError:
            return  # the engine is gone, and the job with it
        if not job.handed:
            return  # interrupted before the engine thread took it: it never runs
        while self._thread.is_alive():
            try:
                if isinstance(job.events.get(timeout=_LIVENESS_SECONDS), _Finished):
                    job.finished = True
                    return
            except queue.Empty:
                continue

    def close(self) -> None:
        """Stop the engine (running calls fail with :class:`EngineDeadError`) and wait
        for its thread to end. Safe to call twice, and from any thread."""
        with self._lock:
            self._closed = True
            token, scope = self._token, self._scope
        if token is not None and scope is not None:
            try:
                # Not from_thread: close may run on the engine's own thread (a finalizer
                # the garbage collector runs there), and run_sync_soon is safe anywhere.
                token.run_sync_soon(scope.cancel)
            except trio.RunFinishedError:
                pass
        if threading.current_thread() is not self._thread:
            self._thread.join()

    @property
    def closed(self) -> bool:
        return self._closed
