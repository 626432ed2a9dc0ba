"""The engine core in processes of its own (issue 20): parity, faults, the wire.

Each engine here spawns engine-core processes (``python -m engine.process.core``) that
load the tiny model themselves; the front end talks to them in msgpack frames over a Unix
socket. What is checked: greedy outputs identical in-process, with one core process and
with two data-parallel cores; a core killed with SIGKILL mid-stream (its requests fail with
EngineDeadError, the core restarts, later requests are served, nothing hangs); the front end
killed (every core gone within 5 s); peers that send garbage, an oversized frame or the
wrong secret (dropped, logged, serving goes on); a client that stops reading never stalls
the core; and the frame decoder builds nothing but message types.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
from engine_helpers import collect, greedy, random_prompts, tiny_model, token_ids, wait_until

import engine
from engine import messages
from engine.errors import EngineDeadError
from engine.params import SamplingParams
from engine.process import wire as corewire
from engine.process.cores import CoreState

OPTIONS: dict[str, Any] = dict(
    dtype="float32", max_num_seqs=16, max_num_batched_tokens=64, block_size=16,
    kv_cache_memory=4 * 1024 * 1024,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory)


async def _greedy_all(eng: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    results: list[list[int]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        results[i] = token_ids(await collect(eng, prompts[i], greedy(max_tokens)))

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return results


async def test_greedy_outputs_are_identical_in_process_in_one_core_process_and_with_two_cores(
    model: Path,
) -> None:
    prompts = random_prompts(12, vocab=300, lo=2, hi=70, seed=7)
    outputs = {}
    for name, extra in (("inprocess", {}), ("process", {"engine_core": "process"}),
                        ("dp2", {"data_parallel_size": 2})):
        async with engine.open_engine(str(model), **OPTIONS, **extra) as eng:
            outputs[name] = await _greedy_all(eng, prompts, 24)
            if name == "dp2":
                stats = eng._pool.statistics()
                # Both cores took requests (least-loaded routing spreads a burst).
                assert all(state == "serving" for _, state, _ in stats.cores)
                assert eng.statistics().requests_finished == len(prompts)
    assert outputs["process"] == outputs["inprocess"]
    assert outputs["dp2"] == outputs["inprocess"]
    assert all(len(o) == 24 for o in outputs["inprocess"])


async def test_a_step_travels_as_one_frame_for_all_its_requests(model: Path) -> None:
    prompts = random_prompts(8, vocab=300, lo=2, hi=10, seed=3)
    async with engine.open_engine(str(model), **OPTIONS, engine_core="process") as eng:
        await _greedy_all(eng, prompts, 16)
        frames = eng._pool.statistics().frames_received
        steps = eng.statistics().steps
    # One frame a step with outputs (plus the hello): never one per token (8 x 16 = 128).
    assert frames <= steps + 1 < 8 * 16


async def test_a_core_killed_mid_stream_fails_its_requests_restarts_and_serves_on(
    model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with engine.open_engine(str(model), **OPTIONS, engine_core="process",
                                  max_engine_restarts=1) as eng:
        before = token_ids(await collect(eng, [1, 2, 3], greedy(8)))
        pid = eng._pool._cores[0].hello.pid
        errors: list[BaseException] = []
        got_tokens = trio.Event()

        async def victim() -> None:
            try:
                async for _ in eng.generate([5, 6, 7], SamplingParams(
                        max_tokens=400, temperature=0, ignore_eos=True)):
                    got_tokens.set()
            except EngineDeadError as exc:
                errors.append(exc)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(victim)
                nursery.start_soon(victim)
                await got_tokens.wait()
                os.kill(pid, signal.SIGKILL)
        assert len(errors) == 2 and "died" in str(errors[0])
        with trio.fail_after(60):
            await wait_until(lambda: eng._pool.serving == 1)
        assert eng.restarts == 1 and not eng.restarting
        after = token_ids(await collect(eng, [1, 2, 3], greedy(8)))
        assert eng._pool._cores[0].hello.pid != pid
    assert after == before
    assert "connection lost" in caplog.text


def _counters(eng: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every counter and histogram sample of the server's /metrics, as Prometheus's own
    parser reads the text the server would send."""
    from prometheus_client.parser import text_string_to_metric_families

    from engine.api.metrics import Metrics

    text = Metrics(eng, eng.model_name).render().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            if family.type in ("counter", "histogram")
            for sample in family.samples}


