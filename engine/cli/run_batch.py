"""``python -m engine run-batch -i IN -o OUT``: an OpenAI Batch file through the engine, with
no server.

Each input line is one request of the OpenAI Batch API: ``{"custom_id", "method": "POST",
"url", "body"}``, ``url`` one of :data:`BATCH_URLS` (a speech line names its clip by
``file_url``: :mod:`engine.cli.batch_speech`). Each output line answers one input line
in the Batch API's output shape::

    {"id": "batch_req_…", "custom_id": "…",
     "response": {"status_code": 200, "request_id": "req_…", "body": {…the server's answer…}},
     "error": null}

One source of truth for requests: the body of each line goes through the HTTP app itself
(:func:`engine.http.app.create_app` over the open engine), called in-process as an ASGI
application (:func:`call_app`), so a line gets exactly the server's validation, errors and
response body. Only the envelope is read here (:func:`parse_line`). A line the server
refuses is answered with its status, the server's error body and ``error`` set (``code``,
``message``, ``line``); a line whose envelope is wrong (not JSON, no ``custom_id``, an
unknown ``url``) has ``response: null`` and its ``error``. Either way the batch goes on.

Lines run concurrently (``--max-concurrency``), so the scheduler batches them; answers are
written in the order they finish, each as one write, flushed. A run killed at any point
leaves whole lines (at most a torn last one, which ``--resume`` cuts off), and ``--resume``
answers only the lines whose ``custom_id`` OUT does not hold yet. A full queue (429) or an
engine restarting after a crash (503) is waited out and the line sent again; an engine dead
for good stops the batch with exit status 3, the lines not yet answered left for
``--resume``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO

import trio
from tqdm import tqdm

from engine.api import open_engine
from engine.cli.args import add_engine_arguments, config_from_args
from engine.cli.batch_speech import SPEECH_URLS, speech_form
from engine.cli.help import HelpFormatter
from engine.cli.serve import (
    DEFAULT_MAX_ENGINE_RESTARTS,
    EXIT_ENGINE_DEAD,
    SERVE_GRAMMAR_COMPILE_WORKERS,
    add_chat_arguments,
    chat_settings,
)
from engine.errors import EngineError, InvalidParamError
from engine.http.app import RETRY_AFTER_SECONDS, create_app

logger = logging.getLogger("engine.cli.run_batch")

# The routes a batch line may name: OpenAI's batch endpoints that this server has, and
# vLLM's run-batch's pooling ones.
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score",
              "/v1/rerank", *SPEECH_URLS)
EXIT_BAD_INPUT = 2  # as argparse's usage errors
EXIT_INTERRUPTED = 130  # a shell's status for a command ended by SIGINT (128 + 2)
# Statuses that mean "not now", not "no": the line is sent again after Retry-After.
_RETRY_STATUSES = (429, 503)


class BatchFileError(ValueError):
    """The input or output file cannot be run at all (unreadable, duplicate custom_ids, an
    OUT to resume that is not a batch output)."""


@dataclass(frozen=True, slots=True)
class BatchLine:
    """One input line: its 1-based number, and either a request or the envelope's error."""

    number: int
    custom_id: str | None
    url: str = ""
    body: Any = None
    error: dict[str, Any] | None = None


def _envelope_error(number: int, custom_id: str | None, code: str, message: str,
                    param: str | None = None) -> BatchLine:
    return BatchLine(number, custom_id, error={"code": code, "message": message,
                                               "param": param, "line": number})


def parse_line(number: int, text: str) -> BatchLine:
    """Read one line's envelope; the body is the app's to check (sent on as JSON again, so
    a NaN or a lone surrogate in it meets the server's own refusal)."""
    try:
        item = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past the parser
        return _envelope_error(number, None, "invalid_json_line", f"line {number} is not JSON: {exc}")
    if not isinstance(item, dict):
        return _envelope_error(number, None, "invalid_json_line",
                               f"line {number} is not a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return _envelope_error(number, None, "missing_required_parameter",
                               "custom_id must be a non-empty string", "custom_id")
    method = item.get("method", "POST")
    if method != "POST":
        return _envelope_error(number, custom_id, "invalid_method",
                               f"method must be POST, not {method!r}", "method")
    url = item.get("url")
    if url not in BATCH_URLS:
        return _envelope_error(number, custom_id, "invalid_url",
                               f"url must be one of {', '.join(BATCH_URLS)}, not {url!r}", "url")
    body = item.get("body")
    if not isinstance(body, dict):
        return _envelope_error(number, custom_id, "missing_required_parameter",
                               "body must be a JSON object", "body")
    if body.get("stream"):
        # An answer in a batch file is one JSON body; server-sent events have no place there.
        return _envelope_error(number, custom_id, "invalid_value",
                               "stream is not supported in a batch", "body.stream")
    return BatchLine(number, custom_id, url, body)


