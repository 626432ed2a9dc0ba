"""An engine core in a process of its own: scheduler, KV allocator and executor.

Started by a front end (:class:`engine.process.cores.CorePool`) as
``python -m engine.process.core --connect unix:PATH --core-index I --config-json ...``, or
on another machine by ``python -m engine serve --headless --data-parallel-address
HOST:PORT``. It loads the model, connects to its front end, answers the authentication
challenge with the shared secret (``ENGINE_CORE_SECRET``, hex, read here at the edge),
announces itself with a :class:`~engine.messages.CoreHello`, then runs its three actors
under its own ``trio.run`` with a bridge in place of the front end's actors::

    socket --frames--> bridge_in --AdmittedRequest, AbortSamples, StopStringHit--> scheduler
    scheduler --StepOutputs, SamplesAborted--> bridge_out --one frame a step--> socket

The core lives exactly as long as its connection: when the front end closes it (or dies,
and the kernel closes it), the core stops its actors and exits. A core spawned on the
front end's machine also exits when its parent process is gone, which covers a front end
that dies while the core is still loading.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

import trio

from engine._version import VERSION
from engine.actors.model_thread import run_in_model_thread
from engine.actors.system import core_actors
from engine.config import EngineConfig, parse_address
from engine.errors import InvalidParamError
from engine.messages import (
    CORE_CONTROLS,
    AbortSamples,
    AdmittedRequest,
    CoreAccepted,
    CoreFailed,
    CoreHello,
    CoreStatistics,
    DetokenizerRequest,
    StepOutputs,
    StopStringHit,
    TokenDelta,
)
from engine.process.heap import frozen_startup_heap
from engine.process.malloc import cap_arenas
from engine.process.parts import build_parts
from engine.process.spawn import SECRET_ENV, exit_with_parent
from engine.process.wire import FrameStream, WireError, answer_challenge, connect
from engine.structured.pool import CompilePool

logger = logging.getLogger("engine")

# What a crashing core waits to hand its front end the reason (CoreFailed) before it exits:
# one small frame to a peer that reads continuously.
CRASH_REPORT_SECONDS = 2.0
# A step's outputs past this many pooled bytes (per-token outputs: a row a token) go as one
# StepOutputs a request, so that the frame writer can spread them over frames
# (FrameStream.send splits a batch of messages, never one message).
SPLIT_POOLED_BYTES = 8 * 2**20


def frame_sized(messages: list[Any]) -> list[Any]:
    """``messages`` with each StepOutputs whose pooled outputs are large split into one
    StepOutputs a delta (same step; each with its own scheduled times), in order."""
    out: list[Any] = []
    for message in messages:
        if not isinstance(message, StepOutputs) or len(message.deltas) < 2 or sum(
                len(d.pooled or b"") for d in message.deltas) <= SPLIT_POOLED_BYTES:
            out.append(message)
            continue
        for i, delta in enumerate(message.deltas):
            out.append(StepOutputs(
                message.step_id, (delta,), message.prompt_logprobs if i == 0 else (),
                tuple(s for s in message.scheduled if s[0] == delta.sample_id)))
    return out


def auto_engine_core(*, cuda: bool, cpus: int, threads: int, ranks: int) -> str:
    """What ``engine_core="auto"`` (``serve``'s default) is on a machine whose process may
    run on ``cpus`` CPUs: ``"process"`` when a model step leaves at least one of them free,
    ``"inprocess"`` when it keeps them all busy.

    Split, the front end's work for a step (its frame, detokenizing, the HTTP writes) runs
    while the core computes the next one; with a CPU free it costs the step nothing, with
    none it preempts one of the step's threads and their team waits for it at a barrier
    (docs/benchmarks.md, seventeenth pass: on two cores with one torch thread the core
    process gave 1.00-1.05x of one process for chat at 1 to 32 streams and 1.15-1.24x for
    one-sentence embeddings; with two threads, 0.95x at one stream). A step keeps busy, on
    CUDA, the one thread that launches each rank's kernels; on CPU, each of ``ranks``
    tensor-parallel or pipeline ranks' torch threads (``threads`` with one rank; an equal
    share of the CPUs each with several, as
    :func:`engine.process.worker_rank.share_cpu_threads` gives them)."""
    if cuda:
        busy = ranks
    elif ranks > 1:
        busy = ranks * max(1, cpus // ranks)
    else:
        busy = threads
    return "process" if cpus > busy else "inprocess"


def resolve_engine_core(config: EngineConfig) -> EngineConfig:
    """``config`` with ``engine_core="auto"`` decided (:func:`auto_engine_core`) for this
    process's CPUs and torch threads, which a core it spawns inherits; logged."""
    if config.engine_core != "auto":
        return config
    if config.data_parallel_size > 1 or config.data_parallel_address is not None:
        return dataclasses.replace(config, engine_core="process")  # cores apart, always
    import torch

    cuda = config.device.startswith("cuda") or (config.device == "auto"
                                                 and torch.cuda.is_available())
    cpus, threads = len(os.sched_getaffinity(0)), torch.get_num_threads()
    ranks = config.tensor_parallel_size * config.pipeline_parallel_size
    mode = auto_engine_core(cuda=cuda, cpus=cpus, threads=threads, ranks=ranks)
    logger.info("engine core: %s (auto: %d CPUs, a step keeps %s busy)", mode, cpus,
                f"{ranks} launching thread(s) on CUDA" if cuda else
                f"{ranks} rank(s) of threads" if ranks > 1 else f"{threads} torch thread(s)")
    return dataclasses.replace(config, engine_core=mode)


