"""Opening an engine: :func:`open_engine` builds the config, loads the parts (in-process)
or starts the front end over engine-core processes, runs the actors in the caller's
nursery and restarts them in place within ``max_engine_restarts``."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from engine.actors.model_thread import release_openmp_team, run_in_model_thread
from engine.actors.parts import EngineParts
from engine.actors.system import (
    ActorHandles,
    run_front_actors,
)
from engine.api.engine import Engine
from engine.config import EngineConfig, parse_address
from engine.errors import ConfigError, EngineDeadError
from engine.process.core import resolve_engine_core
from engine.process.cores import CorePool
from engine.process.names import resolve_config
from engine.process.parts import build_front_parts, build_parts


async def _start_front_end(nursery: trio.Nursery, config: EngineConfig,
                           core_secret: bytes | None, hf_token: str | None = None) -> Engine:
    """Start the engine cores (processes of their own), then the front end's actors."""
    listen = None
    if config.data_parallel_address is not None:
        if not core_secret:
            raise ConfigError("cores on other machines need a shared secret "
                              "($ENGINE_DP_SECRET or --data-parallel-secret-file)",
                              field="data_parallel_address")
        listen = parse_address(config.data_parallel_address)
    # Buffer 0: each core's reader hands the detokenizer a step's outputs and waits for it.
    detok_send, detok_recv = trio.open_memory_channel[Any](0)
    pool = CorePool(config, to_detokenizer=detok_send,
                    data_parallel_size=config.data_parallel_size,
                    routing=config.data_parallel_routing, listen_tcp=listen,
                    local_cores=config.data_parallel_size_local, secret=core_secret)
    hello = await nursery.start(pool.run)
    parts = await trio.to_thread.run_sync(build_front_parts, config, hello)
    engine = Engine(parts)
    engine.loras.hub_token = hf_token  # for adapters by Hub id
    await engine.loras.open()
    engine._pool = pool

    def allow_restart() -> bool:
        if engine.dead or engine.restarts >= engine.config.max_engine_restarts:
            return False
        engine.restarts += 1
        return True

    def on_state(serving: int) -> None:
        if engine.dead:
            return
        engine.restarting = serving == 0
        if serving == 0 and not any(c.state.value in ("starting", "restarting")
                                    for c in pool._cores):
            engine._die(EngineDeadError("every engine core is down"))

    pool.allow_restart = allow_restart
    pool.on_state = on_state

    async def run_front(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        def ready(handles: ActorHandles) -> None:
            engine._handles = handles
            task_status.started()

        try:
            await run_front_actors(parts, pool, detok_recv, ready=ready)
        finally:
            pool.stopping()

    await nursery.start(run_front)
    return engine


def _config(model: str | None, config: EngineConfig | None, options: dict[str, Any]) -> EngineConfig:
    if config is not None:
        if options:
            config = dataclasses.replace(config, **options)
        if model is not None:
            config = dataclasses.replace(config, model=model)
        return config
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise ConfigError(f"unknown engine option(s): {', '.join(unknown)}", field=unknown[0])
    return EngineConfig(model=model, **options)


@asynccontextmanager
async def open_engine(
    model: str | Path | None = None, *, config: EngineConfig | None = None,
    core_secret: bytes | None = None, hf_token: str | None = None, **options: Any
) -> AsyncIterator[Engine]:
    """Load a model, start the engine's actors, and yield the :class:`Engine`.

    ``model`` is a Hugging Face folder, a ``.gguf`` file or a Hugging Face Hub id
    (``ORG/NAME``, ``ORG/NAME-GGUF:Q4_K_M``: fetched into the Hugging Face cache first, see
    :mod:`engine.models.hub`; ``hf_token`` for a gated repo, else ``HF_TOKEN``) (None: the
    default SmolLM2);
    ``options`` are :class:`EngineConfig` fields (``dtype="float32"``, ``max_num_seqs=8``,
    ``kv_cache_memory=...``). Loading runs in a worker thread. Leaving the block stops every
    actor; streams still open then raise ``EngineDeadError("engine closed")``.

    With ``engine_core="auto"`` (serve's default) the engine core runs in a process of its
    own where a model step leaves a CPU free, else here
    (:func:`engine.process.core.resolve_engine_core`).
    With ``engine_core="process"`` or ``data_parallel_size > 1`` the scheduler, KV pool
    and executor run in engine-core processes this block owns (see
    :mod:`engine.process.cores`); ``core_secret`` is the shared secret that cores started on
    other machines (``data_parallel_address``) must prove they know.
    """
    # An idle OpenMP team of the caller's thread would slow every step of the model's
    # (engine.actors.model_thread); it starts again when the caller next runs torch.
    release_openmp_team()
    resolved = resolve_engine_core(
        _config(str(model) if model is not None else None, config, options))
    # Hub ids become local paths here, before any process or thread loads them.
    resolved = await trio.to_thread.run_sync(
        functools.partial(resolve_config, resolved, token=hf_token))
    parts: EngineParts | None = None
    engine: Engine | None = None
    try:
        async with trio.open_nursery() as nursery:
            if resolved.core_in_process:
                parts = await run_in_model_thread(build_parts, resolved)
                engine = Engine(parts)
                engine.loras.hub_token = hf_token  # for adapters by Hub id
                await engine.loras.open()
                await nursery.start(engine._run)
            else:
                engine = await _start_front_end(nursery, resolved, core_secret, hf_token)
            try:
                yield engine
            finally:
                engine._die(EngineDeadError("engine closed"))
                nursery.cancel_scope.cancel()
                if engine._compiles is not None:
                    await engine._compiles.aclose()  # kills compiles still running
    except BaseExceptionGroup as group:
        # The actors never raise into this nursery (a crash marks the engine dead), so a
        # group of one holds what the caller's own block raised (or a startup failure):
        # give it back unwrapped, as if no nursery were there.
        if len(group.exceptions) == 1:
            only = group.exceptions[0]
            raise only from only.__cause__
        raise
    finally:
        # The actors have stopped (no step runs): stop what the runner started (the
        # tensor-parallel workers).
        close = getattr(parts.runner, "close", None) if parts is not None else None
        if close is not None:
            with trio.CancelScope(shield=True):
                await run_in_model_thread(close)
        if parts is not None:
            # The model thread stays for the process's next engine; its team would slow
            # the caller's own torch work till then.
            with trio.CancelScope(shield=True):
                await run_in_model_thread(release_openmp_team)
            # The model and its KV pool go now, not when the caller lets go of the engine
            # (``with LLM(a) as llm`` then ``with LLM(b) as llm`` held both at once).
            parts.runner = None
        if engine is not None and engine.tracer is not None:
            # The spans still batched go out (a start that failed after the engine was
            # built stops the exporter's thread too).
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(engine.tracer.close)
