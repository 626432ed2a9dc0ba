"""Grammar compiles in worker processes that can be killed: :class:`CompilePool`.

A compile is CPU-bound C++ (xgrammar) or Rust (llguidance) that no thread can interrupt: a
60-byte schema pattern ``^[a-z]{1,30000}$`` compiles for minutes. So each compile runs in
a worker process (:mod:`engine.structured.worker`) and the pool holds it to three bounds:

* time: past ``timeout`` seconds the worker is killed and the request refused (a 400
  naming ``--grammar-compile-timeout``);
* size: a compiled grammar larger than ``max_bytes`` is refused by the worker;
* concurrency: at most ``workers`` compiles at once (one per process), under this pool's
  own limiter; the others wait their turn without holding a thread, so compiles never
  starve the threads that tokenize.

A caller that leaves (its client disconnected, the server stopping) kills its compile:
nothing keeps burning CPU for a request that is gone, and shutdown never waits on one.
A grammar the cache lost while a request still needs it (see the holds in
:mod:`engine.structured.backend`) comes back through :meth:`CompilePool.recompile`: the
same worker processes, budgets and limiter. Requests for a spec already being compiled
wait for that compile instead of starting their own; a refusal (invalid, too slow, too large) is never cached, so it changes nothing
for other specs. Idle workers stay up for the next compile; :meth:`aclose` kills them all.

Measured cost of the process boundary, for a normal schema: the compile itself is the
same; its result crosses as xgrammar's serialized JSON and is read back in a thread
(``GrammarBackend.adopt``). A spec seen before is a cache hit and never reaches a worker.
``bench/grammar_compile.py`` times both paths.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import trio

from engine.errors import InvalidParamError
from engine.structured.backend import GrammarBackend
from engine.structured.compiled import CompiledGrammar
from engine.structured.spec import StructuredOutputs

logger = logging.getLogger("engine")

_HEADER = struct.Struct(">I")
# A worker starts Python, imports xgrammar (and torch under it) and builds the tokenizer's
# tables: a few seconds; a minute means something is wrong.
_START_TIMEOUT = 60.0
# After SIGKILL a process is gone within milliseconds; this only bounds the reaping.
_REAP_TIMEOUT = 2.0
# The folder that holds the engine package: a worker imports this same engine.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class _Worker:
    """One worker process and its framed pipe protocol."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self._buffer = bytearray()

    @classmethod
    async def start(cls, payload: bytes) -> _Worker:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
        # Its own session: a terminal's Ctrl-C goes to the server, which kills its workers.
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "engine.structured.worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env, start_new_session=True)
        worker = cls(process)
        try:
            with trio.fail_after(_START_TIMEOUT):
                await worker._send(payload)
                ready = await worker._receive()
        except BaseException:
            await worker.kill()
            raise
        if not (isinstance(ready, dict) and ready.get("ready")):
            await worker.kill()
            raise RuntimeError("a grammar compile worker failed to start")
        return worker

    async def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        body = msgpack.packb(request)
        await self._send(_HEADER.pack(len(body)) + body)
        reply = await self._receive()
        if not isinstance(reply, dict):
            raise RuntimeError("a grammar compile worker sent a malformed reply")
        return reply

    async def kill(self) -> None:
        """SIGKILL and reap (shielded: it runs on the way out of a cancelled compile)."""
        with trio.CancelScope(shield=True):
            if self.process.returncode is None:
                self.process.kill()
            with trio.move_on_after(_REAP_TIMEOUT):
                await self.process.wait()
            for stream in (self.process.stdin, self.process.stdout):
                if stream is not None:
                    await stream.aclose()

    async def _send(self, data: bytes) -> None:
        assert self.process.stdin is not None
        try:
            await self.process.stdin.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise RuntimeError("a grammar compile worker exited") from exc

    async def _receive(self) -> Any:
        header = await self._read(_HEADER.size)
        (size,) = _HEADER.unpack(header)
        return msgpack.unpackb(await self._read(size))

    async def _read(self, size: int) -> bytes:
        assert self.process.stdout is not None
        while len(self._buffer) < size:
            chunk = await self.process.stdout.receive_some(max(65536, size - len(self._buffer)))
            if not chunk:
                raise RuntimeError("a grammar compile worker exited")
            self._buffer += chunk
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data


@dataclasses.dataclass
class _Flight:
    """A compile in progress: other requests for its spec wait on ``done``."""

    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    error: InvalidParamError | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class CompilePoolStatistics:
    workers: int  # worker processes alive now
    busy: int  # compiles running in a worker now (not counting workers starting)
    waiting: int  # compiles waiting for a worker
    killed: int  # compiles killed so far (past the time budget, or their caller left)
    compiles: int = 0  # compiles run under the limiter (in a worker, or a pool thread)
    recompiles: int = 0  # of the requests for one, those for a grammar the cache had lost


