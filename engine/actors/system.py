"""Building the engine's parts and running its actors: the one function owning the nursery.

Channel graph (buffer 0 unless noted)::

    caller --SubmitRequest--> processor --DetokenizerRequest--> detokenizer --OutputBatch--> router
                                 |  \\--RequestAdmitted/Rejected------------------------------^
                                 v                                   ^
    aborts, stop hits ----> scheduler inbox (inf) --StepOutputs------/
    step results ------------^    |  ^
                   AllocatorCall  v  | AllocatorReply
                              KV allocator
                   scheduler --StepPlan--> executor --StepResult--> scheduler inbox
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import trio

from engine.actors.allocator import KVAllocator
from engine.actors.detokenizer import Detokenizer
from engine.actors.executor import Executor
from engine.actors.processor import Processor, ProcessorLimits
from engine.actors.router import OutputRouter
from engine.actors.scheduler import SchedulerActor
from engine.config import EngineConfig
from engine.errors import InvalidParamError
from engine.messages import AbortRequests, SubmitRequest

logger = logging.getLogger("engine")


@dataclasses.dataclass(frozen=True, slots=True)
class EngineStatistics:
    """A snapshot of the engine. Prefix-cache counts are in tokens; counts are cumulative."""

    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_free: int  # held by no request; cached blocks nobody holds count as free
    prefix_cache_hits: int
    prefix_cache_queries: int
    preemptions: int
    steps: int
    requests_finished: int


@dataclasses.dataclass(slots=True)
class EngineParts:
    """Everything built before the actors start (in a worker thread: loading is slow)."""

    config: EngineConfig  # resolved: max_model_len filled in
    model_name: str
    tokenizer: Any  # engine.models.tokenizer.Tokenizer
    limits: ProcessorLimits
    runner: Any  # engine.runner.model_runner.ModelRunner
    num_blocks: int


@dataclasses.dataclass(frozen=True, slots=True)
class ActorHandles:
    """What the embedded API may touch of running actors (never the nursery)."""

    router: OutputRouter
    submit: trio.MemorySendChannel[SubmitRequest]
    abort: Callable[[tuple[str, ...]], None]
    statistics: Callable[[], EngineStatistics]
    actors: dict[str, Any]  # name -> actor, for their statistics() (tests, benchmarks)


def build_parts(config: EngineConfig) -> EngineParts:
    """Load the model and tokenizer, size the KV pool, build the model runner.

    Blocking (seconds); the API runs it in a worker thread. Each phase is logged with
    its time on the ``engine`` logger.
    """
    from engine.models.loader import load_model, resolve_model
    from engine.models.tokenizer import Tokenizer
    from engine.ops import get_ops
    from engine.runner.kv_cache import num_kv_blocks
    from engine.runner.model_runner import ModelRunner

    device = _device(config.device)
    t0 = time.perf_counter()
    path = resolve_model(config.model)
    loaded = load_model(path, dtype=config.dtype, device=device)
    t1 = time.perf_counter()
    logger.info("loaded %s (%s, %s) in %.2f s", path, loaded.config.architecture, loaded.dtype, t1 - t0)
    tokenizer = Tokenizer.from_folder(loaded.folder)
    t2 = time.perf_counter()
    logger.info("tokenizer ready in %.2f s", t2 - t1)
    config, num_blocks = _size_kv_pool(config, loaded, device, num_kv_blocks)
    runner = ModelRunner(
        loaded,
        device=device,
        ops=get_ops(config.ops_backend, device),
        num_blocks=num_blocks,
        block_size=config.block_size,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        seed=config.seed,
    )
    t3 = time.perf_counter()
    logger.info(
        "KV pool: %d blocks of %d tokens (%d tokens), max_model_len %d; runner built in %.2f s",
        num_blocks, config.block_size, num_blocks * config.block_size, config.max_model_len, t3 - t2,
    )
    runner.warm_up()
    logger.info("warm-up (one prefill and one decode step) in %.2f s", time.perf_counter() - t3)
    limits = ProcessorLimits(
        max_model_len=config.max_model_len or 0,
        vocab_size=loaded.config.vocab_size,
        max_queued_requests=config.max_queued_requests,
        eos_token_ids=_eos_ids(loaded, tokenizer),
    )
    name = config.served_model_name or _model_name(path)
    return EngineParts(config, name, tokenizer, limits, runner, num_blocks)


def _device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _size_kv_pool(
    config: EngineConfig, loaded: Any, device: torch.device, num_kv_blocks: Callable[..., int]
) -> tuple[EngineConfig, int]:
    """The pool size, and max_model_len: the model's, capped by what the pool holds."""
    model_max = loaded.config.max_position_embeddings
    wanted = config.max_model_len
    if wanted is not None and wanted > model_max:
        raise InvalidParamError(
            f"max_model_len {wanted} exceeds the model's max_position_embeddings {model_max}",
            param="max_model_len",
        )
    # With no explicit length, any pool of at least one block is fine: the length shrinks
    # to fit it. An explicit length must fit whole (num_kv_blocks raises otherwise).
    blocks = num_kv_blocks(
        loaded.config, loaded.dtype, config.block_size, config.kv_cache_memory, device,
        max_model_len=wanted if wanted is not None else config.block_size,
    )
    max_len = min(wanted or model_max, blocks * config.block_size)
    return dataclasses.replace(config, max_model_len=max_len), blocks


