"""All model work of a process runs on one OS thread (engine/model_thread.py): OpenMP gives
each calling thread its own thread team, and two teams on two cores slow every later step
(measured: 6-7 ms a SmolLM2 step became 15-16 ms once a step had run on a second thread)."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from engine_helpers import collect, greedy, native_threads, tiny_model, token_ids

import engine
from engine.actors import model_thread
from engine.actors.model_thread import model_thread_ident, release_openmp_team, run_in_model_thread
from engine.runner.model_runner import ModelRunner


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory)


async def test_loading_every_step_and_reset_run_on_the_one_model_thread(
        model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    for name in ("__init__", "execute", "reset"):
        original = getattr(ModelRunner, name)

        def record(self: ModelRunner, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            seen.append(threading.get_ident())
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(ModelRunner, name, record)
    async with engine.open_engine(str(model), dtype="float32", kv_cache_memory=2**22) as eng:
        async with trio.open_nursery() as nursery:
            # Other work on trio's worker threads meanwhile, so its thread cache holds
            # several idle threads a step could have landed on.
            for _ in range(4):
                nursery.start_soon(trio.to_thread.run_sync, time.sleep, 0.02)
            for prompt in ([5, 6, 7], [8, 9, 10, 11], [12, 13]):
                nursery.start_soon(collect, eng, prompt, greedy(12))
        await collect(eng, [3, 4], greedy(4))
        await run_in_model_thread(eng._parts.runner.reset)
    assert len(seen) > 12
    assert set(seen) == {model_thread_ident()}
    assert model_thread_ident() != threading.get_ident()


async def test_an_exception_comes_back_and_a_cancel_waits_for_the_job() -> None:
    def fail() -> None:
        raise ValueError("from the model thread")

    with pytest.raises(ValueError, match="from the model thread"):
        await run_in_model_thread(fail)
    done = threading.Event()

    def slow() -> int:
        time.sleep(0.2)
        done.set()
        return 7

    got = None
    with trio.move_on_after(0.01):
        got = await run_in_model_thread(slow)
    assert got == 7 and done.is_set()  # past the deadline, the job was waited for, not abandoned
    assert await run_in_model_thread(lambda: 3) == 3


async def test_two_engines_in_one_process_share_the_thread_and_both_answer(model: Path) -> None:
    async with engine.open_engine(str(model), dtype="float32", kv_cache_memory=2**22) as a, \
            engine.open_engine(str(model), dtype="float32", kv_cache_memory=2**22) as b:
        out: dict[str, list[int]] = {}

        async def one(name: str, eng: Any) -> None:
            out[name] = token_ids(await collect(eng, [5, 6, 7, 8], greedy(10)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "a", a)
            nursery.start_soon(one, "b", b)
    assert out["a"] == out["b"] and len(out["a"]) == 10


def test_a_closed_engine_leaves_nothing_of_itself_on_the_model_thread(model: Path) -> None:
    """The model thread lets go of each job once it is done: the last step's function held
    the runner (the model, its KV pool) and its task the engine, which a closed engine in a
    long-lived process kept resident until another engine's first job."""
    refs: list[weakref.ref[Any]] = []

    async def serve_once() -> None:
        async with engine.open_engine(str(model), dtype="float32", kv_cache_memory=2**22) as eng:
            await collect(eng, [5, 6, 7], greedy(3))
            refs.extend([weakref.ref(eng._parts.runner), weakref.ref(eng)])

    trio.run(serve_once)
    gc.collect()
    assert [ref() for ref in refs] == [None, None]


def test_an_engine_held_after_its_close_lets_its_model_go(model: Path) -> None:
    """``with LLM(a) as llm`` then ``with LLM(b) as llm`` held both models while b loaded:
    the stopped actors and the engine's parts kept the runner. They let go of it at the
    close; the engine's counters stay readable."""
    held: list[Any] = []

    async def serve_once() -> None:
        async with engine.open_engine(str(model), dtype="float32", kv_cache_memory=2**22) as eng:
            await collect(eng, [5, 6, 7], greedy(3))
            held.extend([eng, weakref.ref(eng._parts.runner)])

    trio.run(serve_once)
    gc.collect()
    eng, runner = held
    assert runner() is None
    assert eng.statistics().requests_finished == 1


def test_releasing_a_threads_openmp_team_ends_its_workers() -> None:
    """A thread's matmul over two torch threads starts a team (a libgomp worker thread
    that stays, idle); released, the worker ends, while another live thread's team stays."""
    found: dict[str, Any] = {}
    a = torch.randn(512, 512)
    holding, done = threading.Event(), threading.Event()

    def team_of_a_thread(name: str, release: bool) -> None:
        before = native_threads()
        torch.set_num_threads(2)
        a @ a  # noqa: B018 -- a parallel region, for its team
        found[name] = native_threads() - before
        if release:
            found["released"] = release_openmp_team()
            found["after"] = native_threads()
        else:
            holding.set()
            done.wait()

    threads = torch.get_num_threads()
    other = threading.Thread(target=team_of_a_thread, args=("other", False))
    try:
        other.start()
        holding.wait()
        this = threading.Thread(target=team_of_a_thread, args=("this", True))
        this.start()
        this.join()
    finally:
        done.set()
        other.join()
        torch.set_num_threads(threads)
    assert found["other"] and found["this"]  # each thread's region started workers of its own
    assert found["released"] is True
    assert not found["this"] & found["after"]  # its workers ended
    assert found["other"] <= found["after"]  # the other thread's team is its own, and stays


def test_the_engine_releases_its_callers_team_and_the_model_threads(
        model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``engine.LLM`` releases the team of the thread that waits for it (at opening and
    at each call), and the model thread's team when it closes."""
    calls: list[str] = []

    def record() -> bool:
        calls.append("model" if threading.get_ident() == model_thread_ident() else threading.current_thread().name)
        return release_openmp_team()

    for module in ("engine.api.engine_thread", "engine.api.open"):
        monkeypatch.setattr(f"{module}.release_openmp_team", record)
    assert model_thread.release_openmp_team is release_openmp_team  # the real one, as the spy calls
    llm = engine.LLM(str(model), dtype="float32", kv_cache_memory=2**22)
    opened = list(calls)
    llm.generate({"prompt_token_ids": [5, 6, 7]}, engine.SamplingParams(max_tokens=2), use_tqdm=False)
    called = list(calls)
    llm.close()
    me = threading.current_thread().name
    assert opened[0] == me and "model" not in opened
    assert called[len(opened):] == [me]
    assert calls[len(called):] == ["model"]