def read_batch(lines: Iterable[str]) -> list[BatchLine]:
    """Every non-blank line of the input; :class:`BatchFileError` when two lines share a
    ``custom_id`` (their answers could not be told apart; OpenAI refuses such a file too)."""
    out: list[BatchLine] = []
    seen: dict[str, int] = {}
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        line = parse_line(number, text)
        if line.custom_id is not None:
            first = seen.setdefault(line.custom_id, number)
            if first != number:
                raise BatchFileError(f"custom_id {line.custom_id!r} is on lines {first} and "
                                     f"{number}: each line needs its own")
        out.append(line)
    return out


def resume_state(path: str) -> tuple[set[str], set[int]]:
    """The ``custom_id``s OUT answers (and the numbers of the lines without one it answers),
    after cutting a torn last line off (a run killed mid-write)."""
    try:
        with open(path, "rb+") as f:
            data = f.read()
            whole = data.rfind(b"\n") + 1
            if whole < len(data):
                logger.warning("%s: cutting off a torn last line (%d bytes)", path,
                               len(data) - whole)
                f.truncate(whole)
    except FileNotFoundError:
        return set(), set()
    except OSError as exc:
        raise BatchFileError(f"--resume: {exc}") from None
    ids: set[str] = set()
    numbers: set[int] = set()
    for index, raw in enumerate(data[:whole].splitlines(), start=1):
        try:
            item = json.loads(raw)
            custom_id = item["custom_id"]
            error = item.get("error") or {}
        except (ValueError, KeyError, TypeError, AttributeError):
            raise BatchFileError(f"--resume: line {index} of {path} is not a batch output line; "
                                 "not resuming into it") from None
        if custom_id is not None:
            ids.add(custom_id)
        elif isinstance(error.get("line"), int):
            numbers.add(error["line"])
    return ids, numbers


# -- answering a line -----------------------------------------------------------------------


async def call_app(app: Any, path: str, body: bytes, headers: dict[str, str],
                   content_type: str = "application/json") -> tuple[int, bytes]:
    """POST ``body`` to ``path`` of the ASGI ``app`` in this process; (status, body).

    The request arrives whole, as from a client that sent it and then waits: the app's
    receive task then waits too, until the app's own nursery ends it with the response.
    """
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
        "extensions": {},
        "headers": [(b"content-type", content_type.encode()),
                    (b"content-length", str(len(body)).encode()),
                    *((k.lower().encode(), v.encode()) for k, v in headers.items())],
    }
    delivered = False
    status = 0
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await trio.sleep_forever()
        raise AssertionError("unreachable")  # pragma: no cover

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks)


def answer(line: BatchLine, status: int | None, request_id: str | None, body: Any) -> dict[str, Any]:
    """The output line of ``line``: the app's answer (``status`` None: the envelope's error)."""
    error = line.error
    if status is not None and status >= 400:
        detail = body.get("error") if isinstance(body, dict) else None
        detail = detail if isinstance(detail, dict) else {}
        error = {"code": detail.get("code") or str(status),
                 "message": detail.get("message") or f"HTTP {status}",
                 "param": detail.get("param"), "line": line.number}
    response = None if status is None else {"status_code": status, "request_id": request_id,
                                            "body": body}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": response, "error": error}


class EngineGone(Exception):
    """The engine died for good mid-batch."""


