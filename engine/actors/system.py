"""Running the engine's actors: the one function that owns their nursery.

Channel graph (buffer 0 unless noted)::

    caller's task --AdmittedRequest, AbortSamples--> scheduler inbox (inf)
    detokenizer --StopStringHit--------------------------^   |  ^   |
    executor --StepResult--------------------------------^   |  |   +--DetokenizerRequest,
                                          AllocatorCall      v  |      StepOutputs,
                                                     KV allocator      SamplesAborted
                                                                       --> detokenizer
    scheduler --StepPlan--> executor                  detokenizer --OutputBatch--> router
    scheduler --FetchBlocks--> KV store (inf) --BlocksFetched--> scheduler inbox
                                (only where a --kv-transfer-config engine reads blocks)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import trio

from engine.actors.allocator import KVAllocator
from engine.actors.detokenizer import Detokenizer
from engine.actors.executor import Executor
from engine.actors.kv_store import KVStoreActor
from engine.actors.parts import EngineParts
from engine.actors.router import OutputRouter
from engine.actors.scheduler import SchedulerActor
from engine.core.block_pool import BlockPool
from engine.core.kv_tier import KVTier
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.messages import AbortSamples, AdmittedRequest
from engine.runner.profiler import StepProfiler


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
    # Steps by the tokens they computed (engine.actors.scheduler.ITERATION_TOKEN_BUCKETS).
    iteration_token_counts: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0
    scheduled_tokens: int = 0  # tokens computed, prefix-cache hits excluded
    planned_ahead: int = 0  # steps planned while the previous one ran (async scheduling)
    # Speculative decoding, cumulative (vLLM's spec_decode counters): steps that verified a
    # proposal, tokens proposed, tokens accepted, accepted tokens by place in the proposal.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # LoRA adapters (names, sorted) of the running and of the waiting requests (vLLM's
    # lora_requests_info).
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    # The KV store (--kv-transfer-config), cumulative and in tokens (vLLM's
    # external_prefix_cache_queries / _hits): prompts looked up there, and tokens read.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class ActorHandles:
    """What the embedded API may touch of running actors (never the nursery)."""

    router: OutputRouter
    send: Callable[[AdmittedRequest], None]  # sync, never blocks; raises
    # trio.ClosedResourceError / BrokenResourceError once the engine stopped
    abort: Callable[[tuple[str, ...]], None]  # sync; a no-op once the engine stopped
    queue_depth: Callable[[], int]  # samples waiting to be scheduled
    statistics: Callable[[], EngineStatistics]
    actors: dict[str, Any]  # name -> actor, for their statistics() (tests, benchmarks)


def step_profiler(parts: Any, name: str) -> StepProfiler | None:
    """The ``--profiler-config`` profiler of the steps ``parts`` runs (its traces named
    ``name``), or None when off."""
    spec = parts.config.profiler
    return StepProfiler(spec, name, parts.runner.device) if spec is not None else None


@dataclasses.dataclass(frozen=True, slots=True)
class CoreActors:
    """The actors of one engine core (in-process, or in a core process): the KV allocator,
    the executor, the scheduler and, where the engine reads a KV store, its actor. Each
    starts after those it sends to (:attr:`start_order`)."""

    allocator: KVAllocator
    executor: Executor
    scheduler: SchedulerActor
    kv_store: KVStoreActor | None

    @property
    def start_order(self) -> tuple[Any, ...]:
        before = (self.allocator, self.executor) + ((self.kv_store,) if self.kv_store else ())
        return (*before, self.scheduler)


def core_actors(parts: Any, *, inbox: Any, inbox_send: Any, to_detokenizer: Any,
                profiler_name: str, paused: tuple[bool, int] = (False, -1)) -> CoreActors:
    """Build a core's actors around the scheduler's ``inbox`` (``inbox_send``: its send
    side, cloned for the executor and the KV-store actor); ``paused``: the pause and sleep
    level they start in (an in-place restart's)."""
    config = parts.config
    call_send, call_recv = trio.open_memory_channel[Any](0)
    reply_send, reply_recv = trio.open_memory_channel[Any](0)
    plan_send, plan_recv = trio.open_memory_channel[Any](0)
    pool = BlockPool(parts.num_blocks, config.block_size,
                     enable_prefix_caching=config.enable_prefix_caching,
                     state_checkpoints=config.state_checkpoints or 0)
    profiler = step_profiler(parts, profiler_name)
    store = getattr(parts, "kv_store", None)
    kv_store, to_store = None, None
    if store is not None and store.loads:
        # math.inf: the scheduler never waits on a read; admission bounds the requests.
        to_store, store_recv = trio.open_memory_channel[Any](math.inf)
        kv_store = KVStoreActor(store, store_recv, inbox_send.clone())
    return CoreActors(
        KVAllocator(pool, call_recv, reply_send),
        Executor(parts.runner, plan_recv, inbox_send.clone(), profiler=profiler),
        scheduler_actor(parts, inbox=inbox, to_allocator=call_send, from_allocator=reply_recv,
                        to_executor=plan_send, to_detokenizer=to_detokenizer, profiler=profiler,
                        to_store=to_store, paused=paused),
        kv_store,
    )


def scheduler_actor(
    parts: Any, *, inbox: Any, to_allocator: Any, from_allocator: Any, to_executor: Any,
    to_detokenizer: Any, profiler: StepProfiler | None = None, to_store: Any = None,
    paused: tuple[bool, int] = (False, -1),
) -> SchedulerActor:
    """The scheduler actor for ``parts`` (:class:`EngineParts`, or an engine core process's
    parts), wired to the given channels. One place builds it for both, so a core in its
    own process schedules as the in-process engine does: a pooling model's requests end
    at their prompt, a model without paged KV is scheduled as such, and a pipeline keeps
    one batch a stage in flight."""
    config = parts.config
    return SchedulerActor(
        Scheduler(
            SchedulerConfig.from_engine_config(
                config, max_model_len=parts.limits.max_model_len, num_kv_blocks=parts.num_blocks,
                sliding_window=parts.runner.config.released_window,
                pooling=parts.pooler is not None, paged_kv=parts.runner.paged_kv,
                whole_images=getattr(parts.runner.config.vision, "bidirectional_images", False),
                whole_prompts=parts.runner.config.bidirectional or not config.enable_chunked_prefill,
            ),
            KVTier(parts.kv_store, config.block_size) if getattr(parts, "kv_store", None) else None,
        ),
        inbox=inbox,
        to_allocator=to_allocator,
        from_allocator=from_allocator,
        to_executor=to_executor,
        to_detokenizer=to_detokenizer,
        async_scheduling=bool(config.async_scheduling),
        release_grammar=parts.grammar.release if parts.grammar is not None else None,
        max_in_flight=getattr(parts.runner, "batches_in_flight", None),
        profiler=profiler,
        runner=parts.runner,
        to_store=to_store,
        paused=paused,
    )


async def run_actors(parts: EngineParts, *, ready: Callable[[ActorHandles], None],
                     paused: tuple[bool, int] = (False, -1)) -> None:
    """Open every channel, start every actor in dependency order, then call ``ready``.
    ``paused``: the pause and sleep level to start in (an in-place restart's).

    Returns when all actors have stopped; raises what they raise (an actor's crash cancels
    the others). Cancel the caller's scope to stop the engine.
    """
    config = parts.config
    # math.inf: this inbox closes two cycles (step results from the executor, stop-string
    # hits from the detokenizer) and takes requests and aborts from sync code in the
    # callers' tasks; its depth stays bounded by admission control (max_queued_requests)
    # plus the steps in flight.
    sched_send, sched_recv = trio.open_memory_channel[Any](math.inf)
    detok_send, detok_recv = trio.open_memory_channel[Any](0)
    router_send, router_recv = trio.open_memory_channel[Any](0)

    with sched_send:
        callers = sched_send.clone()
        core = core_actors(parts, inbox=sched_recv, inbox_send=sched_send, to_detokenizer=detok_send,
                           profiler_name="engine", paused=paused)
        allocator, executor, scheduler = core.allocator, core.executor, core.scheduler
        detokenizer = Detokenizer(
            parts.tokenizer, inbox=detok_recv, to_router=router_send,
            to_scheduler=sched_send.clone(), stream_interval=config.stream_interval,
        )

        def send(message: AdmittedRequest | AbortSamples) -> None:
            callers.send_nowait(message)
            if isinstance(message, AdmittedRequest):
                scheduler.arriving(message)

        def abort(sample_ids: tuple[str, ...]) -> None:
            if sample_ids:
                try:
                    send(AbortSamples(sample_ids))
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    pass  # the engine is stopping; every request fails with it anyway

        router = OutputRouter(router_recv, abort=abort)
        actors: dict[str, Any] = {
            "allocator": allocator, "executor": executor, "scheduler": scheduler,
            "detokenizer": detokenizer, "router": router,
        }
        if core.kv_store is not None:
            actors["kv_store"] = core.kv_store

        def statistics() -> EngineStatistics:
            sched = scheduler.statistics()
            kv = allocator.statistics()
            return EngineStatistics(
                running=sched.running, waiting=sched.waiting,
                kv_blocks_total=kv.num_blocks, kv_blocks_free=kv.num_free_blocks,
                prefix_cache_hits=kv.prefix_cache_hits, prefix_cache_queries=kv.prefix_cache_queries,
                preemptions=sched.preemptions, steps=sched.steps,
                requests_finished=sched.requests_finished,
                iteration_token_counts=sched.iteration_token_counts,
                iteration_tokens_sum=sched.iteration_tokens_sum,
                scheduled_tokens=sched.scheduled_tokens, planned_ahead=sched.planned_ahead,
                spec_drafts=sched.spec_drafts, spec_draft_tokens=sched.spec_draft_tokens,
                spec_accepted_tokens=sched.spec_accepted_tokens,
                spec_accepted_per_pos=sched.spec_accepted_per_pos,
                running_loras=sched.running_loras, waiting_loras=sched.waiting_loras,
                external_prefix_cache_queries=sched.external_prefix_cache_queries,
                external_prefix_cache_hits=sched.external_prefix_cache_hits,
            )

        with callers:
            async with trio.open_nursery() as nursery:
                # Dependency order: each actor starts after those it sends to.
                for name in ("allocator", "executor", "kv_store", "router", "detokenizer", "scheduler"):
                    if name in actors:
                        await nursery.start(actors[name].run)
                ready(ActorHandles(router, send, abort, scheduler.queue_depth, statistics, actors))


async def run_front_actors(
    parts: EngineParts, pool: Any, detok_recv: trio.MemoryReceiveChannel[Any], *,
    ready: Callable[[ActorHandles], None],
) -> None:
    """The front end's actors when the engine cores run in processes of their own: the
    detokenizer and router of :func:`run_actors`, and a dispatcher that hands requests,
    aborts and stop-string hits to ``pool`` (:class:`engine.process.cores.CorePool`), whose
    links feed ``detok_recv``. Returns when cancelled; raises what an actor raises."""
    # math.inf: as the scheduler's inbox in run_actors: sync senders (callers, aborts) and
    # the detokenizer's stop-string hits, bounded by admission control.
    front_send, front_recv = trio.open_memory_channel[Any](math.inf)
    router_send, router_recv = trio.open_memory_channel[Any](0)
    with front_send:
        callers = front_send.clone()
        detokenizer = Detokenizer(parts.tokenizer, inbox=detok_recv, to_router=router_send,
                                  to_scheduler=front_send.clone(),
                                  stream_interval=parts.config.stream_interval)

        def send(message: AdmittedRequest | AbortSamples) -> None:
            callers.send_nowait(message)
            if isinstance(message, AdmittedRequest):
                pool.arriving(message)

        def abort(sample_ids: tuple[str, ...]) -> None:
            if sample_ids:
                try:
                    send(AbortSamples(sample_ids))
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    pass

        router = OutputRouter(router_recv, abort=abort)

        def lost(sample_ids: tuple[str, ...], error: BaseException) -> None:
            abort(router.fail_samples(sample_ids, error))

        pool.on_lost = lost

        async def dispatch(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            with front_recv:
                task_status.started()
                async for message in front_recv:
                    await pool.dispatch(message)

        def statistics() -> EngineStatistics:
            cores = [s for _, s in pool.core_statistics() if s is not None]
            return combined_statistics(cores, waiting=pool.queue_depth(),
                                       idle_blocks=parts.num_blocks * pool.size)

        actors: dict[str, Any] = {"detokenizer": detokenizer, "router": router, "cores": pool}
        with callers:
            async with trio.open_nursery() as nursery:
                for start in (router.run, detokenizer.run, dispatch):
                    await nursery.start(start)
                ready(ActorHandles(router, send, abort, pool.queue_depth, statistics, actors))


def combined_statistics(cores: list[Any], *, waiting: int, idle_blocks: int) -> EngineStatistics:
    """One :class:`EngineStatistics` over engine cores' :class:`~engine.messages.CoreStatistics`
    (counters and gauges summed); ``waiting`` is the front end's count, samples on the wire
    included, and ``idle_blocks`` the pool size reported before any core ran a step."""
    return EngineStatistics(
        running=sum(s.running for s in cores), waiting=waiting,
        kv_blocks_total=sum(s.kv_blocks_total for s in cores) or idle_blocks,
        kv_blocks_free=sum(s.kv_blocks_free for s in cores) or idle_blocks,
        prefix_cache_hits=sum(s.prefix_cache_hits for s in cores),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in cores),
        preemptions=sum(s.preemptions for s in cores),
        steps=sum(s.steps for s in cores),
        requests_finished=sum(s.requests_finished for s in cores),
        iteration_token_counts=_sum_lists([s.iteration_token_counts for s in cores]),
        iteration_tokens_sum=sum(s.iteration_tokens_sum for s in cores),
        scheduled_tokens=sum(s.scheduled_tokens for s in cores),
        planned_ahead=sum(s.planned_ahead for s in cores),
        spec_drafts=sum(s.spec_drafts for s in cores),
        spec_draft_tokens=sum(s.spec_draft_tokens for s in cores),
        spec_accepted_tokens=sum(s.spec_accepted_tokens for s in cores),
        spec_accepted_per_pos=_sum_lists([s.spec_accepted_per_pos for s in cores]),
        running_loras=tuple(sorted({n for s in cores for n in s.running_loras})),
        waiting_loras=tuple(sorted({n for s in cores for n in s.waiting_loras})),
        external_prefix_cache_queries=sum(s.external_prefix_cache_queries for s in cores),
        external_prefix_cache_hits=sum(s.external_prefix_cache_hits for s in cores),
    )


# The cumulative fields of EngineStatistics and CoreStatistics (the others are gauges, and
# CoreStatistics.samples_received counts one connection's frames, for admission control).
COUNTER_FIELDS = (
    "prefix_cache_hits", "prefix_cache_queries", "preemptions", "steps", "requests_finished",
    "iteration_token_counts", "iteration_tokens_sum", "scheduled_tokens", "planned_ahead",
    "spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", "spec_accepted_per_pos",
    "external_prefix_cache_queries", "external_prefix_cache_hits",
)


def carry_counters(base: Any, current: Any) -> Any:
    """``current`` (an :class:`EngineStatistics` or a core's
    :class:`~engine.messages.CoreStatistics`) with the counters of ``base`` added: what a
    restarted core, or an engine's actors before an in-place restart, had counted. Counters
    start again from zero in a fresh scheduler and KV pool; adding what the gone ones
    counted keeps every counter of the engine monotonic, as Prometheus expects of a
    counter. ``base`` None: ``current`` as it is."""
    if base is None:
        return current
    changes: dict[str, Any] = {}
    for name in COUNTER_FIELDS:
        before, now = getattr(base, name), getattr(current, name)
        changes[name] = _sum_lists([before, now]) if isinstance(now, tuple) else before + now
    return dataclasses.replace(current, **changes)


def _sum_lists(lists: list[tuple[int, ...]]) -> tuple[int, ...]:
    width = max((len(x) for x in lists), default=0)
    return tuple(sum(x[i] for x in lists if i < len(x)) for i in range(width))
