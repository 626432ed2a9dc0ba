"""Disconnect storm: hundreds of clients on raw sockets leave at random points (before
the request head is complete, before the body is, while waiting for a non-streamed
answer, after the first chunk, mid-stream). Afterwards nothing runs, nothing waits, no KV
block is held, and the server answers as before."""

from __future__ import annotations

import json
import random
import re
import time

import httpx
import pytest
import trio
from engine_helpers import tiny_model
from http_server import ServerThread

import engine

CLIENTS = 200
AT_ONCE = 48  # connections open together; the rest queue behind a limiter
IDLE_LIMIT = 60.0  # hang guard for the engine to go idle


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tiny_model(tmp_path_factory)
    opener = lambda: engine.open_engine(  # noqa: E731
        str(model), dtype="float32", max_model_len=256, max_num_seqs=16,
        kv_cache_memory=4 * 1024 * 1024, served_model_name="tiny")
    with ServerThread(opener) as srv:
        yield srv


def _request(body: dict[str, object]) -> tuple[bytes, bytes]:
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode()
    return head, data


async def _leave(host: str, port: int, how: str, rng: random.Random) -> None:
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        body = {"prompt": [rng.randrange(3, 300) for _ in range(rng.randint(1, 40))],
                "max_tokens": rng.randint(8, 40), "ignore_eos": True,
                "stream": how in ("first_chunk", "mid_stream")}
        head, data = _request(body)
        if how == "partial_head":
            await stream.send_all(head[: rng.randrange(1, len(head) - 1)])
            return
        if how == "partial_body":
            await stream.send_all(head + data[: rng.randrange(0, len(data) - 1)])
            return
        await stream.send_all(head + data)
        if how == "waiting":
            await trio.sleep(rng.uniform(0.0, 0.3))
            return
        received = b""
        want = b"data: " if how == "first_chunk" else b"x" * 0
        with trio.move_on_after(30):
            while True:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    return
                received += chunk
                if how == "first_chunk" and want in received.partition(b"\r\n\r\n")[2]:
                    return
                if how == "mid_stream" and received.count(b"data: ") >= rng.randint(2, 10):
                    return


async def test_a_disconnect_storm_leaves_nothing_running_and_no_block_held(server) -> None:
    host, port = server.base_url.removeprefix("http://").split(":")
    ways = ["partial_head", "partial_body", "waiting", "first_chunk", "mid_stream"]
    rng = random.Random(5)
    limiter = trio.CapacityLimiter(AT_ONCE)

    async def one(i: int) -> None:
        async with limiter:
            await _leave(host, int(port), ways[i % len(ways)], random.Random(rng.random()))

    async with trio.open_nursery() as nursery:
        for i in range(CLIENTS):
            nursery.start_soon(one, i)

    def idle() -> bool:
        stats = server.call(server.engine.statistics)
        return (stats.running == 0 and stats.waiting == 0
                and stats.kv_blocks_free == stats.kv_blocks_total)

    deadline = time.monotonic() + IDLE_LIMIT
    while not idle() and time.monotonic() < deadline:  # noqa: ASYNC110 - the engine runs in another thread
        await trio.sleep(0.02)
    stats = server.call(server.engine.statistics)
    assert (stats.running, stats.waiting) == (0, 0)
    assert stats.kv_blocks_free == stats.kv_blocks_total
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        metrics = (await client.get("/metrics")).text
        assert re.search(r'^engine:kv_cache_usage_perc\{[^}]*\} 0\.0$', metrics, re.MULTILINE)
        # Requests were cut short, not run to their end: their aborts were counted.
        aborted = re.search(r'^engine:request_success_total\{[^}]*finished_reason="abort"[^}]*\} '
                            r"(\S+)$", metrics, re.MULTILINE)
        assert aborted is not None and float(aborted.group(1)) > 0
        response = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
        assert response.status_code == 200
        assert (await client.get("/health")).status_code == 200
