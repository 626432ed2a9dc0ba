"""Soak test: minutes of mixed load on a real `python -m engine serve`, RSS over time.

    python bench/soak.py --minutes 10 --concurrency 8            # the default SmolLM2
    python bench/soak.py --minutes 1 --model /path/to/model --dtype float32
    python bench/soak.py --minutes 10 --kv-cache-memory 128MiB   # the pool all resident early
    python bench/soak.py --minutes 10 --hostile 0.1              # a tenth of it hostile

Starts the server as a subprocess, then ``--concurrency`` clients loop until the time is
up, each request drawn at random: streamed or not, prompt 1..``--max-prompt`` words,
``max_tokens`` 1..``--max-output``, some sampled (temperature, top_p, seed), some cut off by
their client (before the response, after the first chunk, mid-stream), some invalid (bad
types and ranges, which must be 4xx). Every ``--interval`` seconds it prints the server's
RSS (from /proc) beside the RSS after warm-up (the baseline), requests served, the
expected 4xx, disconnects, and errors (a 5xx, a broken stream, a connection failure:
anything that must not happen). At the end the server must be idle: no request running or
waiting and ``engine:kv_cache_usage_perc`` 0. Exit status 1 if anything was lost.

``--hostile F`` makes a share F of the requests hostile (issue 27's cases): chat templates
that compute huge numbers, allocate gigabytes or never end; 60,000 tools; a 3.7 MiB
token-id prompt; a 4 MB text prompt; garbage bodies, an unknown transfer coding, an
HTTP/2 preface and nothing else; and slow readers (an HTTP/1 stream whose client never
reads, an HTTP/2 connection with a zero window), each run beside the load. All but the
slow readers must get their 4xx (501 for the transfer coding); the slow readers must be
cut off by the server (--send-timeout). A probe task polls ``/health`` all the while:
each line shows the p99 of its latency over the interval, and the server's engine
restarts ("deaths"). With ``--hostile`` the run fails on any 5xx, death, a ``/health``
p99 of a second or more, or a slow reader left uncut.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
import trio

WORDS = ("the", "engine", "serves", "tokens", "while", "clients", "come", "and", "go", "a",
         "river", "of", "requests", "flows", "through", "blocks", "cache", "prefix", "seven",
         "blue", "quietly", "under", "load", "Paris", "is", "capital", "France", "why")
BAD_BODIES = (
    {"prompt": "x", "temperature": -1},
    {"prompt": "x", "top_k": 2**31},
    {"prompt": "x", "repetition_penalty": 1e-320},
    {"prompt": "x", "logit_bias": {"1": 1e43}},
    {"prompt": [10**9]},
    {"prompt": "x", "max_tokens": 10**9},
    {"prompt": "x", "stop": ["s"] * 100},
    {"messages": []},
    {"prompt": "x", "n": 0},
)


@dataclass
class Counts:
    served: int = 0
    rejected: int = 0  # the 4xx a bad request must get
    disconnects: int = 0
    errors: int = 0
    tokens: int = 0
    last_error: str = ""
    server_errors: int = 0  # 5xx answers, hostile or not
    hostile: int = 0  # hostile requests refused as they must be
    slow_readers: int = 0
    slow_uncut: int = 0  # slow readers the server did not cut off
    health: list[float] = field(default_factory=list)  # /health latencies this interval
    health_all: list[float] = field(default_factory=list)

    def error(self, text: str, status: int | None = None) -> None:
        self.errors += 1
        self.last_error = text
        if status is not None and status >= 500:
            self.server_errors += 1


# -- hostile requests (issue 27) ------------------------------------------------------------

CHAT = [{"role": "user", "content": "hi"}]
HOSTILE_TEMPLATES = (
    "{{ 7 ** 50000000 }}",
    "{{ 10 ** 100000 }}",
    "{{ 'x' * 10 ** 9 }}",
    "{% set ns = namespace(s='xy') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s }}",
    "{{ 'a' | center(1000000000) }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
)


def hostile_bodies() -> list[tuple[str, bytes, tuple[int, ...]]]:
    """(path, body, the statuses it must get): built once, some are megabytes."""
    def chat(**fields: object) -> bytes:
        return json.dumps({"messages": CHAT, "max_tokens": 4, **fields}).encode()

    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(60_000)]
    bodies = [("/v1/chat/completions", chat(chat_template=t), (400,)) for t in HOSTILE_TEMPLATES]
    bodies += [
        ("/v1/chat/completions", chat(tools=tools), (400,)),
        ("/v1/chat/completions", chat(tools=tools[:1000]), (400,)),
        ("/v1/completions",
         b'{"max_tokens": 2, "prompt": [' + b",".join([b"7"] * 1_900_000) + b"]}", (400,)),
        ("/v1/completions", json.dumps({"prompt": "hello world, " * 300_000,
                                        "max_tokens": 2}).encode(), (400,)),
        ("/v1/completions", b"\xff\xfe{not json", (400,)),
        ("/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", (400,)),
        ("/v1/chat/completions", b'{"messages": "\\ud800"}', (400,)),
        ("/v1/completions", os.urandom(2048), (400,)),
    ]
    return bodies


async def hostile_request(http: httpx.AsyncClient, rng: random.Random,
                          bodies: list[tuple[str, bytes, tuple[int, ...]]],
                          counts: Counts) -> None:
    path, body, statuses = rng.choice(bodies)
    response = await http.post(path, content=body, headers={"content-type": "application/json"})
    if response.status_code in statuses:
        counts.hostile += 1
    else:
        counts.error(f"hostile {path} ({len(body)} bytes) got {response.status_code}: "
                     f"{response.text[:200]}", response.status_code)


async def raw_exchange(address: tuple[str, int], data: bytes, seconds: float) -> bytes:
    """Send ``data`` on a fresh connection, read what comes back for ``seconds`` or until
    the server closes."""
    stream = await trio.open_tcp_stream(*address)
    received = b""
    async with stream:
        await stream.send_all(data)
        with trio.move_on_after(seconds):
            while chunk := await stream.receive_some(65536):
                received += chunk
    return received


async def garbage_connection(address: tuple[str, int], rng: random.Random, args: argparse.Namespace,
                             counts: Counts) -> None:
    """An unknown transfer coding (501), or an HTTP/2 preface and nothing else (closed
    after the keep-alive timeout)."""
    if rng.random() < 0.5:
        answer = await raw_exchange(address, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                                    b"transfer-encoding: xchunked\r\n\r\n5\r\nhello\r\n0"
                                    b"\r\n\r\n", 30.0)
        if answer.startswith(b"HTTP/1.1 501"):
            counts.hostile += 1
        else:
            counts.error(f"xchunked got {answer[:60]!r}", int(answer[9:12] or 0))
        return
    start = time.monotonic()
    await raw_exchange(address, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00"
                       b"\x00\x00\x00\x00", 30.0)
    if time.monotonic() - start < 29.0:  # closed by the server, not by our timeout
        counts.hostile += 1
    else:
        counts.error("an idle HTTP/2 connection was not closed within 30 s")


def unread_body(args: argparse.Namespace) -> bytes:
    """A stream whose first chunk (the echoed prompt with logprobs) fills the buffers
    between the server and a client that does not read, and whose generation is long.
    Token ids below 210 are in any vocabulary."""
    prompt = list(range(10, 10 + min(200, args.max_model_len // 4)))
    return json.dumps({"prompt": prompt, "max_tokens": args.max_model_len // 2,
                       "ignore_eos": True, "stream": True, "echo": True,
                       "logprobs": 5}).encode()


async def slow_reader(address: tuple[str, int], rng: random.Random, args: argparse.Namespace,
                      counts: Counts) -> None:
    """An HTTP/1 stream whose client never reads; the server must close the connection
    within --send-timeout of its buffers filling."""
    body = unread_body(args)
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect(address)
    stream = trio.SocketStream(sock)
    counts.slow_readers += 1
    async with stream:
        await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                              b"application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
                              + body)
        await trio.sleep(args.send_timeout + 10)  # not reading
        # Then read what was buffered: the server's close ends it.
        with trio.move_on_after(30):
            while await stream.receive_some(65536):
                pass
            return
    counts.slow_uncut += 1
    counts.last_error = "a slow reader was not cut off"


async def h2_slow_reader(address: tuple[str, int], rng: random.Random,
                         args: argparse.Namespace, counts: Counts) -> None:
    """An HTTP/2 connection with a zero flow-control window and two streams: the server
    must reset them after --send-timeout."""
    import h2.config
    import h2.connection
    import h2.events
    import h2.settings

    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    streams = []
    for _ in range(2):
        body = unread_body(args)
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [(":method", "POST"), (":path", "/v1/completions"),
                                (":scheme", "http"), (":authority", "x"),
                                ("content-type", "application/json"),
                                ("content-length", str(len(body)))])
        conn.send_data(sid, body, end_stream=True)
        streams.append(sid)
    counts.slow_readers += 1
    reset: set[int] = set()
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(conn.data_to_send())
        with trio.move_on_after(args.send_timeout + 60):
            while len(reset) < len(streams):
                data = await stream.receive_some(65536)
                if not data:
                    break
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.StreamReset):
                        reset.add(event.stream_id)
                await stream.send_all(conn.data_to_send())
    if len(reset) < len(streams):
        counts.slow_uncut += 1
        counts.last_error = "an HTTP/2 stream with a shut window was not reset"


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        match = re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(match.group(1)) / 1024 if match else float("nan")


async def one_request(http: httpx.AsyncClient, rng: random.Random, args: argparse.Namespace,
                      counts: Counts, hostile: Hostile | None = None) -> None:
    if hostile is not None and rng.random() < args.hostile:
        await hostile.one(http, rng, args, counts)
        return
    kind = rng.random()
    if kind < 0.1:
        body = dict(rng.choice(BAD_BODIES))
        response = await http.post(rng.choice(["/v1/completions", "/v1/chat/completions"]),
                                   json=body)
        if 400 <= response.status_code < 500:
            counts.rejected += 1
        else:
            counts.error(f"bad request got {response.status_code}: {response.text[:200]}",
                         response.status_code)
        return
    # Words, not token ids, so the same load fits any model's vocabulary.
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, args.max_prompt)))
    body: dict[str, object] = {"prompt": prompt, "max_tokens": rng.randint(1, args.max_output),
                               "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.5:
        body.update(temperature=rng.choice([0.3, 0.8, 1.0]), top_p=rng.choice([0.9, 1.0]),
                    seed=rng.randrange(2**32))
    else:
        body["temperature"] = 0
    stream = rng.random() < 0.6
    body["stream"] = stream
    cut = rng.random()
    if cut < 0.15:  # the client goes away: before the answer, or mid-stream
        with trio.move_on_after(rng.uniform(0.0, 0.5)):
            await _read(http, body, stream, counts)
            return
        counts.disconnects += 1
        return
    await _read(http, body, stream, counts)


async def _read(http: httpx.AsyncClient, body: dict[str, object], stream: bool,
                counts: Counts) -> None:
    if not stream:
        response = await http.post("/v1/completions", json=body)
        if response.status_code == 200:
            counts.served += 1
            counts.tokens += response.json()["usage"]["completion_tokens"]
        else:
            counts.error(f"{response.status_code}: {response.text[:200]}",
                         response.status_code)
        return
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            counts.error(f"{response.status_code}: {(await response.aread())[:200]!r}",
                         response.status_code)
            return
        done = False
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    counts.errors += 1
                    counts.last_error = f"error chunk: {chunk['error']}"
                    return
                counts.tokens += sum(1 for c in chunk["choices"] if c.get("text"))
        if done:
            counts.served += 1
        else:
            counts.errors += 1
            counts.last_error = "stream ended without [DONE]"


class Hostile:
    """The hostile share of the load: requests a client waits for, and connections (slow
    readers, garbage) that run beside the load in their own tasks."""

    def __init__(self, address: tuple[str, int], nursery: trio.Nursery) -> None:
        self.address = address
        self.nursery = nursery
        self.bodies = hostile_bodies()

    async def one(self, http: httpx.AsyncClient, rng: random.Random, args: argparse.Namespace,
                  counts: Counts) -> None:
        kind = rng.random()
        if kind < 0.15:
            reader = h2_slow_reader if args.enable_h2c and rng.random() < 0.5 else slow_reader
            self.nursery.start_soon(_guarded, reader, self.address, rng, args, counts)
        elif kind < 0.3:
            self.nursery.start_soon(_guarded, garbage_connection, self.address, rng, args, counts)
        else:
            await hostile_request(http, rng, self.bodies, counts)


async def _guarded(fn: object, address: tuple[str, int], rng: random.Random,
                   args: argparse.Namespace, counts: Counts) -> None:
    try:
        await fn(address, random.Random(rng.random()), args, counts)  # type: ignore[operator]
    except OSError as exc:
        counts.error(f"{getattr(fn, '__name__', fn)}: {exc!r}")


async def client_loop(http: httpx.AsyncClient, seed: int, deadline: float,
                      args: argparse.Namespace, counts: Counts,
                      hostile: Hostile | None = None) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        try:
            await one_request(http, rng, args, counts, hostile)
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            counts.error(repr(exc))


async def health_probe(url: str, deadline: float, counts: Counts) -> None:
    """/health every 0.1 s on a connection of its own; every latency is kept."""
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300.0)) as http:
        while time.monotonic() < deadline:
            start = time.monotonic()
            try:
                status = (await http.get("/health")).status_code
            except httpx.HTTPError as exc:
                counts.error(f"/health: {exc!r}")
                status = 0
            latency = time.monotonic() - start
            counts.health.append(latency)
            counts.health_all.append(latency)
            if status != 200:
                counts.error(f"/health answered {status}", status or None)
            await trio.sleep(0.1)


def p99(values: list[float]) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else float("nan")


async def soak(args: argparse.Namespace, url: str, proc: subprocess.Popen[str]) -> int:
    pid = proc.pid
    counts = Counts()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    address = (host, int(port))
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300.0),
                                 limits=httpx.Limits(max_connections=args.concurrency + 4)) as http:
        # Warm-up, then the baseline RSS.
        for _ in range(4):
            await http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8})
        baseline = rss_mib(pid)
        restarts0 = metric((await http.get("/metrics")).text, "engine:engine_restarts_total")
        start = time.monotonic()
        deadline = start + args.minutes * 60
        print(f"{'t (s)':>6} {'RSS MiB':>8} {'baseline':>8} {'served':>7} {'4xx':>5} "
              f"{'cut':>5} {'hostile':>7} {'slow':>5} {'errors':>6} {'5xx':>4} {'deaths':>6} "
              f"{'health p99':>10} {'tokens':>7}", flush=True)
        samples = []
        deaths = 0
        async with trio.open_nursery() as nursery:
            hostile = Hostile(address, nursery) if args.hostile > 0 else None
            nursery.start_soon(health_probe, url, deadline, counts)
            for i in range(args.concurrency):
                nursery.start_soon(client_loop, http, args.seed + i, deadline, args, counts,
                                   hostile)
            while time.monotonic() < deadline:
                await trio.sleep(min(args.interval, max(0.0, deadline - time.monotonic())))
                rss = rss_mib(pid)
                samples.append(rss)
                if proc.poll() is not None:
                    deaths += 1
                    counts.error(f"the server exited with {proc.returncode}")
                    nursery.cancel_scope.cancel()
                    break
                restarts = metric((await http.get("/metrics")).text,
                                  "engine:engine_restarts_total")
                deaths = int(restarts - restarts0) if restarts == restarts else deaths
                health, counts.health = counts.health, []
                print(f"{time.monotonic() - start:6.0f} {rss:8.1f} {baseline:8.1f} "
                      f"{counts.served:7d} {counts.rejected:5d} {counts.disconnects:5d} "
                      f"{counts.hostile:7d} {counts.slow_readers:5d} {counts.errors:6d} "
                      f"{counts.server_errors:4d} {deaths:6d} {p99(health):10.3f} "
                      f"{counts.tokens:7d}", flush=True)
        # Idle afterwards: nothing running, waiting or holding KV blocks.
        idle = False
        with trio.move_on_after(60):
            while not idle:
                text = (await http.get("/metrics")).text
                idle = (metric(text, "engine:num_requests_running") == 0
                        and metric(text, "engine:num_requests_waiting") == 0
                        and metric(text, "engine:kv_cache_usage_perc") == 0)
                if not idle:
                    await trio.sleep(0.2)
        health = (await http.get("/health")).status_code
    half = samples[len(samples) // 2:] or samples
    print(f"\nbaseline RSS {baseline:.1f} MiB; RSS min/max {min(samples):.1f}/{max(samples):.1f} "
          f"MiB; second-half drift {max(half) - min(half):+.1f} MiB; end {samples[-1]:.1f} MiB")
    print(f"served {counts.served}, expected 4xx {counts.rejected}, client disconnects "
          f"{counts.disconnects}, errors {counts.errors}, streamed/generated tokens "
          f"{counts.tokens}; idle afterwards: {idle}; /health {health}")
    health_p99 = p99(counts.health_all)
    print(f"hostile refused {counts.hostile}, slow readers {counts.slow_readers} "
          f"({counts.slow_uncut} not cut off), 5xx {counts.server_errors}, deaths {deaths}, "
          f"/health p99 {health_p99:.3f} s, max {max(counts.health_all, default=math.nan):.3f} s "
          f"over {len(counts.health_all)} probes")
    if counts.errors or counts.slow_uncut:
        print(f"last error: {counts.last_error}")
    ok = counts.errors == 0 and idle and health == 200
    if args.hostile > 0:
        ok = ok and counts.slow_uncut == 0 and deaths == 0 and health_p99 < 1.0
    return 0 if ok else 1


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "engine", "serve", "--port", "0", "--log-level", "warning",
           "--max-num-seqs", str(args.concurrency)]
    if args.model:
        cmd += ["--model", args.model]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    if args.kv_cache_memory:
        cmd += ["--kv-cache-memory", args.kv_cache_memory]
    if args.hostile > 0:
        # Request templates are what the hostile ones are; a short send timeout so slow
        # readers are cut within the run.
        cmd += ["--trust-request-chat-template", "--send-timeout", str(args.send_timeout)]
        if args.enable_h2c:
            cmd.append("--enable-h2c")
    # info level for the one "listening on" line; the rest of the log goes to a file.
    cmd[cmd.index("warning")] = "info"
    log = open(args.server_log, "w")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=log, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.stderr is not None
    for line in proc.stderr:
        log.write(line)
        match = re.search(r"listening on (http://\S+)", line)
        if match:
            break
    else:
        raise SystemExit(f"server did not start; see {args.server_log}")
    # Keep draining its stderr into the log so the pipe never fills.
    import threading

    def drain() -> None:
        for line in proc.stderr:  # type: ignore[union-attr]
            log.write(line)

    threading.Thread(target=drain, daemon=True).start()
    return proc, match.group(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--interval", type=float, default=30.0, help="seconds between RSS lines")
    parser.add_argument("--max-prompt", type=int, default=200)
    parser.add_argument("--max-output", type=int, default=48)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-memory", default=None,
                        help="the server's KV pool (e.g. 128MiB). Pages of the pool become "
                             "resident as blocks are first used, so with the default 2 GiB "
                             "pool RSS climbs for as long as new blocks are reached; a pool "
                             "small enough to be all in use early leaves what RSS does to "
                             "everything else")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hostile", type=float, default=0.0, metavar="F",
                        help="share of requests that are hostile (issue 27's cases); 0: none")
    parser.add_argument("--send-timeout", type=float, default=5.0,
                        help="the server's --send-timeout with --hostile")
    parser.add_argument("--enable-h2c", action=argparse.BooleanOptionalAction, default=True,
                        help="with --hostile: serve cleartext HTTP/2 and send HTTP/2 slow "
                             "readers too")
    parser.add_argument("--server-log", default="/tmp/engine-soak-server.log")
    args = parser.parse_args()
    proc, url = start_server(args)
    try:
        print(f"server pid {proc.pid} at {url}; {args.minutes} min, {args.concurrency} "
              "clients", flush=True)
        return trio.run(soak, args, url, proc)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
