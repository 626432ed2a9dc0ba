"""Soak test: minutes of mixed load on a real `python -m engine serve`, RSS over time.

    python bench/soak.py --minutes 10 --concurrency 8            # the default SmolLM2
    python bench/soak.py --minutes 1 --model /path/to/model --dtype float32
    python bench/soak.py --minutes 10 --kv-cache-memory 128MiB   # the pool all resident early

Starts the server as a subprocess, then ``--concurrency`` clients loop until the time is
up, each request drawn at random: streamed or not, prompt 1..``--max-prompt`` words,
``max_tokens`` 1..``--max-output``, some sampled (temperature, top_p, seed), some cut off by
their client (before the response, after the first chunk, mid-stream), some invalid (bad
types and ranges, which must be 4xx). Every ``--interval`` seconds it prints the server's
RSS (from /proc) beside the RSS after warm-up (the baseline), requests served, the
expected 4xx, disconnects, and errors (a 5xx, a broken stream, a connection failure:
anything that must not happen). At the end the server must be idle: no request running or
waiting and ``engine:kv_cache_usage_perc`` 0. Exit status 1 if anything was lost.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass

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


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        match = re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(match.group(1)) / 1024 if match else float("nan")


async def one_request(http: httpx.AsyncClient, rng: random.Random, args: argparse.Namespace,
                      counts: Counts) -> None:
    kind = rng.random()
    if kind < 0.1:
        body = dict(rng.choice(BAD_BODIES))
        response = await http.post(rng.choice(["/v1/completions", "/v1/chat/completions"]),
                                   json=body)
        if 400 <= response.status_code < 500:
            counts.rejected += 1
        else:
            counts.errors += 1
            counts.last_error = f"bad request got {response.status_code}: {response.text[:200]}"
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
            counts.errors += 1
            counts.last_error = f"{response.status_code}: {response.text[:200]}"
        return
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            counts.errors += 1
            counts.last_error = f"{response.status_code}: {(await response.aread())[:200]!r}"
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


async def client_loop(http: httpx.AsyncClient, seed: int, deadline: float,
                      args: argparse.Namespace, counts: Counts) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        try:
            await one_request(http, rng, args, counts)
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            counts.errors += 1
            counts.last_error = repr(exc)


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else float("nan")


async def soak(args: argparse.Namespace, url: str, pid: int) -> int:
    counts = Counts()
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300.0),
                                 limits=httpx.Limits(max_connections=args.concurrency + 4)) as http:
        # Warm-up, then the baseline RSS.
        for _ in range(4):
            await http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8})
        baseline = rss_mib(pid)
        start = time.monotonic()
        deadline = start + args.minutes * 60
        print(f"{'t (s)':>6} {'RSS MiB':>8} {'baseline':>8} {'served':>7} {'4xx':>5} "
              f"{'cut':>5} {'errors':>6} {'tokens':>7}", flush=True)
        samples = []
        async with trio.open_nursery() as nursery:
            for i in range(args.concurrency):
                nursery.start_soon(client_loop, http, args.seed + i, deadline, args, counts)
            while time.monotonic() < deadline:
                await trio.sleep(min(args.interval, max(0.0, deadline - time.monotonic())))
                rss = rss_mib(pid)
                samples.append(rss)
                print(f"{time.monotonic() - start:6.0f} {rss:8.1f} {baseline:8.1f} "
                      f"{counts.served:7d} {counts.rejected:5d} {counts.disconnects:5d} "
                      f"{counts.errors:6d} {counts.tokens:7d}", flush=True)
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
    if counts.errors:
        print(f"last error: {counts.last_error}")
    return 0 if counts.errors == 0 and idle and health == 200 else 1


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
    parser.add_argument("--server-log", default="/tmp/engine-soak-server.log")
    args = parser.parse_args()
    proc, url = start_server(args)
    try:
        print(f"server pid {proc.pid} at {url}; {args.minutes} min, {args.concurrency} "
              "clients", flush=True)
        return trio.run(soak, args, url, proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