async def run_line(app: Any, eng: Any, line: BatchLine) -> dict[str, Any]:
    """Answer one line through the app; a 429 or a restart's 503 is waited out."""
    if line.error is not None:
        return answer(line, None, None, None)
    request_id = f"req_{uuid.uuid4().hex}"
    data, content_type = json.dumps(line.body).encode(), "application/json"
    if line.url in SPEECH_URLS:  # its clip by file_url, sent on as the route's form
        try:
            data, content_type = await trio.to_thread.run_sync(speech_form, line.body, eng.config.media_domains)
        except InvalidParamError as exc:
            return answer(line, 400, request_id, {"error": {
                "message": str(exc), "type": "invalid_request_error", "param": exc.param, "code": "invalid_value"}})
    while True:
        status, raw = await call_app(app, line.url, data, {"X-Request-Id": request_id}, content_type)
        if status not in _RETRY_STATUSES:
            break
        if eng.dead:
            raise EngineGone(f"the engine died: {eng.dead_reason!r}")
        await trio.sleep(RETRY_AFTER_SECONDS)
    try:
        body = json.loads(raw)
    except ValueError:
        text = raw.decode(errors="replace")
        # A transcription's text, srt or vtt answer is plain text: the body is that string.
        body = text if status < 400 else {"error": {"message": text, "code": str(status)}}
    return answer(line, status, request_id, body)


# -- the run --------------------------------------------------------------------------------


class _Output:
    """OUT (a file, or stdout for ``-``): each batch of finished lines written and flushed
    in a worker thread, off the loop the engine's actors run on (a slow pipe reader must
    not stall them)."""

    def __init__(self, path: str, append: bool) -> None:
        self.path = path
        try:
            self._file: BinaryIO = (sys.stdout.buffer if path == "-"
                                    else open(path, "ab" if append else "wb"))  # noqa: SIM115
        except OSError as exc:
            raise BatchFileError(f"--output-file: {exc}") from None

    def write(self, lines: list[dict[str, Any]]) -> None:
        # ASCII JSON: a lone surrogate from a body's escapes still writes.
        data = b"".join(json.dumps(item).encode() + b"\n" for item in lines)
        self._file.write(data)
        self._file.flush()

    def close(self) -> None:
        if self._file is not sys.stdout.buffer:
            self._file.close()


@dataclass
class BatchCounts:
    answered: int = 0
    errors: int = 0