class CompilePool:
    """Compiles :class:`StructuredOutputs` into ``backend``'s cache in worker processes.

    ``workers`` processes at most (started on first need, kept while idle), ``timeout``
    seconds per compile, ``max_bytes`` per compiled grammar. Owned by one engine; call
    :meth:`aclose` when it stops. ``workers=0`` compiles in two threads of its own instead
    (the embedded API's default: no process to start, but a compile past its budget is
    abandoned, not stopped, and the size budget does not apply).
    """

    def __init__(self, backend: GrammarBackend, *, workers: int, timeout: float,
                 max_bytes: int) -> None:
        self._backend = backend
        self._threads = workers == 0
        workers = workers or 2  # threads: two, as xgrammar's own compile threads
        self._timeout = timeout
        self._max_bytes = max_bytes
        self._limiter = trio.CapacityLimiter(workers)
        # Reading a result back (xgrammar's JSON) is bounded by max_bytes; its threads are
        # this pool's own, not trio's default ones that tokenizing uses.
        self._read_limiter = trio.CapacityLimiter(workers)
        self._idle: list[_Worker] = []
        self._live: set[_Worker] = set()
        self._flights: dict[tuple[str, str, str], _Flight] = {}
        self._payload: bytes | None = None
        self._killed = 0
        self._compiling = 0
        self._compiles = 0
        self._recompiles = 0
        self._closed = False

    async def compile(self, spec: StructuredOutputs, *, count: bool = True) -> None:
        """Make sure ``spec``'s grammar is in the backend's cache; count the request
        (``count``). Raises :class:`InvalidParamError` for a constraint no backend takes,
        or one past the time or size budget."""
        if count:
            self._backend.count_request(spec)
        if self._threads:
            await self._compile_in_thread(spec)
            return
        while True:
            if self._backend.cached(spec) is not None:
                await trio.lowlevel.checkpoint()
                return
            flight = self._flights.get(spec.key)
            if flight is None:
                break
            await flight.done.wait()
            if flight.error is not None:
                raise InvalidParamError(flight.error.message, param=flight.error.param)
            # Cached now, or its caller left before it finished: look again.
        flight = _Flight()
        self._flights[spec.key] = flight
        try:
            try:
                reply = await self._run(spec)
                if "error" in reply:
                    raise InvalidParamError(reply["error"], param=reply["param"])
            except InvalidParamError as exc:
                flight.error = exc  # the requests waiting on it get the same answer
                raise
            if "fault" in reply:
                raise RuntimeError(f"grammar compile failed: {reply['fault']}")
            await trio.to_thread.run_sync(
                self._backend.adopt, spec, reply["backend"], reply["data"], reply["seconds"],
                limiter=self._read_limiter)
        finally:
            del self._flights[spec.key]
            flight.done.set()

    async def recompile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """``spec``'s grammar for a live request whose grammar the cache no longer has,
        compiled again as any compile is (this pool's budgets and limiter); held while it
        compiles, so that it is still cached when it is read."""
        self._recompiles += 1
        self._backend.hold(spec)
        try:
            await self.compile(spec, count=False)
            compiled = self._backend.cached(spec)
        finally:
            self._backend.release(spec)
        if compiled is None:  # cannot happen: a held grammar is never evicted
            raise RuntimeError(f"the {spec.kind} grammar left the cache while held")
        return compiled

    async def _compile_in_thread(self, spec: StructuredOutputs) -> None:
        """``workers=0``: compile in a thread of this pool's own. Past the budget the
        request is refused but the thread runs on (no thread can be stopped) and caches
        its grammar when done; the limiter counts it until then."""
        if self._backend.cached(spec) is not None:
            await trio.lowlevel.checkpoint()
            return
        with trio.move_on_after(self._timeout):
            self._compiles += 1
            await trio.to_thread.run_sync(functools.partial(self._backend.compile, spec,
                                                            count=False),
                                          abandon_on_cancel=True, limiter=self._limiter)
            return
        raise self._too_slow(spec.kind)

    def _too_slow(self, kind: str) -> InvalidParamError:
        logger.warning("a %s grammar compile ran past --grammar-compile-timeout (%g s)",
                       kind, self._timeout)
        return InvalidParamError(
            f"the {kind} constraint did not compile within {self._timeout:g} s "
            "(--grammar-compile-timeout); a large repetition count (such as "
            "{1,30000}) or a very large schema is the usual cause",
            param="structured_outputs")

    async def _run(self, spec: StructuredOutputs) -> dict[str, Any]:
        kind, text, think = spec.key
        async with self._limiter:
            worker = await self._take()
            reply: dict[str, Any] | None = None
            self._compiling += 1
            self._compiles += 1
            try:
                with trio.move_on_after(self._timeout):
                    reply = await worker.ask({"kind": kind, "text": text, "think": think})
            finally:
                self._compiling -= 1
                if reply is not None and not self._closed:
                    self._idle.append(worker)
                else:
                    # Past the budget, its caller gone, or the worker broken: a compile
                    # cannot be interrupted, so its process goes.
                    self._killed += 1
                    self._live.discard(worker)
                    await worker.kill()
        if reply is None:
            raise self._too_slow(kind)
        return reply

    async def _take(self) -> _Worker:
        if self._closed:
            raise RuntimeError("the grammar compile pool is closed")
        if self._idle:
            return self._idle.pop()
        if self._payload is None:
            payload = await trio.to_thread.run_sync(
                self._backend.worker_payload, self._max_bytes, limiter=self._read_limiter)
            body = msgpack.packb(payload)
            self._payload = _HEADER.pack(len(body)) + body
        worker = await _Worker.start(self._payload)
        self._live.add(worker)
        return worker

    def statistics(self) -> CompilePoolStatistics:
        stats = self._limiter.statistics()
        return CompilePoolStatistics(len(self._live), self._compiling, stats.tasks_waiting,
                                     self._killed, self._compiles, self._recompiles)

    async def aclose(self) -> None:
        """Kill every worker (idle or compiling); later compiles fail."""
        self._closed = True
        live, self._live, self._idle = list(self._live), set(), []
        for worker in live:
            await worker.kill()
