"""Grammar compiles are bounded (issues 27 and 28): they run in worker processes that are
killed past ``--grammar-compile-timeout`` or when their caller leaves, under a limiter of
their own, so a pathological schema neither holds a core nor delays anything else.

The slow constraint is the issue's: a schema ``pattern`` ``^[a-z]{1,30000}$`` compiles for
minutes (on the tiny model's 384 tokens too). Timeouts here are hang guards only.
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import trio
from engine_helpers import collect, greedy, tiny_model, wait_until
from http_server import ServerThread

import engine
from engine.core.admission import THREAD_PROMPT_CHARS
from engine.errors import InvalidParamError, PromptTooLongError
from engine.params import SamplingParams
from engine.structured import StructuredOutputs

SLOW = {"type": "string", "pattern": "^[a-z]{1,30000}$"}
QUICK = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                "maximum": 9}}, "required": ["n"]}
ENGINE = dict(dtype="float32", max_model_len=512, kv_cache_memory=8 * 2**20,
              grammar_compile_workers=2)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory)


def _slow(i: int = 0) -> SamplingParams:
    # A distinct pattern per request: identical ones would wait on one compile.
    spec = StructuredOutputs(json={**SLOW, "pattern": f"^[a-z]{{1,{30000 + i}}}$"})
    return SamplingParams(max_tokens=4, structured_outputs=spec)


def test_a_compile_past_its_budget_is_a_400_while_health_answers(model: Path) -> None:
    with ServerThread(lambda: engine.open_engine(str(model), grammar_compile_timeout=3.0,
                                                 **ENGINE)) as server:
        url = server.base_url
        answer: list[httpx.Response] = []
        body = {"model": server.engine.model_name, "prompt": "x", "max_tokens": 4,
                "guided_json": SLOW}
        slow = threading.Thread(target=lambda: answer.append(
            httpx.post(url + "/v1/completions", json=body, timeout=120)))
        slow.start()
        def stats() -> Any:
            return server.call(server.engine._compiles.statistics)

        deadline = time.monotonic() + 60
        while stats().busy == 0:  # the compile is running in its worker
            assert time.monotonic() < deadline
            time.sleep(0.05)
        health = httpx.get(url + "/health", timeout=30)
        assert health.status_code == 200
        assert stats().busy == 1  # /health answered during the compile
        slow.join(120)
        r = answer[0]
        assert r.status_code == 400, r.text
        assert "--grammar-compile-timeout" in r.json()["error"]["message"]
        assert stats().killed == 1
        # The refused spec is not cached; the next constraint compiles in a new worker
        # and its output is valid.
        before = server.call(server.engine.structured_statistics)
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            **body, "guided_json": QUICK, "max_tokens": 40, "seed": 1})
        assert r.status_code == 200, r.text
        if r.json()["choices"][0]["finish_reason"] == "stop":
            import json

            jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), QUICK)
        assert server.call(server.engine.structured_statistics).compiles == before.compiles + 1


async def test_a_compile_whose_caller_left_is_killed(model: Path) -> None:
    async with engine.open_engine(str(model), grammar_compile_timeout=600, **ENGINE) as eng:
        pool = eng._compiles
        with trio.CancelScope() as scope:
            async def leave_once_compiling() -> None:
                await wait_until(lambda: pool.statistics().busy == 1)
                scope.cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(leave_once_compiling)
                await eng.submit("x", _slow())
        assert scope.cancelled_caught
        stats = pool.statistics()
        assert (stats.killed, stats.busy, stats.workers) == (1, 0, 0)


async def test_queued_slow_compiles_leave_the_tokenizer_threads_free(model: Path) -> None:
    # 46 slow compiles used up trio's 40 threads: a long prompt (tokenized in a thread)
    # waited for a minute. Now two compile in workers and the rest wait without a thread.
    async with engine.open_engine(str(model), grammar_compile_timeout=600, **ENGINE) as eng:
        pool = eng._compiles
        async with trio.open_nursery() as nursery:
            for i in range(46):
                nursery.start_soon(eng.submit, "x", _slow(i))
            await wait_until(lambda: pool.statistics().waiting == 44)
            # Tokenized in a trio worker thread (longer than THREAD_PROMPT_CHARS), then
            # refused as longer than the context: the thread was there to do it.
            long_prompt = "word " * (THREAD_PROMPT_CHARS // 5 + 1)
            with trio.fail_after(120), pytest.raises(PromptTooLongError):  # a hang guard
                await eng.submit(long_prompt, greedy(2))
            assert pool.statistics().waiting == 44
            nursery.cancel_scope.cancel()
        assert pool.statistics().busy == 0 and pool.statistics().workers == 0


async def test_a_refused_spec_leaves_the_cache_alone(model: Path) -> None:
    async with engine.open_engine(str(model), grammar_compile_timeout=600, **ENGINE) as eng:
        quick = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(json=QUICK))
        await collect(eng, "x", quick)
        with pytest.raises(InvalidParamError):
            await eng.submit("x", SamplingParams(structured_outputs=StructuredOutputs(
                json={"type": "array", "contains": {"const": 1}})))
        before = eng.structured_statistics()
        await collect(eng, "x", quick)
        after = eng.structured_statistics()
        # Still cached (a hit, no compile): the refusal evicted nothing.
        assert after.compiles == before.compiles and after.cache_hits > before.cache_hits


def test_sigterm_with_40_abandoned_compiles_exits_within_the_shutdown_timeout(
        model: Path) -> None:
    from test_http_cli import _server

    shutdown_timeout = 20.0
    with _server(model, "--shutdown-timeout", str(shutdown_timeout),
                 "--grammar-compile-timeout", "600") as (proc, url, log):
        name = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]

        def abandon(i: int) -> None:
            body = {"model": name, "prompt": "x", "max_tokens": 4,
                    "guided_json": {**SLOW, "pattern": f"^[a-z]{{1,{30000 + i}}}$"}}
            try:  # the client leaves before the answer
                httpx.post(url + "/v1/completions", json=body, timeout=3)
            except httpx.TimeoutException:
                pass

        clients = [threading.Thread(target=abandon, args=(i,)) for i in range(40)]
        for c in clients:
            c.start()
        for c in clients:
            c.join(60)
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        # All 40 reached their compile before their clients left.
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert re.search(r'^engine:structured_output_requests_total\{[^}]*kind="json"[^}]*\} '
                         r"40(\.0)?$", metrics, re.MULTILINE), metrics
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=shutdown_timeout)
        except subprocess.TimeoutExpired:
            pytest.fail("the server outlived --shutdown-timeout:\n" + "".join(log))
        assert time.monotonic() - sent < shutdown_timeout
    text = "".join(log)
    assert proc.returncode == 0, text
    assert "shut down cleanly" in text



async def test_the_embedded_default_compiles_in_threads_and_refuses_past_the_budget(
        model: Path) -> None:
    # grammar_compile_workers=0: no process; a compile past the budget is refused (and
    # abandoned: {1,3000} finishes its thread a second or so later).
    options = {**ENGINE, "grammar_compile_workers": 0}
    async with engine.open_engine(str(model), grammar_compile_timeout=0.2, **options) as eng:
        # Cached beforehand: on a loaded machine even QUICK may take longer than 0.2 s.
        eng._parts.grammar.compile(StructuredOutputs(json=QUICK))
        spec = StructuredOutputs(json={**SLOW, "pattern": "^[a-z]{1,3000}$"})
        with pytest.raises(InvalidParamError, match="grammar-compile-timeout"):
            await eng.submit("x", SamplingParams(max_tokens=4, structured_outputs=spec))
        outs = await collect(eng, "x", SamplingParams(
            max_tokens=40, seed=0, structured_outputs=StructuredOutputs(json=QUICK)))
        assert eng._compiles.statistics().workers == 0
        if outs[-1].finish_reason == "stop":
            import json

            jsonschema.validate(json.loads("".join(o.text for o in outs)), QUICK)
        # The abandoned compile finishes into the cache (and no thread is left running
        # in C++ when the interpreter exits).
        with trio.fail_after(120):
            await wait_until(lambda: eng._parts.grammar.is_cached(spec))


async def test_a_grammar_past_the_size_budget_is_refused(model: Path) -> None:
    # QUICK compiles to about 2 KB on the tiny vocabulary (its token-mask cache).
    options = {**ENGINE, "grammar_compile_workers": 1}
    async with engine.open_engine(str(model), grammar_max_bytes=1024, **options) as eng:
        spec = StructuredOutputs(json=QUICK)
        with pytest.raises(InvalidParamError, match="--grammar-max-bytes"):
            await eng.submit("x", SamplingParams(max_tokens=4, structured_outputs=spec))
        assert not eng._parts.grammar.is_cached(spec)
        # The worker answered the refusal itself: it was not killed and stays for the next.
        stats = eng._compiles.statistics()
        assert (stats.killed, stats.workers) == (0, 1)


async def test_a_grammar_lost_while_its_request_waits_compiles_again_through_the_pool(
        model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache of one grammar and two structured requests waiting behind a long one: the
    second compile does not evict the first's grammar (each live request holds its own,
    from its compile on; a prepared request dropped before it is queued holds nothing);
    one dropped from the cache anyway is compiled again through the compile pool, its
    limiter and its budget, when the request runs. No compile ever runs on the model
    thread, and both outputs match their patterns."""
    from engine.structured.backend import GrammarBackend

    where: list[str] = []
    compile_uncached = GrammarBackend.compile_uncached

    def recorded(self: GrammarBackend, spec: StructuredOutputs) -> Any:
        where.append(threading.current_thread().name)
        return compile_uncached(self, spec)

    monkeypatch.setattr(GrammarBackend, "compile_uncached", recorded)
    patterns = (r"(yes|no) [0-9]{2,4}", r"[a-c]{3,6}!")
    specs = [StructuredOutputs(regex=p) for p in patterns]
    options = {**ENGINE, "grammar_compile_workers": 0, "max_num_seqs": 1}
    async with engine.open_engine(str(model), **options) as eng:
        grammar = eng._parts.grammar
        grammar._cache_size = 1
        texts: dict[int, str] = {}
        # A prepared request holds its grammar until it is queued; one dropped instead
        # leaves no hold behind.
        prepared = await eng.prepare([7, 8, 9], SamplingParams(
            structured_outputs=StructuredOutputs(regex="[0-9]{2}")))
        assert grammar.statistics().held == 1
        del prepared
        assert grammar.statistics().held == 0

        async def constrained(i: int) -> None:
            outs = await collect(eng, [7, 8, 9], SamplingParams(
                max_tokens=40, temperature=0, structured_outputs=specs[i]))
            texts[i] = "".join(o.text for o in outs)

        with trio.fail_after(120):
            # One sequence at a time: both wait behind this one.
            long = await eng.submit([3, 4, 5], greedy(eng.max_model_len - 8))
            async with long:
                await long.__anext__()
                async with trio.open_nursery() as nursery:
                    for i in (0, 1):
                        nursery.start_soon(constrained, i)
                    await wait_until(lambda: eng.statistics().waiting == 2)  # both admitted
                    assert grammar.statistics().held == 2
                    assert all(grammar.is_cached(s) for s in specs)  # over the cache's size
                    # Lost anyway (what a hold prevents): the runner must not compile it.
                    del grammar._cache[specs[0].key]
                    await long.aclose()  # the waiting requests run now
        stats, pool = grammar.statistics(), eng._compiles.statistics()
    for i, pattern in enumerate(patterns):
        assert re.fullmatch(pattern, texts[i]), texts[i]
    assert (stats.recompiles, pool.recompiles) == (1, 1)
    assert len(where) == pool.compiles == 4  # three at admission, one again
    assert "engine-model" not in where
    assert stats.held == 0 and stats.evictions >= 1  # released once done, back to size
