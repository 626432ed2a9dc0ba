"""One OS thread for all model work in a process: loading, warm-up, every step, reset.

``trio.to_thread.run_sync`` takes whichever cached worker thread is idle, so consecutive
steps may run on different OS threads. The CPU kernels and torch's intra-op pool are
OpenMP, whose thread team belongs to the thread that opens the parallel region: a second
calling thread gets a second team, and the two teams then share the two cores. Measured on
the dev machine (SmolLM2 Q4_1, one stream): once a step had run on a second thread, every
later step took 15-16 ms instead of 6-7 ms, for the rest of the process. Running all model
work here keeps one team.

The wait is not cancellable, as ``to_thread.run_sync`` without ``abandon_on_cancel``: the
model writes the KV cache, so a step is never abandoned half done.

The caller's own threads are the other way in: an application that ran torch on its main
thread (two threads, the cores' count) holds a team of its own, idle in libgomp's pool, and
from then on libgomp counts more threads than CPUs and stops spinning at its barriers (it
sleeps and wakes at each parallel region instead). Measured on the dev machine (SmolLM2
Q4_1, ``engine.LLM``, one stream): 270-285 tok/s, but 77-80 once the caller's thread had
run one matmul before opening the engine; the model thread's idle team costs the caller's
torch work the same after the engine closes. :func:`release_openmp_team` hands a thread's
team back (OpenMP 5's ``omp_pause_resource_all``): the engine calls it on a thread that is
about to wait for it (``engine.LLM``'s caller, :func:`engine.open_engine`'s), on the model
thread when an engine closes, and on one of trio's worker threads after it preprocessed a
request's media (:func:`then_release_team`: Whisper's features are torch's STFT).
"""

from __future__ import annotations

import ctypes
import functools
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

T = TypeVar("T")

_lock = threading.Lock()
_jobs: queue.SimpleQueue[tuple[Callable[[], Any], trio.lowlevel.TrioToken, Any]] | None = None


def _serve(jobs: queue.SimpleQueue[tuple[Callable[[], Any], trio.lowlevel.TrioToken, Any]]) -> None:
    while True:
        fn, token, task = jobs.get()
        result = outcome.capture(fn)
        # Let go of the job before its caller runs again: its function holds what it
        # closed over (the model runner, for a step) and its task the caller's frames (the
        # engine), which an engine closed in a long-lived process would otherwise keep
        # resident, model and all, until another engine's first job. The task and result
        # travel in a box that the trio side empties as it wakes the task, so this thread
        # holds neither from the moment the caller can go on (deleting them after handing
        # them over raced the caller, which could finish first on a busy machine).
        box = [task, result]
        del fn, task, result
        try:
            token.run_sync_soon(_wake, box)
        except trio.RunFinishedError:  # the caller's trio.run is gone; nobody waits
            box.clear()
        del token, box


def _wake(box: list[Any]) -> None:
    """On the trio thread: reschedule the job's task with its result, emptying the box."""
    task, result = box
    box.clear()
    trio.lowlevel.reschedule(task, result)


def _queue() -> queue.SimpleQueue[tuple[Callable[[], Any], trio.lowlevel.TrioToken, Any]]:
    global _jobs
    with _lock:
        if _jobs is None:
            jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(jobs,), name="engine-model", daemon=True).start()
            _jobs = jobs
        return _jobs


async def run_in_model_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the process's model thread; its result or exception comes back
    here. Jobs run one at a time, in the order they were given."""
    jobs = _queue()
    await trio.lowlevel.checkpoint_if_cancelled()
    jobs.put((lambda: fn(*args), trio.lowlevel.current_trio_token(), trio.lowlevel.current_task()))

    def abort(_: Any) -> trio.lowlevel.Abort:
        return trio.lowlevel.Abort.FAILED  # never abandoned (see the module docstring)

    return await trio.lowlevel.wait_task_rescheduled(abort)  # type: ignore[no-any-return]


# omp_pause_resource_all's kind that frees the calling thread's pool of team threads.
_OMP_PAUSE_HARD = 2


def release_openmp_team() -> bool:
    """Hand the calling thread's OpenMP team back to libgomp (its worker threads end; the
    thread's next parallel region starts a new team). Whether it did: False where torch's
    OpenMP is not libgomp or has no ``omp_pause_resource_all``, or inside a parallel region.
    Safe to call on any thread at any time; it touches no other thread's team."""
    pause = _omp_pause_resource_all()
    return pause is not None and pause(_OMP_PAUSE_HARD) == 0


@functools.cache
def _omp_pause_resource_all() -> Any:
    if "torch" not in sys.modules:
        return None  # torch not loaded: no team of its, and dlopen here would pick a libgomp for it
    try:
        pause = ctypes.CDLL("libgomp.so.1").omp_pause_resource_all  # the copy torch loaded
    except (OSError, AttributeError):
        return None
    pause.argtypes, pause.restype = (ctypes.c_int,), ctypes.c_int
    return pause


def then_release_team(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, then the calling thread's OpenMP team released: for work that may run
    torch on one of trio's worker threads (an audio clip's features), whose idle team would
    slow the model thread's steps for as long as trio keeps that thread."""
    try:
        return fn(*args)
    finally:
        release_openmp_team()


def model_thread_ident() -> int | None:
    """The model thread's ident once it has started (tests read it)."""
    for thread in threading.enumerate():
        if thread.name == "engine-model":
            return thread.ident
    return None
