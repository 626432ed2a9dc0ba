"""A tensor-parallel worker rank's side: the process (``python -m
engine.process.worker_rank``) or Ray actor (:class:`RayRank`) that loads the model, joins the
process group, builds its runner's slice and then runs each :class:`~engine.messages.RankStep`
rank 0 sends; and the helpers both sides share (devices, CPU threads, the framed
connection). Rank 0's side is :mod:`engine.process.workers`."""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import multiprocessing.connection as mpc
import os
import sys
import time
from typing import Any

import torch

from engine import messages
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.messages import (
    RankBuild,
    RankBuilt,
    RankDone,
    RankError,
    RankReset,
    RankSleep,
    RankStep,
    RankWarmUp,
    StageResult,
)
from engine.parallel import TensorParallel, pipeline_ranks, place_rank
from engine.process.grammars import WorkerGrammars
from engine.process.rank import build_rank_runner, load_rank
from engine.process.spawn import exit_with_parent
from engine.process.wire import decode_frame

logger = logging.getLogger("engine")

# Loading the model and joining the process group, per worker.
START_TIMEOUT_SECONDS = 600.0


# A worker process's arguments (JSON), the shared secret among them.
WORKER_ARGS_ENV = "ENGINE_TP_WORKER"


def dist_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device on this machine: ``cuda:(i + rank)`` from rank 0's
    ``cuda:i``; the CPU for every rank on CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def share_cpu_threads(device: torch.device, world_size: int) -> int:
    """On CPU the ranks share the machine's cores: each takes an equal share of threads.
    Returns the torch thread count before."""
    before = torch.get_num_threads()
    if device.type == "cpu" and world_size > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
    return before


def _send(conn: Any, message: object) -> None:
    conn.send_bytes(messages.pack((message,)))


def _receive(conn: Any) -> object:
    (message,) = decode_frame(conn.recv_bytes())
    return message


def main() -> None:
    """``python -m engine.process.worker_rank``: a worker rank, its arguments in
    ``$ENGINE_TP_WORKER`` (set by :class:`WorkerGroup`)."""
    args = json.loads(os.environ.pop(WORKER_ARGS_ENV))
    worker_main(rank=args["rank"], world_size=args["world_size"],
                address=tuple(args["address"]), authkey=bytes.fromhex(args["authkey"]),
                store=tuple(args["store"]), config_json=args["config_json"],
                timeout=args["timeout"], parent_pid=args["parent_pid"])


def worker_main(*, rank: int, world_size: int, address: tuple[str, int], authkey: bytes,
                store: tuple[str, int], config_json: str, timeout: float,
                parent_pid: int) -> None:
    """A worker rank: load the model, connect to rank 0, join the process group, build the
    runner, then run every step rank 0 sends until its connection closes."""
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING,
                        format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s")
    if parent_pid:
        exit_with_parent(parent_pid)
    try:
        _serve_rank(rank, world_size, address, authkey, store, config_json, timeout)
    finally:
        logging.shutdown()
        sys.stderr.flush()
    # Skip the interpreter's teardown (torch's objects take seconds to finalize).
    os._exit(0)