async def _write_answers(receive: trio.MemoryReceiveChannel[dict[str, Any]], out: _Output,
                         counts: BatchCounts, progress: Any) -> None:
    async with receive:
        async for first in receive:
            lines = [first]
            while True:  # everything finished meanwhile goes in the same write
                try:
                    lines.append(receive.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            await trio.to_thread.run_sync(out.write, lines)
            counts.answered += len(lines)
            counts.errors += sum(1 for item in lines if item["error"] is not None)
            progress.update(len(lines))
            progress.set_postfix(errors=counts.errors, refresh=False)


async def run_lines(app: Any, eng: Any, lines: list[BatchLine], out: _Output, *,
                    max_concurrency: int, progress: Any) -> BatchCounts:
    """Answer ``lines``, at most ``max_concurrency`` at once, each written as it finishes."""
    counts = BatchCounts()
    slots = trio.Semaphore(max_concurrency)
    # One answer may wait while the writer is in its thread; the slots bound the rest.
    send, receive = trio.open_memory_channel[dict[str, Any]](max_concurrency)

    async def one(line: BatchLine, send: trio.MemorySendChannel[dict[str, Any]]) -> None:
        async with send:
            try:
                await send.send(await run_line(app, eng, line))
            finally:
                slots.release()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(_write_answers, receive, out, counts, progress)
        async with send:
            async with trio.open_nursery() as lines_nursery:
                for line in lines:
                    await slots.acquire()
                    lines_nursery.start_soon(one, line, send.clone())
    return counts


async def _run(args: argparse.Namespace, lines: list[BatchLine]) -> int:
    config = config_from_args(args)
    settings = chat_settings(args)
    out = _Output(args.output_file, append=args.resume)
    gone: EngineGone | None = None
    t0 = time.monotonic()
    try:
        async with open_engine(config=config) as eng:
            logger.info("engine ready: %s (%.2f s); %d line(s) to answer", eng.model_name,
                        time.monotonic() - t0, len(lines))
            app = create_app(eng, chat=settings)
            # Enough in flight to fill a step and have the next ones admitted and
            # tokenized, and far below the queue's limit (a 429 is retried, but wastes work).
            concurrency = args.max_concurrency or min(2 * config.max_num_seqs,
                                                      config.max_queued_requests)
            with tqdm(total=len(lines), desc="run-batch", unit="req", file=sys.stderr,
                      disable=args.no_progress or None) as progress:
                t1 = time.monotonic()
                counts = await run_lines(app, eng, lines, out, max_concurrency=concurrency,
                                         progress=progress)
    except* EngineGone as group:
        gone = group.exceptions[0]  # type: ignore[assignment]
    finally:
        out.close()
    if gone is not None:
        logger.error("%s; the lines not answered are left for --resume", gone)
        return EXIT_ENGINE_DEAD
    elapsed = time.monotonic() - t1
    rate = counts.answered / elapsed if elapsed > 0 else math.inf
    print(f"run-batch: answered {counts.answered} line(s), {counts.errors} with an error, in "
          f"{elapsed:.1f} s ({rate:.1f} lines/s) -> "
          f"{'stdout' if args.output_file == '-' else args.output_file}", file=sys.stderr)
    return 0


def _read_input(path: str) -> list[str]:
    if path == "-":
        return sys.stdin.read().splitlines()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise BatchFileError(f"--input-file: {exc}") from None


def _run_until_interrupted(args: argparse.Namespace, lines: list[BatchLine]) -> int:
    """:func:`_run`; Ctrl-C (from inside the engine's nurseries, so in a group) ends the
    run with the answers written so far whole (the writer's thread finishes its write)."""
    interrupted = False
    try:
        status = trio.run(_run, args, lines)
    except* KeyboardInterrupt:
        interrupted = True
    if interrupted:
        print("run-batch: interrupted; run again with --resume to answer the rest",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    return status


def run_batch(args: argparse.Namespace) -> int:
    """The ``run-batch`` command; returns the exit status."""
    try:
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise BatchFileError("--max-concurrency must be at least 1")
        if args.resume and args.output_file == "-":
            raise BatchFileError("--resume needs an output file (it reads back what is "
                                 "answered), not stdout")
        lines = read_batch(_read_input(args.input_file))
        if args.resume:
            ids, numbers = resume_state(args.output_file)
            before = len(lines)
            lines = [line for line in lines if line.custom_id not in ids and not
                     (line.custom_id is None and line.number in numbers)]
            print(f"run-batch: --resume: {before - len(lines)} of {before} line(s) already "
                  f"answered in {args.output_file}", file=sys.stderr)
        if not lines and args.resume:
            return 0  # nothing left: no model to load
        return _run_until_interrupted(args, lines)
    except (BatchFileError, ValueError) as exc:  # ConfigError is a ValueError
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except EngineError as exc:  # a model that does not load
        print(f"error: {exc}", file=sys.stderr)
        return 1


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "run-batch", help="answer an OpenAI Batch file (JSONL) offline",
        formatter_class=HelpFormatter,
        description="Answer every line of an OpenAI Batch API input file through the "
                    "engine, with no server: each line's body goes through the same "
                    "validation and answer as the HTTP server's. Output lines are written "
                    "as they finish (see 'Offline batches' in docs/serving.md).")
    batch = p.add_argument_group("batch")
    batch.add_argument("-i", "--input-file", required=True, metavar="IN",
                       help="the batch input (JSONL), or - for stdin")
    batch.add_argument("-o", "--output-file", required=True, metavar="OUT",
                       help="where the answers go (JSONL), or - for stdout")
    batch.add_argument("--resume", action="store_true",
                       help="keep OUT and answer only the lines whose custom_id it lacks")
    batch.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                       help="lines in flight at once (default: twice --max-num-seqs)")
    batch.add_argument("--no-progress", action="store_true",
                       help="no progress bar (it shows only on a terminal anyway)")
    add_chat_arguments(p.add_argument_group("chat"))
    add_engine_arguments(p, max_engine_restarts=DEFAULT_MAX_ENGINE_RESTARTS,
                         grammar_compile_workers=SERVE_GRAMMAR_COMPILE_WORKERS)
