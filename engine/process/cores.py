"""The front end's engine cores: processes it owns, the links to them, and the routing.

:class:`CorePool` is the actor that stands where the scheduler stands in an in-process
engine. It spawns ``data_parallel_size`` engine-core processes
(:mod:`engine.process.core`), accepts their connections on a Unix-domain socket (and,
with ``listen_tcp``, those of headless cores on other machines), authenticates each with
the shared secret and checks its :class:`~engine.messages.CoreHello` against the first
core's. Then, per core, one task writes frames (every message queued since the last
frame, so a burst of requests travels together) and one reads them (a step's outputs go
to the detokenizer; its :class:`~engine.messages.CoreStatistics` is kept for routing,
admission control and metrics).

Routing: each request goes to the serving core with the least load (running + waiting +
samples still on the wire), unless a core already holds the request's leading prompt
blocks in its prefix cache (as far as this front end knows: it remembers the block hashes
of the prompts it sent to each core) and is not much busier than the least loaded one.

Failure: a core whose connection drops (a ``kill -9``, an out-of-memory kill, a crash)
is noticed at once by its reader. Its requests that had nothing back yet (queued there,
or still on the wire) go to the other serving cores, so their callers never see the
loss; those that had streamed something fail with an
:class:`~engine.errors.EngineDeadError` (the other cores' requests go on). The core is
restarted if the engine's restart budget allows, and its counters carry over, so the
server's metrics never go back. Leaving :meth:`CorePool.run` closes
every connection (a core exits when its front end goes) and reaps the processes, killing
any that has not exited within ``STOP_GRACE_SECONDS``.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
import itertools
import logging
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import trio

from engine._version import VERSION
from engine.actors.system import carry_counters
from engine.errors import ConfigError, EngineDeadError
from engine.messages import (
    CORE_ANSWERS,
    CORE_CONTROLS,
    AbortSamples,
    AdmittedRequest,
    CoreAccepted,
    CoreFailed,
    CoreHello,
    CoreStatistics,
    PauseControlled,
    PrefixCacheReset,
    SamplesAborted,
    StepOutputs,
    StopStringHit,
)
from engine.process.ray_cores import RayCluster
from engine.process.runtime import runtime_folder
from engine.process.spawn import SECRET_ENV
from engine.process.wire import (
    FrameStream,
    WireError,
    authenticate_peer,
    hello_mismatch,
    new_secret,
)

logger = logging.getLogger("engine")

# A core that has not answered the challenge and sent its hello this long after
# connecting is dropped (a stray or hostile peer must not hold an accept slot).
HANDSHAKE_SECONDS = 10.0
# What a core gets to exit by itself once its connection closes (it finishes the step in
# flight, milliseconds to a second) before it is killed.
STOP_GRACE_SECONDS = 5.0
# Prompt blocks remembered per core for cache-affinity routing: enough for thousands of
# distinct prefixes, small beside the core's own cache.
AFFINITY_BLOCKS = 8192
# LoRA adapters remembered per core for affinity routing: a few times --max-cpu-loras' usual
# sizes (each core keeps that many read; a request finds its adapter there).
AFFINITY_LORAS = 64
# The leading blocks of a prompt that affinity looks at (a shared system prompt of up to
# 32 blocks of 16 tokens).
AFFINITY_DEPTH = 32
ROUTING_POLICIES = ("affinity", "least-loaded", "round-robin")


def _wants_cuda(config: Any) -> bool:
    device = getattr(config, "device", "cpu")
    if device == "auto":
        import torch

        return bool(torch.cuda.is_available())
    return str(device).startswith("cuda")


def _group_size(config: Any) -> int:
    """The ranks of one core: itself (rank 0) and its tensor-parallel / pipeline workers."""
    return (int(getattr(config, "tensor_parallel_size", 1))
            * int(getattr(config, "pipeline_parallel_size", 1)))


class CoreState(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    RESTARTING = "restarting"
    DEAD = "dead"


@dataclasses.dataclass(eq=False)
class _Core:
    index: int
    state: CoreState = CoreState.STARTING
    frames: FrameStream | None = None
    hello: CoreHello | None = None
    stats: CoreStatistics | None = None
    # What this slot's earlier processes counted before they were lost (a restarted core
    # counts from zero): added to its statistics, so the server's counters never go back.
    carried: CoreStatistics | None = None
    sent_samples: int = 0
    live: set[str] = dataclasses.field(default_factory=set)
    # The live samples that have had nothing back yet (no token, no prompt logprobs), with
    # their request: if this core is lost, such a request is sent to another core.
    quiet: dict[str, AdmittedRequest] = dataclasses.field(default_factory=dict)
    blocks: collections.OrderedDict[bytes, None] = dataclasses.field(
        default_factory=collections.OrderedDict)
    # The LoRA adapters (ids) of the requests last sent here, most recent last: the core
    # holds them read (and likely in a slot), so their next requests go here (affinity).
    loras: collections.OrderedDict[int, None] = dataclasses.field(default_factory=collections.OrderedDict)
    outbox: list[Any] = dataclasses.field(default_factory=list)
    wake: trio.Event = dataclasses.field(default_factory=trio.Event)
    arrived: trio.MemorySendChannel[FrameStream] | None = None
    process: Any = None  # the local core's process (or Ray actor handle) while it runs
    # Why the core said it is exiting (its CoreFailed: a worker of its group lost, say),
    # for the errors of the requests it fails; "" when it just went.
    failure: str = ""

    def load(self) -> int:
        stats = self.stats
        if stats is None:
            return self.sent_samples
        return stats.running + stats.waiting + (self.sent_samples - stats.samples_received)


@dataclasses.dataclass(frozen=True, slots=True)
class CorePoolStatistics:
    cores: tuple[tuple[int, str, int], ...]  # (index, state, load)
    frames_sent: int
    frames_received: int
    bytes_sent: int
    bytes_received: int
    restarts: int


class CorePool:
    """Actor: the front end's engine cores (see the module docstring).

    ``allow_restart`` is asked before a lost core is restarted (it counts the restart
    against the engine's budget); ``on_lost`` fails the samples a lost core was serving;
    ``on_state`` hears the number of serving cores whenever it changes.
    """

    def __init__(
        self,
        config: Any,
        *,
        to_detokenizer: trio.MemorySendChannel[Any],
        data_parallel_size: int = 1,
        routing: str = "affinity",
        listen_tcp: tuple[str, int] | None = None,
        local_cores: int | None = None,
        secret: bytes | None = None,
        verbose: bool = False,
    ) -> None:
        if routing not in ROUTING_POLICIES:
            raise ConfigError(f"routing must be one of {', '.join(ROUTING_POLICIES)}",
                              field="data_parallel_routing")
        self.config = config
        self.size = data_parallel_size
        self.local = self.size if local_cores is None else local_cores
        self.routing = routing
        self.listen_tcp = listen_tcp
        self.secret = secret if secret is not None else new_secret()
        self.verbose = verbose
        self.allow_restart: Callable[[], bool] = lambda: False
        self.on_lost: Callable[[tuple[str, ...], BaseException], None] = lambda ids, exc: None
        self.on_state: Callable[[int], None] = lambda serving: None
        self.restarts = 0
        self.reference: CoreHello | None = None
        self.tcp_address: tuple[str, int] | None = None
        self.unix_path = ""  # where local cores connect (set by run)
        self._to_detokenizer = to_detokenizer
        self._cores = [_Core(i) for i in range(self.size)]
        self._owner: dict[str, _Core] = {}
        self._undispatched = 0
        self._round_robin = itertools.count()
        self._stopping = False
        self._gone_frames = [0, 0, 0, 0]  # of connections closed since: sent, received, bytes
        self._ray: RayCluster | None = None  # --data-parallel-backend ray: where cores run
        self._ray_address = ""  # tcp:HOST:PORT the core actors connect to

    # -- what the front end's actors call -----------------------------------------------------

    @property
    def serving(self) -> int:
        return sum(c.state is CoreState.SERVING for c in self._cores)

    def arriving(self, request: AdmittedRequest) -> None:
        """Count a request put in the dispatcher's inbox (for admission control)."""
        self._undispatched += len(request.samples)

    def queue_depth(self) -> int:
        waiting = sum(c.stats.waiting if c.stats else 0 for c in self._cores)
        on_wire = sum(c.sent_samples - (c.stats.samples_received if c.stats else 0)
                      for c in self._cores if c.state is CoreState.SERVING)
        return waiting + on_wire + self._undispatched

    def core_statistics(self) -> list[tuple[int, CoreStatistics | None]]:
        """Each core's last statistics, its counters cumulative over its restarts; None
        for a core that has run no step yet (and none before a restart)."""
        return [(c.index, self._counted(c)) for c in self._cores]

    def _counted(self, core: _Core) -> CoreStatistics | None:
        if core.stats is not None:
            return carry_counters(core.carried, core.stats)
        if core.carried is None:
            return None
        # Lost, or restarted and not stepped yet: what it counted, over an idle pool.
        blocks = self.reference.num_blocks if self.reference is not None else 0
        return dataclasses.replace(core.carried, running=0, waiting=0, kv_blocks_total=blocks,
                                   kv_blocks_free=blocks, samples_received=0)

    def statistics(self) -> CorePoolStatistics:
        frames = [c.frames for c in self._cores if c.frames is not None]
        return CorePoolStatistics(
            cores=tuple((c.index, c.state.value, c.load()) for c in self._cores),
            frames_sent=self._gone_frames[0] + sum(f.frames_sent for f in frames),
            frames_received=self._gone_frames[1] + sum(f.frames_received for f in frames),
            bytes_sent=self._gone_frames[2] + sum(f.bytes_sent for f in frames),
            bytes_received=self._gone_frames[3] + sum(f.bytes_received for f in frames),
            restarts=self.restarts,
        )

    async def dispatch(self, message: Any) -> None:
        """Send one message from the front end's inbox to the core it concerns."""
        if isinstance(message, AdmittedRequest):
            self._undispatched -= len(message.samples)
            core = self._route(message)
            if core is None:
                self.on_lost(message.sample_ids, EngineDeadError(
                    "no engine core is serving (they are restarting); retry shortly"))
                return
            # The detokenizer hears of each sample before the core can produce a token.
            for spec in message.outputs:
                await self._to_detokenizer.send(spec)
            self._assign(core, message)
        elif isinstance(message, AbortSamples):
            by_core: dict[_Core, list[str]] = {}
            for sample_id in message.sample_ids:
                owner = self._owner.get(sample_id)
                if owner is not None:
                    # An aborted request is not moved should its core be lost (the abort
                    # queued for it would be lost with the core): it fails with the core.
                    owner.quiet.pop(sample_id, None)
                    by_core.setdefault(owner, []).append(sample_id)
            for core, ids in by_core.items():
                self._queue(core, AbortSamples(tuple(ids)))
        elif isinstance(message, StopStringHit):
            owner = self._owner.get(message.sample_id)
            if owner is not None:
                self._queue(owner, message)
        elif isinstance(message, CORE_CONTROLS):  # each serving core answers
            for core in (c for c in self._cores if c.state is CoreState.SERVING):
                self._queue(core, message)
        else:
            raise TypeError(f"the core pool cannot route {type(message).__name__}")

    def _assign(self, core: _Core, request: AdmittedRequest) -> None:
        for sample_id in request.sample_ids:
            self._owner[sample_id] = core
            core.live.add(sample_id)
            core.quiet[sample_id] = request
        core.sent_samples += len(request.samples)
        self._remember_blocks(core, request)
        lora = request.samples[0].lora
        if lora is not None:
            core.loras[lora.id] = None
            core.loras.move_to_end(lora.id)
            while len(core.loras) > AFFINITY_LORAS:
                core.loras.popitem(last=False)
        self._queue(core, request)

    # -- routing -------------------------------------------------------------------------------

    def _route(self, request: AdmittedRequest) -> _Core | None:
        serving = [c for c in self._cores if c.state is CoreState.SERVING]
        if not serving:
            return None
        if self.routing == "round-robin":
            return serving[next(self._round_robin) % len(serving)]
        least = min(serving, key=_Core.load)
        if self.routing == "least-loaded":
            return least
        hashes = self._block_hashes(request)
        best, best_hits = least, 0
        for core in serving:
            hits = 0
            for h in hashes:
                if h not in core.blocks:
                    break
                hits += 1
            if hits > best_hits or (hits == best_hits and hits and core.load() < best.load()):
                best, best_hits = core, hits
        # "Much busier": the cached blocks save a prefill of best_hits blocks, worth
        # waiting behind a few more requests, not behind twice the work.
        if best_hits and best.load() <= 2 * least.load() + 4:
            return best
        lora = request.samples[0].lora
        if lora is not None:  # no cached prefix: a core that holds its adapter, unless much busier
            holders = [c for c in serving if lora.id in c.loras]
            if holders:
                holder = min(holders, key=_Core.load)
                if holder.load() <= 2 * least.load() + 4:
                    return holder
        return least

    def _block_hashes(self, request: AdmittedRequest) -> list[bytes]:
        sample = request.samples[0]
        size = self.config.block_size
        ids = sample.prompt_token_ids
        out: list[bytes] = []
        parent = (sample.cache_salt or "").encode()
        for start in range(0, min(len(ids) - 1, AFFINITY_DEPTH * size) - size + 1, size):
            digest = hashlib.blake2b(parent, digest_size=16)
            digest.update(repr(ids[start:start + size]).encode())
            parent = digest.digest()
            out.append(parent)
        return out

    def _remember_blocks(self, core: _Core, request: AdmittedRequest) -> None:
        if self.routing != "affinity":
            return
        for h in self._block_hashes(request):
            core.blocks[h] = None
            core.blocks.move_to_end(h)
        while len(core.blocks) > AFFINITY_BLOCKS:
            core.blocks.popitem(last=False)

    def _queue(self, core: _Core, message: Any) -> None:
        core.outbox.append(message)
        core.wake.set()

    # -- lifetime ------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[CoreHello] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every core and wait until each has connected and been accepted; report
        the first core's hello; then serve until cancelled, and stop them all."""
        # In the engine's runtime folder, whose next start removes it should this process
        # be killed; a clean stop removes it on the way out.
        with runtime_folder(getattr(self.config, "runtime_dir", None), "cores") as folder:
            path = self.unix_path = str(folder / "core.sock")
            unix = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            await unix.bind(path)
            unix.listen(64)
            listeners: list[trio.SocketListener] = [trio.SocketListener(unix)]
            if self.listen_tcp is not None:
                tcp = await trio.open_tcp_listeners(self.listen_tcp[1], host=self.listen_tcp[0])
                self.tcp_address = tcp[0].socket.getsockname()[:2]
                listeners.extend(tcp)
            if getattr(self.config, "data_parallel_backend", "mp") == "ray":
                # Core actors may run on other nodes: they connect over TCP, to the
                # address Ray reports for this node, on a port of the pool's own.
                self._ray = RayCluster(getattr(self.config, "runtime_dir", None), self.local,
                                       _wants_cuda(self.config), _group_size(self.config))
                host = await trio.to_thread.run_sync(self._ray.start)
                (tcp_ray,) = await trio.open_tcp_listeners(0, host=host)
                self._ray_address = "tcp:{}:{}".format(*tcp_ray.socket.getsockname()[:2])
                listeners.append(tcp_ray)
            try:
                await self._run_cores(listeners, path, task_status)
            finally:
                if self._ray is not None:
                    with trio.CancelScope(shield=True):
                        await trio.to_thread.run_sync(self._ray.close)

    async def _run_cores(self, listeners: list[trio.SocketListener], path: str,
                         task_status: trio.TaskStatus[CoreHello]) -> None:
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(self._accept_loop, listener)
            for core in self._cores:
                send, receive = trio.open_memory_channel[FrameStream](1)
                core.arrived = send
                local = core.index < self.local
                if not local:
                    logger.info("waiting for engine core %d to connect at %s:%d",
                                core.index, *(self.tcp_address or ("?", 0)))
                await nursery.start(self._supervise, core, receive, f"unix:{path}", local)
            assert self.reference is not None  # set by the first core's acceptance
            task_status.started(self.reference)

    async def _accept_loop(self, listener: trio.SocketListener) -> None:
        async with listener, trio.open_nursery() as nursery:
            while True:
                stream = await listener.accept()
                nursery.start_soon(self._handshake, stream)

    async def _handshake(self, stream: trio.abc.Stream) -> None:
        frames = FrameStream(stream)
        try:
            with trio.fail_after(HANDSHAKE_SECONDS):
                await authenticate_peer(frames, self.secret)
                batch = await frames.receive()
            hello = batch[0] if len(batch) == 1 and isinstance(batch[0], CoreHello) else None
            if hello is None:
                raise WireError("the first frame must be a CoreHello")
            core = self._cores[hello.core_index] if 0 <= hello.core_index < self.size else None
            if core is None or core.state not in (CoreState.STARTING, CoreState.RESTARTING) \
                    or core.arrived is None:
                raise WireError(f"no core slot {hello.core_index} is waiting for a connection")
            expected = self.reference or dataclasses.replace(hello, version=VERSION)
            differs = hello_mismatch(expected, hello)
            if differs:
                raise WireError(f"core {hello.core_index} differs from what this front end "
                                f"serves: {differs}")
            core.hello = hello
            self.reference = self.reference or hello
            core.arrived.send_nowait(frames)
        except (WireError, EOFError, trio.TooSlowError, trio.BrokenResourceError,
                trio.WouldBlock, OSError) as exc:
            logger.warning("engine core connection dropped: %s", exc or type(exc).__name__)
            await trio.aclose_forcefully(stream)

    async def _supervise(self, core: _Core, arrived: trio.MemoryReceiveChannel[FrameStream],
                         address: str, local: bool, *,
                         task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        first = True
        while True:
            process = core.process = await self._spawn(core, address) if local else None
            try:
                frames = await self._wait_connected(core, arrived, process)
                if frames is None:
                    if first:
                        raise ConfigError(
                            f"engine core {core.index} exited before it connected "
                            f"(status {process.returncode if process else '?'}); see its log above",
                            field="engine_core")
                else:
                    await frames.send((CoreAccepted(),))
                    core.frames, core.state = frames, CoreState.SERVING
                    self.on_state(self.serving)
                    if first:
                        first = False
                        task_status.started()
                    workers = core.hello.worker_pids if core.hello else ()
                    logger.info("engine core %d serving (pid %d%s)", core.index,
                                core.hello.pid if core.hello else -1,
                                f", workers {', '.join(map(str, workers))}" if workers else "")
                    await self._serve(core, frames)
            finally:
                with trio.CancelScope(shield=True):
                    await self._stop(core, process)
            if not local and not self._stopping:
                # A remote core is restarted on its own machine; its slot waits for it.
                core.state = CoreState.RESTARTING
                logger.error("engine core %d (remote) lost; waiting for it to reconnect",
                             core.index)
                continue
            if self._stopping or not self.allow_restart():
                core.state = CoreState.DEAD
                self.on_state(self.serving)
                logger.error("engine core %d is down for good", core.index)
                return
            self.restarts += 1
            core.state = CoreState.RESTARTING
            logger.error("engine core %d lost; restarting it", core.index)

    async def _spawn(self, core: _Core, address: str) -> Any:
        """A local core: a child process, or with the Ray backend a Ray actor (its
        handle waits, is killed and reports its exit as a process does)."""
        ray = self._ray is not None
        local_index, local_size = core.index, self.local
        if ray and _wants_cuda(self.config):
            local_index, local_size = 0, 1  # Ray shows the actor its one GPU: cuda:0
        argv = ["--connect", self._ray_address if ray else address,
                "--core-index", str(core.index), "--local-index", str(local_index),
                "--local-size", str(local_size), "--config-json", self.config.to_json(),
                # An actor may run on another machine: it exits when its connection
                # closes, not by watching a pid.
                "--parent-pid", "0" if ray else str(os.getpid())]
        if self.verbose or logger.isEnabledFor(logging.INFO):
            argv.append("--verbose")
        if self._ray is not None:
            # Blocking: Ray places the core's bundle group (seconds on a busy cluster).
            return await trio.to_thread.run_sync(self._ray.spawn, argv, self.secret,
                                                 core.index)
        env = {**os.environ, SECRET_ENV: self.secret.decode()}
        return await trio.lowlevel.open_process([sys.executable, "-m", "engine.process.core", *argv],
                                                env=env)

    async def _wait_connected(self, core: _Core, arrived: trio.MemoryReceiveChannel[FrameStream],
                              process: trio.Process | None) -> FrameStream | None:
        """The core's accepted connection, or None if its process exits first."""
        result: list[FrameStream] = []
        async with trio.open_nursery() as nursery:
            async def take() -> None:
                result.append(await arrived.receive())
                nursery.cancel_scope.cancel()

            async def exited() -> None:
                assert process is not None
                await process.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(take)
            if process is not None:
                nursery.start_soon(exited)
        return result[0] if result else None

    async def _serve(self, core: _Core, frames: FrameStream) -> None:
        async with trio.open_nursery() as nursery:
            async def write() -> None:
                while True:
                    await core.wake.wait()
                    core.wake = trio.Event()
                    batch, core.outbox = core.outbox, []
                    if batch:
                        await frames.send(tuple(batch))

            async def read() -> None:
                try:
                    while True:
                        for message in await frames.receive():
                            await self._from_core(core, message)
                except (EOFError, WireError, trio.BrokenResourceError, trio.ClosedResourceError,
                        OSError) as exc:
                    if not self._stopping:
                        logger.error("engine core %d: connection lost (%s)", core.index,
                                     exc or type(exc).__name__)
                nursery.cancel_scope.cancel()

            nursery.start_soon(write)
            nursery.start_soon(read)

    async def _from_core(self, core: _Core, message: Any) -> None:
        if isinstance(message, CoreStatistics):
            core.stats = message
            return
        if isinstance(message, CoreFailed):
            core.failure = message.reason
            logger.error("engine core %d failed: %s", core.index, message.reason)
            return
        if isinstance(message, StepOutputs):
            for scored in message.prompt_logprobs:
                core.quiet.pop(scored.sample_id, None)
            for delta in message.deltas:
                core.quiet.pop(delta.sample_id, None)
                if delta.finish_reason is not None:
                    self._forget(core, delta.sample_id)
        elif isinstance(message, SamplesAborted):
            for sample_id in message.sample_ids:
                self._forget(core, sample_id)
        elif isinstance(message, PrefixCacheReset | PauseControlled):
            if message.done if isinstance(message, PrefixCacheReset) else message.cache_cleared:
                core.blocks.clear()  # what routing by cached prefix knew of it is gone
        elif not isinstance(message, CORE_ANSWERS):  # the others: the caller's answers
            raise WireError(f"unexpected message from a core: {type(message).__name__}")
        await self._to_detokenizer.send(message)

    def _forget(self, core: _Core, sample_id: str) -> None:
        core.live.discard(sample_id)
        core.quiet.pop(sample_id, None)
        if self._owner.get(sample_id) is core:
            del self._owner[sample_id]

    async def _stop(self, core: _Core, process: trio.Process | None) -> None:
        """Close the core's connection (it exits by itself), fail what it was serving,
        reap its process."""
        was_serving = core.state is CoreState.SERVING
        core.state = CoreState.RESTARTING if not self._stopping else CoreState.DEAD
        if was_serving:
            self.on_state(self.serving)
        if not self._stopping:
            self._move_quiet(core)  # before any await: nothing else is routed meanwhile
        frames, core.frames = core.frames, None
        if frames is not None:
            for i, n in enumerate((frames.frames_sent, frames.frames_received,
                                   frames.bytes_sent, frames.bytes_received)):
                self._gone_frames[i] += n
            await trio.aclose_forcefully(frames.stream)
        lost = tuple(core.live)
        for sample_id in lost:
            self._forget(core, sample_id)
        if core.stats is not None:
            core.carried = carry_counters(core.carried, core.stats)
        core.stats, core.sent_samples, core.outbox = None, 0, []
        core.blocks.clear()
        failure, core.failure = core.failure, ""
        if lost and not self._stopping:
            self.on_lost(lost, EngineDeadError(
                f"engine core {core.index} died while serving this request"
                + (f": {failure}" if failure else "")))
            # The detokenizer holds their state until it hears they ended; their "abort"
            # outputs find no mailbox (on_lost failed them) and are dropped.
            try:
                await self._to_detokenizer.send(SamplesAborted(lost))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the front end is stopping
        if process is not None:
            with trio.move_on_after(STOP_GRACE_SECONDS):
                await process.wait()
            if process.returncode is None:
                logger.warning("engine core %d did not exit within %.0f s; killing it",
                               core.index, STOP_GRACE_SECONDS)
                process.kill()
                await process.wait()

    def _move_quiet(self, core: _Core) -> None:
        """Send the requests of a lost core that had nothing back yet (no sample of theirs
        produced a token: the caller has seen nothing) to the other serving cores, as if
        they had been routed there first. Their detokenizer specs are already in place;
        the new core computes them from the start, so a greedy or seeded request gives
        the text it would have given on the lost core. With no other core serving they
        fail with the core, as the requests that had started do."""
        requests = {id(r): r for r in core.quiet.values()}.values()
        moved = 0
        for request in requests:
            if not all(core.quiet.get(s) is request for s in request.sample_ids):
                continue  # some sample of it had output, or was aborted: it fails
            target = self._route(request)
            if target is None:
                return
            for sample_id in request.sample_ids:
                core.live.discard(sample_id)
                del core.quiet[sample_id]
            self._assign(target, request)
            moved += 1
        if moved:
            logger.warning("engine core %d lost: %d request(s) it had not started moved to "
                           "other cores", core.index, moved)

    def stopping(self) -> None:
        """The front end is shutting down: lost connections are no longer failures."""
        self._stopping = True
