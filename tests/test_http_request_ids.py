"""Request ids are the clients' labels: ids a request derives from its own (`dupx` with
n = 2 samples, or with two prompts) may equal another request's id, and two requests may
send the same id. None of that may cross their outputs, end one with the other's abort, or
leave a stream waiting on a sample that is gone (issue 28: `dupx` with n = 2 then `dupx-0`
ended the second at once with "abort" and hung the first's choice 0 for good)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
from engine_helpers import tiny_model
from http_server import ServerThread

import engine

# A hang guard: each request here is a few dozen tiny-model tokens.
DEADLINE_SECONDS = 60
MAX_TOKENS = 48  # long enough that the first request still runs when the second arrives
PROMPT = [5, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tiny_model(tmp_path_factory)
    opener = lambda: engine.open_engine(  # noqa: E731
        str(model), dtype="float32", max_model_len=128, max_num_seqs=8,
        kv_cache_memory=4 * 1024 * 1024, served_model_name="tiny")
    with ServerThread(opener) as srv:
        yield srv


def _body(n: int, stream: bool, prompts: int = 1) -> dict[str, Any]:
    prompt: Any = PROMPT if prompts == 1 else [PROMPT[: 3 + i] for i in range(prompts)]
    return {"model": "tiny", "prompt": prompt, "n": n, "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "temperature": 1.0, "seed": 3, "stream": stream}


async def _run(http: httpx.AsyncClient, request_id: str, body: dict[str, Any],
               running: trio.Event) -> dict[int, Any]:
    """One request to its end: {choice index: finish_reason}; asserts [DONE] when streamed.
    ``running`` is set once the request is known to be in the engine."""
    headers = {"X-Request-Id": request_id}
    if not body["stream"]:
        response = await http.post("/v1/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
        assert response.headers["X-Request-Id"] == request_id
        return {c["index"]: c["finish_reason"] for c in response.json()["choices"]}
    finished: dict[int, Any] = {}
    done = False
    async with http.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            assert not done, "data after [DONE]"
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            running.set()
            for choice in chunk["choices"]:
                if choice["finish_reason"] is not None:
                    assert choice["index"] not in finished, "a choice finished twice"
                    finished[choice["index"]] = choice["finish_reason"]
    assert done, "the stream ended without [DONE]"
    return finished


def _in_engine(server: ServerThread, samples: int) -> bool:
    return server.call(lambda: server.engine.statistics().running) >= samples


async def _first_then_second(server: ServerThread, first: tuple[str, dict[str, Any]],
                             second: tuple[str, dict[str, Any]]) -> list[dict[int, Any]]:
    """Send ``first``; once it runs in the engine, send ``second``; read both to the end."""
    results: list[dict[int, Any]] = [{}, {}]
    first_running = trio.Event()
    first_samples = first[1]["n"] * (len(first[1]["prompt"]) if isinstance(first[1]["prompt"][0], list) else 1)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=DEADLINE_SECONDS) as http:
        with trio.fail_after(DEADLINE_SECONDS):
            async with trio.open_nursery() as nursery:
                async def one(i: int, request: tuple[str, dict[str, Any]], event: trio.Event) -> None:
                    results[i] = await _run(http, *request, event)

                nursery.start_soon(one, 0, first, first_running)
                while not (first_running.is_set() or _in_engine(server, first_samples)):  # noqa: ASYNC110
                    await trio.sleep(0.005)
                nursery.start_soon(one, 1, second, trio.Event())
    return results


async def _assert_nothing_left(server: ServerThread) -> None:
    with trio.fail_after(DEADLINE_SECONDS):
        while server.metrics("engine:num_requests_running", "engine:num_requests_waiting") != (0, 0):  # noqa: ASYNC110
            await trio.sleep(0.01)
    stats = server.call(server.engine.statistics)
    assert stats.kv_blocks_free == stats.kv_blocks_total


def _every_choice_finished(result: dict[int, Any], choices: int) -> None:
    assert result == {i: "length" for i in range(choices)}


STREAM = pytest.mark.parametrize("stream", [True, False], ids=["streamed", "non_streamed"])


@STREAM
async def test_a_request_id_equal_to_another_requests_derived_sample_id(server, stream) -> None:
    first, second = await _first_then_second(
        server, ("dupx", _body(2, stream)), ("dupx-0", _body(1, stream)))
    _every_choice_finished(first, 2)
    _every_choice_finished(second, 1)
    await _assert_nothing_left(server)


@STREAM
async def test_derived_sample_ids_equal_to_a_running_requests_id(server, stream) -> None:
    first, second = await _first_then_second(
        server, ("dupx-0", _body(1, stream)), ("dupx", _body(2, stream)))
    _every_choice_finished(first, 1)
    _every_choice_finished(second, 2)
    await _assert_nothing_left(server)


@STREAM
async def test_derived_prompt_ids_and_the_engines_own_suffix_collide_with_nothing(
    server, stream
) -> None:
    # Two prompts derive `dupy-0` and `dupy-1`; the second request takes the first of them
    # with n = 2, and the form of the engine's sample ids (`<id>#<serial>.<i>`) as well.
    first, second = await _first_then_second(
        server, ("dupy", _body(2, stream, prompts=2)), ("dupy-0", _body(2, stream)))
    _every_choice_finished(first, 4)
    _every_choice_finished(second, 2)
    first, second = await _first_then_second(
        server, ("z", _body(2, stream)), ("z#0.1", _body(2, stream)))
    _every_choice_finished(first, 2)
    _every_choice_finished(second, 2)
    await _assert_nothing_left(server)


@STREAM
async def test_two_requests_with_the_same_id_are_both_served(server, stream) -> None:
    first, second = await _first_then_second(
        server, ("same", _body(2, stream)), ("same", _body(2, stream)))
    _every_choice_finished(first, 2)
    _every_choice_finished(second, 2)
    await _assert_nothing_left(server)