def _eos_ids(loaded: Any, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids of the tokenizer, the model config and generation_config.json, merged."""
    ids = set(tokenizer.eos_token_ids) | set(loaded.config.eos_token_ids)
    gen = loaded.generation_config.get("eos_token_id")
    ids |= set(gen) if isinstance(gen, list) else ({gen} if isinstance(gen, int) else set())
    return tuple(sorted(ids))


def _model_name(path: Path) -> str:
    path = Path(path)
    return path.stem if path.suffix == ".gguf" else path.name


async def run_actors(parts: EngineParts, *, ready: Callable[[ActorHandles], None]) -> None:
    """Open every channel, start every actor in dependency order, then call ``ready``.

    Returns when all actors have stopped; raises what they raise (an actor's crash cancels
    the others). Cancel the caller's scope to stop the engine.
    """
    from engine.core.block_pool import BlockPool
    from engine.core.scheduler import Scheduler, SchedulerConfig

    config = parts.config
    submit_send, submit_recv = trio.open_memory_channel[Any](0)
    # math.inf: this inbox closes two cycles (step results from the executor, stop-string
    # hits from the detokenizer) and takes aborts from sync code; its depth stays bounded
    # by admission control (max_queued_requests) plus the steps in flight.
    sched_send, sched_recv = trio.open_memory_channel[Any](math.inf)
    call_send, call_recv = trio.open_memory_channel[Any](0)
    reply_send, reply_recv = trio.open_memory_channel[Any](0)
    plan_send, plan_recv = trio.open_memory_channel[Any](0)
    detok_send, detok_recv = trio.open_memory_channel[Any](0)
    router_send, router_recv = trio.open_memory_channel[Any](0)

    with sched_send, detok_send, router_send:
        abort_send = sched_send.clone()

        def abort(ids: tuple[str, ...]) -> None:
            try:
                abort_send.send_nowait(AbortRequests(ids))
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                pass  # the engine is stopping; every request fails with it anyway

        pool = BlockPool(
            parts.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        allocator = KVAllocator(pool, call_recv, reply_send)
        executor = Executor(parts.runner, plan_recv, sched_send.clone())
        scheduler = SchedulerActor(
            Scheduler(
                SchedulerConfig.from_engine_config(
                    config, max_model_len=parts.limits.max_model_len, num_kv_blocks=parts.num_blocks
                )
            ),
            inbox=sched_recv,
            to_allocator=call_send,
            from_allocator=reply_recv,
            to_executor=plan_send,
            to_detokenizer=detok_send.clone(),
            async_scheduling=(
                config.async_scheduling
                if config.async_scheduling is not None
                else getattr(getattr(parts.runner, "device", None), "type", "cpu") == "cuda"
            ),
        )
        detokenizer = Detokenizer(
            parts.tokenizer, inbox=detok_recv, to_router=router_send.clone(),
            to_scheduler=sched_send.clone(),
        )
        router = OutputRouter(router_recv, abort=abort)
        processor = Processor(
            parts.tokenizer, parts.limits, inbox=submit_recv, to_detokenizer=detok_send.clone(),
            to_scheduler=sched_send.clone(), to_router=router_send.clone(),
            queue_depth=scheduler.queue_depth,
        )
        actors: dict[str, Any] = {
            "allocator": allocator, "executor": executor, "scheduler": scheduler,
            "detokenizer": detokenizer, "router": router, "processor": processor,
        }

        def statistics() -> EngineStatistics:
            sched = scheduler.statistics()
            kv = allocator.statistics()
            return EngineStatistics(
                running=sched.running, waiting=sched.waiting,
                kv_blocks_total=kv.num_blocks, kv_blocks_free=kv.num_free_blocks,
                prefix_cache_hits=kv.prefix_cache_hits, prefix_cache_queries=kv.prefix_cache_queries,
                preemptions=sched.preemptions, steps=sched.steps,
                requests_finished=sched.requests_finished,
            )

        with abort_send, submit_send:
            async with trio.open_nursery() as nursery:
                # Dependency order: each actor starts after those it sends to.
                for name in ("allocator", "executor", "router", "detokenizer", "scheduler", "processor"):
                    await nursery.start(actors[name].run)
                ready(ActorHandles(router, submit_send, abort, statistics, actors))