def _serve_rank(rank: int, world_size: int, address: tuple[str, int], authkey: bytes,
                store: tuple[str, int], config_json: str, timeout: float,
                device_index: int | None = None) -> None:
    import torch.distributed as dist

    config = EngineConfig.from_json(config_json)
    conn: Any = None
    try:
        device = rank_device(torch.device(_resolve_device(config.device)), rank)
        if device.type == "cuda" and device_index is not None:
            device = torch.device("cuda", device_index)
        share_cpu_threads(device, world_size)
        loaded = load_rank(config, device)
        conn = mpc.Client(address, authkey=authkey)
        _send(conn, RankBuilt(rank, os.getpid()))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        tcp_store = dist.TCPStore(store[0], store[1], world_size, is_master=False,
                                  timeout=datetime.timedelta(seconds=START_TIMEOUT_SECONDS))
        dist.init_process_group(dist_backend(device), store=tcp_store, rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        place = rank_place(config, rank, loaded.loaded.config.num_hidden_layers)
        build = _receive(conn)
        if not isinstance(build, RankBuild):
            raise EngineError(f"expected RankBuild, got {type(build).__name__}")
        runner = build_rank_runner(EngineConfig.from_json(build.config_json), loaded, device,
                                   build.num_blocks, place)
        grammars = WorkerGrammars(loaded.grammar)  # sent by rank 0, never compiled here
        _send(conn, RankBuilt(rank, os.getpid()))
    except Exception as exc:
        logger.exception("tensor-parallel worker rank %d failed to start", rank)
        if conn is None:
            try:
                conn = mpc.Client(address, authkey=authkey)
            except OSError:
                return
        try:
            _send(conn, RankError(rank, f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        return
    while True:
        try:
            message = _receive(conn)
        except (EOFError, OSError):
            return  # rank 0 closed the connection (or is gone): stop
        if isinstance(message, RankStep):
            if not place.stage.last:
                for earlier in message.results:  # the last stage's tokens, for the next chunks
                    runner.accept([(t.sample_id, t.token_id) for t in earlier.sampled],
                                  [f.sample_id for f in earlier.failed])
            grammars.before_step(message.plan, message.grammars)
            times = place.stage.times
            start, recv, send = time.time(), times.recv_seconds, times.send_seconds
            result = runner.execute(message.plan)
            trace = (start, time.time(), times.recv_seconds - recv, times.send_seconds - send)
            answer: object = RankDone(
                result.step_id, tuple((t.sample_id, t.token_id) for t in result.sampled),
                tuple(f.sample_id for f in result.failed), trace)
            if place.stage.enabled and place.stage.last and place.rank == 0:
                answer = StageResult(result, trace)
        elif isinstance(message, RankWarmUp):
            try:
                runner.warm_up()
                answer = RankDone(-1, (), ())
            except Exception as exc:
                answer = RankError(rank, f"warm-up failed: {exc}")
        elif isinstance(message, RankSleep):
            try:
                if message.reload:
                    runner.reload_weights()
                elif message.level >= 0:
                    runner.sleep(message.level)
                else:
                    runner.wake_up(message.tags)
                answer = RankDone(-1, (), ())
            except Exception as exc:
                logger.exception("tensor-parallel worker rank %d: sleep mode failed", rank)
                answer = RankError(rank, f"sleep mode failed: {exc}")
        elif isinstance(message, RankReset):
            runner.reset()
            place.stage.drop_sent()
            grammars.reset()
            answer = RankDone(-1, (), ())
        else:
            answer = RankError(rank, f"unexpected message {type(message).__name__}")
        try:
            _send(conn, answer)
        except OSError:
            return


def rank_place(config: EngineConfig, rank: int, num_layers: int) -> TensorParallel:
    """Global rank ``rank``'s place: its tensor-parallel slice and, with pipeline
    parallelism, its stage. Called by every rank (rank 0 included) once the default process
    group is up: each makes every stage's tensor-parallel group, in the same order, as
    ``torch.distributed.new_group`` asks of all ranks alike."""
    import torch.distributed as dist

    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    ep = config.enable_expert_parallel
    if pp == 1:
        # the default group is the tensor-parallel group
        return TensorParallel(rank, tp, expert_parallel=ep)
    groups = [dist.new_group(ranks) for ranks in pipeline_ranks(tp, pp)] if tp > 1 else None
    group = groups[rank // tp] if groups is not None else None
    place = place_rank(rank, tp, pp, num_layers, config.pipeline_layer_partition, group)
    return dataclasses.replace(place, expert_parallel=ep)


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class RayRank:
    """A worker rank as a Ray actor: its one long call runs :func:`worker_main`'s loop
    (the steps come over the connection, not as Ray calls)."""

    def run(self, **kwargs: Any) -> None:
        kwargs["parent_pid"] = 0
        logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
        # Ray shows the actor only its own GPU (CUDA_VISIBLE_DEVICES): cuda:0.
        _serve_rank(kwargs["rank"], kwargs["world_size"], kwargs["address"],
                            kwargs["authkey"], kwargs["store"], kwargs["config_json"],
                            kwargs["timeout"], device_index=0)


if __name__ == "__main__":
    main()