def core_placement(config: Any, local_index: int, local_size: int) -> Any:
    """The config a core runs with, the ``local_index``-th of ``local_size`` cores on this
    machine: on CUDA each takes its own devices (``cuda:i``, or with N tensor-parallel /
    pipeline ranks a core, ``cuda:i*N`` for rank 0 and the next N-1 for its workers); on CPU
    each takes an equal share of this process's CPUs (and as many torch threads), which
    its worker processes inherit and share."""
    import torch

    if local_size <= 1:
        return config
    wants_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if wants_cuda:
        ranks = config.tensor_parallel_size * config.pipeline_parallel_size
        return dataclasses.replace(config, device=f"cuda:{local_index * ranks}")
    cpus = sorted(os.sched_getaffinity(0))
    share = max(1, len(cpus) // local_size)
    mine = cpus[local_index * share:(local_index + 1) * share] or cpus[-share:]
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))
    logger.info("core on CPUs %s, %d torch threads", mine, len(mine))
    return config


def hello_for(parts: Any, core_index: int) -> CoreHello:
    config = parts.config
    return CoreHello(
        version=VERSION, core_index=core_index, pid=os.getpid(),
        model=str(config.model), served_model_name=parts.model_name,
        tokenizer_folder=str(parts.tokenizer_folder), max_model_len=parts.limits.max_model_len,
        vocab_size=parts.limits.vocab_size, block_size=config.block_size,
        eos_token_ids=tuple(parts.limits.eos_token_ids), num_blocks=parts.num_blocks,
        dtype=parts.dtype, quantization=parts.quantization,
        config_json=config.to_json(),
        pooler_json=json.dumps(dataclasses.asdict(parts.pooler)) if parts.pooler else "",
        worker_pids=tuple(getattr(parts.runner, "worker_pids", list)()),
    )


def crash_cause(exc: BaseException) -> BaseException:
    """The exception inside the nurseries' groups that ``exc`` arrived in (the first)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


async def serve_core(config: Any, address: str, secret: bytes, core_index: int) -> None:
    """Load, connect, handshake, then run the core's actors until the front end leaves."""
    parts = await run_in_model_thread(build_parts, config)
    try:
        frames = FrameStream(await connect(address))
        async with frames.stream:
            await answer_challenge(frames, secret)
            await frames.send((hello_for(parts, core_index),))
            reply = await frames.receive()
            if not any(isinstance(m, CoreAccepted) for m in reply):
                raise WireError(f"the front end did not accept this core: {reply!r}")
            logger.info("core %d connected to %s", core_index, address)
            try:
                await run_core_actors(parts, frames, core_index)
            except Exception as exc:
                # A crash (a tensor-parallel or pipeline worker lost): the core exits and
                # its front end restarts it within the engine's budget; it first says why,
                # so that the requests it fails name the cause (the stage, the rank).
                with trio.CancelScope(shield=True), trio.move_on_after(CRASH_REPORT_SECONDS):
                    try:
                        await frames.send((CoreFailed(str(crash_cause(exc))),))
                    except (trio.BrokenResourceError, trio.ClosedResourceError,
                            trio.BusyResourceError, OSError):
                        pass  # the front end is gone: nobody to tell
                raise
    finally:
        # The actors have stopped: stop the tensor-parallel workers the runner drives.
        close = getattr(parts.runner, "close", None)
        if close is not None:
            close()


