"""What the engine-core wire costs: a step's frame packed, sent over a Unix socket,
received and decoded, per step and per token.

    python bench/ipc.py --batches 1,8,32,64 --steps 2000

For each batch size B it builds the frame a core sends after a decode step of B requests
(a StepOutputs with B one-token deltas, plus the CoreStatistics snapshot), and times, in
one process with both ends of a socketpair driven by trio: ``messages.pack`` + the send,
the receive + ``corewire.decode_frame``. It prints microseconds per frame and per token,
and the frame's size; beside it, the same for the request direction (an AdmittedRequest
of a 64-token prompt). The model's step (milliseconds) is what these are compared to.
Where pyzmq is installed (it is no dependency of the engine), the same frames also go over
a zmq PAIR socket on ipc://, the transport vLLM uses, for the choice between the two.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import messages  # noqa: E402
from engine.params import SamplingParams  # noqa: E402
from engine.process import wire as corewire  # noqa: E402


def step_frame(batch: int) -> tuple[object, ...]:
    deltas = tuple(messages.TokenDelta(f"req-{i}#{i}", (1234 + i,), (), None, None)
                   for i in range(batch))
    stats = messages.CoreStatistics(
        running=batch, waiting=0, kv_blocks_total=4096, kv_blocks_free=4000,
        prefix_cache_hits=0, prefix_cache_queries=0, preemptions=0, steps=1,
        requests_finished=0, iteration_token_counts=(0,) * 16, iteration_tokens_sum=batch,
        scheduled_tokens=batch, planned_ahead=0, samples_received=batch)
    return (messages.StepOutputs(1, deltas), stats)


def request_frame() -> tuple[object, ...]:
    from engine.core import admission

    params = SamplingParams(max_tokens=128, temperature=0.7)
    submit = admission.submit_request(list(range(100, 164)), params, request_id="r",
                                      priority=0, cache_salt=None, arrival_time=0.0)
    limits = admission.AdmissionLimits(max_model_len=4096, vocab_size=50000,
                                       max_queued_requests=1024, eos_token_ids=(2,))
    kwargs = {"serial": 1} if "serial" in admission.admit.__code__.co_varnames else {}
    return (admission.admit(submit, tuple(range(100, 164)), limits, waiting=0, **kwargs),)


async def time_zmq(frame: tuple[object, ...], count: int) -> tuple[float, float, int] | None:
    """The same frames over a pyzmq PAIR socket on ipc://, driven from trio by waiting on
    zmq's file descriptor (as an engine using pyzmq under trio would)."""
    try:
        import zmq
    except ImportError:
        return None
    import tempfile

    ctx = zmq.Context()
    path = f"ipc://{tempfile.mkdtemp()}/bench.sock"
    left, right = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    right.bind(path)
    left.connect(path)

    async def receive() -> bytes:
        while True:
            try:
                return right.recv(zmq.NOBLOCK)
            except zmq.Again:
                await trio.lowlevel.wait_readable(right.getsockopt(zmq.FD))

    send_s = receive_s = 0.0
    payload = b""
    for _ in range(count):
        t0 = time.perf_counter()
        payload = messages.pack(frame)
        left.send(payload)
        t1 = time.perf_counter()
        got = corewire.decode_frame(await receive())
        t2 = time.perf_counter()
        send_s += t1 - t0
        receive_s += t2 - t1
    assert got == frame
    left.close(0)
    right.close(0)
    ctx.term()
    return send_s / count, receive_s / count, len(payload)


async def time_frames(frame: tuple[object, ...], count: int) -> tuple[float, float, int]:
    a, b = trio.socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    left = corewire.FrameStream(trio.SocketStream(a))
    right = corewire.FrameStream(trio.SocketStream(b))
    send_s = receive_s = 0.0
    size = len(messages.pack(frame)) + corewire.HEADER.size
    async with left.stream, right.stream:
        for _ in range(count):
            t0 = time.perf_counter()
            await left.send(frame)
            t1 = time.perf_counter()
            got = await right.receive()
            t2 = time.perf_counter()
            send_s += t1 - t0
            receive_s += t2 - t1
        assert got == frame
    return send_s / count, receive_s / count, size


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--steps", type=int, default=2000)
    args = p.parse_args()
    print("| frame | transport | bytes | pack+send us | receive+decode us | total us | us per token |")
    print("|---|---|---|---|---|---|---|")
    frames = [(f"step outputs, {b} requests", step_frame(b), b)
              for b in (int(x) for x in args.batches.split(","))]
    frames.append(("one request, 64-token prompt", request_frame(), 0))
    for label, frame, batch in frames:
        for transport, timer in (("trio unix socket", time_frames), ("pyzmq PAIR ipc", time_zmq)):
            timed = trio.run(timer, frame, args.steps)
            if timed is None:
                print(f"| {label} | {transport} | pyzmq not installed | | | | |")
                continue
            send, receive, size = timed
            total = (send + receive) * 1e6
            per_token = f"{total / batch:.2f}" if batch else ""
            print(f"| {label} | {transport} | {size} | {send * 1e6:.1f} | {receive * 1e6:.1f} | "
                  f"{total:.1f} | {per_token} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