def _gone_back(before: dict[Any, float], after: dict[Any, float]) -> list[Any]:
    return [(key, value, after.get(key)) for key, value in before.items()
            if after.get(key, -1.0) < value]


async def test_a_lost_core_hands_the_requests_it_had_not_started_to_the_other_core(
    model: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Two engine cores, one sequence each, round-robin routing. A long request runs on
    core 0 and a second waits behind it there; core 0 is SIGKILLed once the first has
    streamed. The first stream ends with EngineDeadError; the waiting request, which had
    produced nothing, completes on core 1 with the greedy tokens a clean run gives; and
    no counter of /metrics ever goes back (at the kill, at the restart, after)."""
    async with engine.open_engine(str(model), **{**OPTIONS, "max_num_seqs": 1},
                                  data_parallel_size=2, data_parallel_routing="round-robin",
                                  max_engine_restarts=1) as eng:
        pool = eng._pool
        waiting_prompt = [11, 12, 13, 14]
        errors: list[BaseException] = []
        streamed = trio.Event()

        async def victim() -> None:  # round-robin: the first request goes to core 0
            try:
                async for _ in eng.generate([5, 6, 7], greedy(eng.max_model_len - 8)):
                    streamed.set()
            except EngineDeadError as exc:
                errors.append(exc)

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(victim)
                await streamed.wait()
                # The second request goes to core 1: the clean run, read after the kill (the
                # victim must still be running when core 0 dies, so nothing waits on it here).
                clean_stream = await eng.submit(waiting_prompt, greedy(12))
                # The third to core 0, where it waits behind the victim (one sequence).
                stream = await eng.submit(waiting_prompt, greedy(12))
                (sample,) = stream._mailbox.sample_ids
                await wait_until(lambda: sample in pool._owner)
                assert pool._owner[sample].index == 0 and sample in pool._cores[0].quiet
                victim_pid = pool._cores[0].hello.pid
                before = _counters(eng)
                os.kill(victim_pid, signal.SIGKILL)
            await wait_until(lambda: pool._cores[0].state is not CoreState.SERVING)
            at_kill = _counters(eng)
            async with stream:
                moved = token_ids([out async for out in stream])
            async with clean_stream:
                clean = token_ids([out async for out in clean_stream])
            await wait_until(lambda: pool.serving == 2)
            restarted = _counters(eng)
            again = token_ids(await collect(eng, waiting_prompt, greedy(12)))
            after = _counters(eng)
            # Nothing of the lost request is left in the front end.
            assert eng._handles.actors["detokenizer"].statistics().active == 0
            assert eng._handles.router.statistics().open_requests == 0
    assert len(errors) == 1 and "died" in str(errors[0])
    assert "1 request(s) it had not started moved" in caplog.text
    assert moved == clean == again and len(clean) == 12
    assert _gone_back(before, at_kill) == []
    assert _gone_back(at_kill, restarted) == []
    assert _gone_back(restarted, after) == []
    steps = ("engine:iteration_tokens_total_count", (("model_name", eng.model_name),))
    assert after[steps] > before[steps]


async def test_past_the_restart_budget_a_lost_core_leaves_the_engine_dead(model: Path) -> None:
    async with engine.open_engine(str(model), **OPTIONS, engine_core="process") as eng:
        os.kill(eng._pool._cores[0].hello.pid, signal.SIGKILL)
        with trio.fail_after(30):
            await eng.wait_dead()
        with pytest.raises(EngineDeadError):
            await eng.submit([1, 2, 3], greedy(4))


def _pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                alive.append(pid)
        except FileNotFoundError:
            pass
    return alive


def test_killing_the_front_end_takes_every_core_down_and_the_next_start_clears_its_files(
    model: Path,
) -> None:
    """A front end SIGKILLed: its cores exit within 5 s, and its cores' socket, left in
    the runtime folder (no cleanup runs), is removed by the next start, which keeps the
    files of a live engine process in the same folder."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="rt-"))  # short: a Unix socket's path holds 107 bytes
    script = textwrap.dedent(f"""
        import sys, trio, engine
        async def main():
            async with engine.open_engine({str(model)!r}, data_parallel_size=2,
                                          runtime_dir={str(root)!r}, **{OPTIONS!r}) as eng:
                print(eng._pool.unix_path, " ".join(str(c.hello.pid) for c in eng._pool._cores),
                      flush=True)
                await trio.sleep(600)
        trio.run(main)
    """)
    # A live engine process holding a folder of the runtime root the way a front end does.
    holder = textwrap.dedent(f"""
        import time
        from engine.process.runtime import runtime_folder
        with runtime_folder({str(root)!r}, "cores") as folder:
            print(folder, flush=True)
            time.sleep(600)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    front = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env,
                             text=True)
    live = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, env=env,
                            text=True)
    try:
        unix_path, *pids_text = front.stdout.readline().split()
        pids = [int(p) for p in pids_text]
        assert len(pids) == 2 and not set(pids) - set(_pids_alive(pids))
        front.kill()
        front.wait()
        deadline = time.monotonic() + 5
        while _pids_alive(pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _pids_alive(pids) == []
        leftover = Path(unix_path).parent
        assert leftover.parent == root and Path(unix_path).exists()
        held = Path(live.stdout.readline().strip())
        assert held.parent == root and held.is_dir()

        async def next_start() -> tuple[bool, bool, Path, int]:
            async with engine.open_engine(str(model), **OPTIONS, engine_core="process",
                                          runtime_dir=str(root)) as eng:
                served = len(token_ids(await collect(eng, [1, 2, 3], greedy(2))))
                return (leftover.exists(), held.is_dir(),  # noqa: ASYNC240 - a test's look
                        Path(eng._pool.unix_path).parent, served)

        leftover_kept, held_kept, mine, served = trio.run(next_start)
        assert not leftover_kept and held_kept and served == 2
        assert mine.parent == root and not mine.exists()  # a clean stop leaves nothing
    finally:
        for process in (front, live):
            process.kill()
            process.wait()
            process.stdout.close()
        shutil.rmtree(root, ignore_errors=True)


async def _peer(path: str) -> corewire.FrameStream:
    return corewire.FrameStream(await trio.open_unix_socket(path))


@pytest.mark.parametrize("attack", ["garbage", "wrong_secret", "oversized_frame", "bad_hello",
                                    "not_messages"])
async def test_a_hostile_peer_is_dropped_logged_and_serving_goes_on(
    model: Path, attack: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="engine")
    async with engine.open_engine(str(model), **OPTIONS, engine_core="process") as eng:
        before = token_ids(await collect(eng, [9, 8, 7], greedy(6)))
        peer = await _peer(eng._pool.unix_path)
        secret = eng._pool.secret
        with trio.fail_after(20):
            nonce = await peer.receive_exactly(corewire.NONCE_BYTES)
            if attack == "garbage":
                await peer.send_raw(os.urandom(4096))
            elif attack == "wrong_secret":
                await peer.send_raw(corewire.auth_digest(b"not the secret", nonce))
            else:
                await peer.send_raw(corewire.auth_digest(secret, nonce))
                if attack == "oversized_frame":
                    await peer.send_raw(corewire.HEADER.pack(2**31) + b"x" * 1024)
                elif attack == "bad_hello":
                    await peer.send((messages.AbortSamples(("x",)),))
                else:
                    payload = msgpack.packb({"__msg__": "os.system", "command": "true"})
                    await peer.send_raw(corewire.HEADER.pack(len(payload)) + payload)
            # The front end closes the connection.
            with pytest.raises((EOFError, trio.BrokenResourceError)):
                while True:
                    await peer.receive_exactly(1)
        await peer.aclose()
        after = token_ids(await collect(eng, [9, 8, 7], greedy(6)))
        assert eng._pool.serving == 1
    assert after == before
    assert "engine core connection dropped" in caplog.text


async def test_a_client_that_stops_reading_never_stalls_the_core(model: Path) -> None:
    async with engine.open_engine(str(model), **OPTIONS, engine_core="process") as eng:
        stuck = await eng.submit([4, 4, 4], SamplingParams(max_tokens=200, temperature=0,
                                                           ignore_eos=True))
        async with stuck:
            with trio.fail_after(60):
                # Requests after it finish while nobody reads the first one's stream.
                outs = await _greedy_all(eng, random_prompts(4, vocab=300, lo=2, hi=9, seed=5), 16)
                assert all(len(o) == 16 for o in outs)
                await wait_until(lambda: eng.statistics().running == 0)
            # Everything it produced waits, merged, in its mailbox.
            got = [t for out in [o async for o in stuck] for t in out.token_ids]
        assert len(got) == 200


def _nested(depth: int) -> list[Any]:
    value: list[Any] = [1]
    for _ in range(depth):
        value = [value]
    return value


def test_the_frame_decoder_builds_only_message_types() -> None:
    good = messages.pack((messages.AbortSamples(("a", "b")), messages.StopStringHit("a", "x")))
    assert corewire.decode_frame(good) == (messages.AbortSamples(("a", "b")),
                                           messages.StopStringHit("a", "x"))
    for bad in (
        msgpack.packb([1, 2, 3]),  # a list of primitives, not messages
        msgpack.packb({"__msg__": "Popen", "args": "rm"}),  # a type that is no message
        msgpack.packb([{"__msg__": "AbortSamples", "sample_ids": [], "extra": 1}]),
        msgpack.packb([{"__msg__": "AbortSamples"}]),  # a missing field
        b"\xc1",  # never used in msgpack
        msgpack.packb([b"x" * 10]),  # a bare blob is no message
        msgpack.packb([msgpack.ExtType(1, b"x")]),  # nor is an extension type
        msgpack.packb(_nested(20)),  # nested beyond any message
    ):
        with pytest.raises(corewire.WireError):
            corewire.decode_frame(bad)


async def test_frames_the_socket_takes_in_part_arrive_whole_and_never_interleaved() -> None:
    """FrameStream.send's fast path (``os.write`` while the lock is free) finishes what the
    socket did not take under the lock: two senders' large frames, a small send buffer and
    a reader that starts late still give every frame whole, each sender's in its order."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server_side, _ = listener.accept()
    listener.close()
    server_side.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sender = corewire.FrameStream(trio.SocketStream(trio.socket.from_stdlib_socket(server_side)))
    receiver = corewire.FrameStream(trio.SocketStream(trio.socket.from_stdlib_socket(client)))
    frames = {who: [(messages.StopStringHit(f"{who}{i}", "x" * (300_000 if i % 2 else 10)),)
                    for i in range(4)] for who in "ab"}
    got: list[tuple[object, ...]] = []

    async def send_all(who: str) -> None:
        for frame in frames[who]:
            await sender.send(frame)

    async def read_late() -> None:
        await trio.sleep(0.2)  # the first large frame has filled both buffers by now
        for _ in range(8):
            got.append(await receiver.receive())

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_late)
            nursery.start_soon(send_all, "a")
            nursery.start_soon(send_all, "b")
    for who in "ab":
        assert [f for f in got if f[0].sample_id.startswith(who)] == frames[who]
    assert sender.frames_sent == 8
    await sender.aclose()
    await receiver.aclose()


async def test_a_step_of_large_per_token_outputs_crosses_the_wire_in_frames() -> None:
    """Three per-token outputs of 30 MB in one step are more than a frame holds (64 MiB):
    as one StepOutputs the frame writer refuses them; split a request each
    (``core.frame_sized``) they go in two frames and arrive whole, in order, each with
    its own scheduled time."""
    from engine.process.core import frame_sized

    rows = [bytes([i]) * (30 * 2**20) for i in range(3)]
    step = messages.StepOutputs(7, tuple(
        messages.TokenDelta(f"s{i}", (), (), "stop", None, pooled=rows[i]) for i in range(3)),
        scheduled=tuple((f"s{i}", float(i)) for i in range(3)))
    small = messages.StepOutputs(8, step.deltas[:1])
    assert frame_sized([small]) == [small]
    left, right = _socket_streams()
    sender, receiver = corewire.FrameStream(left), corewire.FrameStream(right)
    with pytest.raises(corewire.WireError):
        await sender.send((step,))
    got: list[object] = []

    async def read() -> None:
        while len(got) < 4:
            got.extend(await receiver.receive())

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await sender.send((*frame_sized([step]), messages.StopStringHit("x", "y")))
    assert sender.frames_sent == 2  # the batch halved: 60 MB, then 30 MB and the hit
    parts = got[:3]
    assert [m.deltas[0].pooled for m in parts] == rows
    assert [m.scheduled for m in parts] == [((f"s{i}", float(i)),) for i in range(3)]
    assert all(m.step_id == 7 for m in parts) and got[3] == messages.StopStringHit("x", "y")
    await sender.aclose()
    await receiver.aclose()


def _socket_streams() -> tuple[trio.SocketStream, trio.SocketStream]:
    import socket

    a, b = socket.socketpair()
    return (trio.SocketStream(trio.socket.from_stdlib_socket(a)),
            trio.SocketStream(trio.socket.from_stdlib_socket(b)))


def test_hello_mismatch_names_what_differs() -> None:
    hello = messages.CoreHello(
        version="1", core_index=0, pid=1, model="m", served_model_name="m",
        tokenizer_folder="/t", max_model_len=512, vocab_size=100, block_size=16,
        eos_token_ids=(2,), num_blocks=10, dtype="float32", quantization="none", config_json="{}")
    assert corewire.hello_mismatch(hello, hello) is None
    import dataclasses

    other = dataclasses.replace(hello, max_model_len=256, version="2", num_blocks=20)
    differs = corewire.hello_mismatch(hello, other)
    assert "max_model_len: 512 here, 256 from the core" in differs
    assert "version" in differs and "num_blocks" not in differs


def test_stats_round_trip_through_json_config() -> None:
    from engine.config import EngineConfig

    config = EngineConfig(kv_cache_memory=0.5, data_parallel_size=2, max_model_len=64)
    assert EngineConfig.from_json(config.to_json()) == config
    assert json.loads(config.to_json())["kv_cache_memory"] == 0.5


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_headless_core_on_another_machine_joins_over_tcp_with_the_shared_secret(
    model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``serve --headless`` (a core for another machine) connects over TCP; a peer with
    the wrong secret is dropped; outputs equal the in-process engine's."""
    prompts = random_prompts(6, vocab=300, lo=2, hi=40, seed=11)
    async with engine.open_engine(str(model), **OPTIONS) as eng:
        expected = await _greedy_all(eng, prompts, 12)
    port = _free_port()
    address = f"127.0.0.1:{port}"
    secret = "a shared secret"
    cmd = [sys.executable, "-m", "engine", "serve", "--headless", "--model", str(model),
           "--data-parallel-size", "2", "--data-parallel-size-local", "1",
           "--data-parallel-start-rank", "1", "--data-parallel-address", address]
    for key, value in OPTIONS.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "ENGINE_DP_SECRET": secret}
    exited = trio.Event()

    async def run_headless(*, task_status: Any) -> None:
        await trio.run_process(cmd, env=env, check=False, task_status=task_status)
        exited.set()

    async with trio.open_nursery() as nursery:
        headless = await nursery.start(run_headless)
        with trio.fail_after(120):
            async with engine.open_engine(
                    str(model), **OPTIONS, data_parallel_size=2, data_parallel_size_local=1,
                    data_parallel_address=address, core_secret=secret.encode()) as eng:
                # A stranger without the secret is dropped, and serving goes on.
                stranger = corewire.FrameStream(await trio.open_tcp_stream("127.0.0.1", port))
                nonce = await stranger.receive_exactly(corewire.NONCE_BYTES)
                await stranger.send_raw(corewire.auth_digest(b"guess", nonce))
                with pytest.raises((EOFError, trio.BrokenResourceError)):
                    await stranger.receive_exactly(1)
                await stranger.aclose()
                got = await _greedy_all(eng, prompts, 12)
                loads = [load for _, state, load in eng._pool.statistics().cores]
                assert [state for _, state, _ in eng._pool.statistics().cores] == ["serving"] * 2
                assert eng._pool._cores[1].stats is not None  # the remote core ran steps
            # The front end closed the link: the headless server's core exits, then it does.
            with trio.fail_after(30):
                await exited.wait()
    assert got == expected
    assert loads == [0, 0]
    assert headless.returncode == 0
    assert "does not know the shared secret" in caplog.text


async def test_structured_output_through_a_core_process_matches_in_process(model: Path) -> None:
    from engine.structured.spec import StructuredOutputs

    params = SamplingParams(max_tokens=40, temperature=0, structured_outputs=StructuredOutputs(
        regex=r"(yes|no) [0-9]{2,4}"))
    got = {}
    for mode in ("inprocess", "process"):
        async with engine.open_engine(str(model), **OPTIONS, engine_core=mode) as eng:
            got[mode] = "".join(o.text for o in await collect(eng, [1, 2, 3], params))
    import re

    assert re.fullmatch(r"(yes|no) [0-9]{2,4}", got["process"])
    assert got["process"] == got["inprocess"]


def test_over_http_a_killed_core_ends_its_stream_with_an_error_and_health_tells(
    model: Path,
) -> None:
    """Through the server: a core killed mid-stream ends the stream with an error event
    (no hang), /health answers 503 until the core is back and 200 after, and the next
    request is served."""
    import httpx
    from http_server import ServerThread

    import engine.api

    with ServerThread(lambda: engine.api.open_engine(
            str(model), **OPTIONS, engine_core="process", max_engine_restarts=2)) as server, \
            httpx.Client(base_url=server.base_url, timeout=60) as http:
        body = {"model": server.engine.model_name, "prompt": [3, 4, 5], "max_tokens": 400,
                "temperature": 0, "ignore_eos": True, "stream": True}
        events: list[str] = []
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line)
                if len(events) == 3:
                    os.kill(server.engine._pool._cores[0].hello.pid, signal.SIGKILL)
        assert events[-1] == "data: [DONE]"
        errors = [json.loads(e[6:]) for e in events[:-1] if '"error"' in e]
        assert errors and errors[-1]["error"]["code"] == "engine_dead"
        statuses = set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = http.get("/health").status_code
            statuses.add(status)
            if status == 200 and server.engine._pool.serving == 1:
                break
            time.sleep(0.05)
        assert 503 in statuses and status == 200
        done = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 5})
        assert done.status_code == 200
        assert done.json()["usage"]["completion_tokens"] == 5
        assert server.engine.restarts == 1


def test_metrics_carry_an_engine_label_per_data_parallel_core(model: Path) -> None:
    import re

    import httpx
    from http_server import ServerThread

    import engine.api

    with ServerThread(lambda: engine.api.open_engine(
            str(model), **OPTIONS, data_parallel_size=2)) as server:
        for i in range(4):
            body = {"model": server.engine.model_name, "prompt": [7, 8, 9 + i],
                    "max_tokens": 4, "temperature": 0}
            assert httpx.post(server.base_url + "/v1/completions", json=body,
                              timeout=60).status_code == 200
        text = httpx.get(server.base_url + "/metrics").text
        queries = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^engine:prefix_cache_queries_total\{engine="(\d)",[^}]*\} (\S+)$', text, re.M)}
        per_core = [s.prefix_cache_queries for _, s in server.engine.core_statistics()]
    assert set(queries) == {"0", "1"}
    assert [queries["0"], queries["1"]] == per_core
    assert sum(per_core) == 4 * 3  # every prompt token looked up once, on one core or the other