async def run_core_actors(parts: Any, frames: FrameStream, core_index: int = 0) -> None:
    """The scheduler, KV-allocator and executor actors of :func:`engine.actors.system.run_actors`,
    fed from and answering to ``frames``. Returns when the peer closes the connection.

    Grammars: this core's runner reads its own grammar backend's cache, so the bridge
    compiles each request's grammar there (a miss once a spec) through a
    :class:`CompilePool` of this process with the front end's budgets, holding it for the
    request's samples until the scheduler sees them end; a grammar the runner still finds
    missing is compiled again through the same pool (``GrammarBackend.recompile``)."""
    config = parts.config
    compiles = None
    if parts.grammar is not None:
        compiles = CompilePool(parts.grammar, workers=config.grammar_compile_workers,
                               timeout=config.grammar_compile_timeout,
                               max_bytes=config.grammar_max_bytes)
        token = trio.lowlevel.current_trio_token()
        parts.grammar.recompile = lambda spec: trio.from_thread.run(
            compiles.recompile, spec, trio_token=token)
    try:
        await _run_core_actors(parts, frames, compiles, core_index)
    finally:
        if compiles is not None:
            with trio.CancelScope(shield=True):
                await compiles.aclose()  # kills compiles still running


async def _run_core_actors(parts: Any, frames: FrameStream, compiles: CompilePool | None,
                           core_index: int) -> None:
    # math.inf: as in run_actors, the inbox closes the executor's cycle and takes the
    # bridge's messages without blocking; admission control in the front end bounds it.
    sched_send, sched_recv = trio.open_memory_channel[Any](math.inf)
    out_send, out_recv = trio.open_memory_channel[Any](0)
    actors = core_actors(parts, inbox=sched_recv, inbox_send=sched_send, to_detokenizer=out_send,
                         profiler_name=f"engine-core{core_index}")
    allocator, scheduler = actors.allocator, actors.scheduler
    refusals = out_send.clone()  # bridge_in's answer to a request whose grammar it refused
    received = 0

    def statistics() -> CoreStatistics:
        sched = scheduler.statistics()
        kv = allocator.statistics()
        return CoreStatistics(
            running=sched.running, waiting=sched.waiting, kv_blocks_total=kv.num_blocks,
            kv_blocks_free=kv.num_free_blocks, prefix_cache_hits=kv.prefix_cache_hits,
            prefix_cache_queries=kv.prefix_cache_queries, preemptions=sched.preemptions,
            steps=sched.steps, requests_finished=sched.requests_finished,
            iteration_token_counts=sched.iteration_token_counts,
            iteration_tokens_sum=sched.iteration_tokens_sum,
            scheduled_tokens=sched.scheduled_tokens, planned_ahead=sched.planned_ahead,
            samples_received=received,
            spec_drafts=sched.spec_drafts, spec_draft_tokens=sched.spec_draft_tokens,
            spec_accepted_tokens=sched.spec_accepted_tokens,
            spec_accepted_per_pos=sched.spec_accepted_per_pos,
            running_loras=sched.running_loras, waiting_loras=sched.waiting_loras,
            external_prefix_cache_queries=sched.external_prefix_cache_queries,
            external_prefix_cache_hits=sched.external_prefix_cache_hits,
        )

    async def compiled(message: AdmittedRequest) -> bool:
        """Whether the request's grammar (if any) is in this core's cache, held for its
        samples; if not, its samples have been answered with an error."""
        spec = message.samples[0].params.structured_outputs
        if spec is None:
            return True
        reason = "this engine core has no grammar backend"
        if parts.grammar is not None and compiles is not None:
            parts.grammar.hold(spec, len(message.samples))  # the scheduler releases them
            try:
                # The front end compiled it already under the same budgets (and refused
                # what does not fit), so this is known to fit, unless this machine is
                # slower or busier; then the request fails, not the core.
                await compiles.compile(spec, count=False)
                return True
            except (InvalidParamError, RuntimeError) as exc:
                parts.grammar.release(spec, len(message.samples))
                reason = str(exc)
        await refusals.send(StepOutputs(-1, tuple(
            TokenDelta(sample_id, (), (), "error", reason) for sample_id in message.sample_ids)))
        return False

    async def bridge_in(cancel: trio.CancelScope, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        nonlocal received
        task_status.started()
        with sched_send, refusals:
            while True:
                try:
                    batch = await frames.receive()
                except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
                    logger.info("the front end closed the connection; the core stops")
                    cancel.cancel()
                    return
                for message in batch:
                    if isinstance(message, AdmittedRequest):
                        if not await compiled(message):
                            received += len(message.samples)
                            continue
                        scheduler.arriving(message)
                        received += len(message.samples)
                        sched_send.send_nowait(message)
                    elif isinstance(message, (AbortSamples, StopStringHit, *CORE_CONTROLS)):
                        sched_send.send_nowait(message)
                    else:
                        raise WireError(f"unexpected message from the front end: "
                                        f"{type(message).__name__}")

    async def bridge_out(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        with out_recv:
            async for first in out_recv:
                batch = [first]
                while True:
                    try:
                        batch.append(out_recv.receive_nowait())
                    except trio.WouldBlock:
                        break
                # The front end hands its detokenizer each sample's spec itself, before
                # the request leaves it; the scheduler's copy has nowhere to go.
                out = frame_sized([m for m in batch if not isinstance(m, DetokenizerRequest)])
                if out:
                    await frames.send((*out, statistics()))

    # The model is loaded: its heap leaves the full collections (process/heap.py).
    with sched_send, frozen_startup_heap():
        async with trio.open_nursery() as nursery:
            for actor in actors.start_order[:-1]:
                await nursery.start(actor.run)
            await nursery.start(bridge_out)
            await nursery.start(scheduler.run)
            await nursery.start(bridge_in, nursery.cancel_scope)


async def run_headless(config: Any, secret: bytes) -> int:
    """``serve --headless``: start this machine's engine cores (ranks
    ``data_parallel_start_rank`` on) and let each connect to the front end at
    ``data_parallel_address``; return when they have all exited (their front end closed
    the link) or on SIGINT/SIGTERM, which stops them. Returns the worst exit status."""
    if config.data_parallel_address is None:
        raise ValueError("--headless needs --data-parallel-address HOST:PORT of the front end")
    host, port = parse_address(config.data_parallel_address)
    local = config.data_parallel_size_local or 1
    ranks = range(config.data_parallel_start_rank, config.data_parallel_start_rank + local)
    if ranks.stop > config.data_parallel_size:
        raise ValueError(f"--headless ranks {ranks.start}..{ranks.stop - 1} exceed "
                         f"--data-parallel-size {config.data_parallel_size}")
    env = {**os.environ, SECRET_ENV: secret.decode()}
    statuses: list[int] = []
    async with trio.open_nursery() as nursery:
        async def one(rank: int, local_index: int) -> None:
            cmd = [sys.executable, "-m", "engine.process.core", "--connect",
                   f"tcp:{host}:{port}", "--core-index", str(rank),
                   "--local-index", str(local_index), "--local-size", str(local),
                   "--config-json", config.to_json(), "--parent-pid", str(os.getpid())]
            if logger.isEnabledFor(logging.INFO):
                cmd.append("--verbose")
            done = await trio.run_process(cmd, env=env, check=False)
            statuses.append(done.returncode)

        async def signals() -> None:
            import signal

            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
                async for _ in received:
                    logger.info("signal received: stopping the engine cores")
                    nursery.cancel_scope.cancel()  # run_process terminates its child
                    return

        nursery.start_soon(signals)
        async with trio.open_nursery() as cores:
            for i, rank in enumerate(ranks):
                cores.start_soon(one, rank, i)
        nursery.cancel_scope.cancel()
    return max(statuses, default=0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.process.core")
    parser.add_argument("--connect", required=True, help="unix:PATH or tcp:HOST:PORT")
    parser.add_argument("--core-index", type=int, default=0)
    parser.add_argument("--local-index", type=int, default=0,
                        help="this core's place among the cores of this machine")
    parser.add_argument("--local-size", type=int, default=1,
                        help="the cores this machine runs (they share its CPUs or GPUs)")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--parent-pid", type=int, default=0)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO if args.verbose else logging.WARNING,
                        format=f"%(asctime)s core{args.core_index} %(levelname)s %(message)s")
    cap_arenas()
    if args.parent_pid:
        exit_with_parent(args.parent_pid)
    secret = os.environ.get(SECRET_ENV, "").encode()
    if not secret:
        print(f"error: {SECRET_ENV} is not set", file=sys.stderr)
        return 2
    config = core_placement(EngineConfig.from_json(args.config_json), args.local_index,
                            args.local_size)
    status = 0
    try:
        trio.run(serve_core, config, args.connect, secret, args.core_index)
    except (OSError, EOFError, WireError) as exc:
        logger.error("core %d: %s", args.core_index, exc)
        status = 1
    except Exception as exc:  # a crash: logged, and the process exits as below
        logger.error("core %d crashed: %s", args.core_index, crash_cause(exc), exc_info=exc)
        status = 1
    # Skip the interpreter's teardown (torch's and the model's objects take seconds to
    # finalize, and a daemon thread cannot run once it starts): nothing of a core needs
    # cleaning up, and its front end wants it gone at once.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
