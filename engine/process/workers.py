"""The processes of tensor parallelism: ranks 1..N-1 as worker processes or Ray actors.

Rank 0 lives where the model runner lives with one rank (the executor's worker thread, in
the engine's process or its engine-core process). :class:`WorkerGroup` starts the other
ranks and :class:`TensorParallelRunner` drives them: it stands in for the rank-0
:class:`~engine.runner.model_runner.ModelRunner`, so the executor, the scheduler and the
engine's restart logic see one runner::

    rank 0 (executor thread)                       rank r (worker process / Ray actor)
      |-- RankStep(plan): one msgpack frame -------> |
      |   runner.execute(plan)   <== all-reduce ==>  |   runner.execute(plan)
      | <------------------ RankDone(sampled, failed) |
      |   check: the same tokens and failures, else fail the engine (restart)

Every rank runs the same plan on its slice of the model and samples the same gathered
logits with the same seeds, so every rank's request state (tokens, grammar matchers,
penalties' counts) stays the same without sending tokens back; each step's answer lets
rank 0 check that they did. Only rank 0's :class:`~engine.messages.StepResult` goes to the
scheduler.

The wire is an authenticated :mod:`multiprocessing.connection` over TCP (loopback for
``mp``, the node address Ray reports for ``ray``), carrying :mod:`engine.process.wire` frames
(msgpack of :mod:`engine.messages` types, nothing else decoded). torch.distributed is
initialised from a TCP store that rank 0 opens on a free port: gloo on CPU, NCCL on CUDA,
with a timeout on every collective (:data:`COLLECTIVE_TIMEOUT_SECONDS`), so a stuck peer
fails the step instead of hanging the engine.

Faults: a worker that dies (its process sentinel, a closed connection, or no answer within
the collective timeout) raises :class:`WorkerLostError` out of :meth:`execute`; the
executor crashes with it, the engine fails the requests in flight with its message and
restarts its actors within ``--max-engine-restarts``, and :meth:`reset` then replaces the
whole worker group (the rank-0 process group too). Workers exit when rank 0's connection
closes or, for ``mp``, when their parent process is gone.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import multiprocessing.connection as mpc
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engine import messages
from engine.errors import ConfigError, EngineError
from engine.messages import (
    RankBuild,
    RankBuilt,
    RankDone,
    RankError,
    RankGrammar,
    RankReset,
    RankSleep,
    RankStep,
    RankWarmUp,
    StageResult,
    StepPlan,
    StepResult,
)
from engine.process.grammars import GrammarMirror
from engine.process.runtime import forget_own_ray_sessions, ray_temp_dir
from engine.process.worker_rank import (
    START_TIMEOUT_SECONDS,
    WORKER_ARGS_ENV,
    RayRank,
    _receive,
    dist_backend,
    rank_place,
    share_cpu_threads,
)

logger = logging.getLogger("engine")

# How long a collective (and rank 0's wait for a worker's answer to a step) may take before
# the step fails: long enough for a worker's first compile of a structured-output grammar
# (bounded at admission by --grammar-compile-timeout), short enough that a stopped peer
# does not hang the engine for long.
COLLECTIVE_TIMEOUT_SECONDS = 60.0
# A local Ray started by the engine: a small object store (the workers pass nothing
# through it; the steps go over the connection).
RAY_OBJECT_STORE_BYTES = 100 * 2**20


class WorkerLostError(EngineError):
    """A tensor-parallel worker died, stopped answering, or disagreed with rank 0; the
    engine fails the requests in flight with this message and restarts the group."""


# --- rank 0's side -------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class _Peer:
    rank: int
    handle: Any  # subprocess.Popen, or a Ray actor handle
    sentinel: int | None  # a pidfd of the process (mp): readable once it exits; None for Ray
    conn: Any = None  # multiprocessing.connection.Connection once it connected
    pid: int = 0
    run_ref: Any = None  # Ray: the ObjectRef of the actor's run() call
    stuck: bool = False  # it did not answer a step in time: killed, not waited for


@dataclasses.dataclass(slots=True)
class GroupStatistics:
    steps: int = 0
    broadcast_seconds: float = 0.0  # packing and writing the step to every worker
    broadcast_bytes: int = 0  # one worker's share: the frames' bytes
    wait_seconds: float = 0.0  # after rank 0's step, waiting for the workers' answers


class WorkerGroup:
    """Ranks 1..N-1 of a tensor-parallel group, started at construction; rank 0 is the
    calling process. Call :meth:`init_rank0` once rank 0 has loaded its model (the
    workers load theirs meanwhile), then :meth:`build` with the pool size (or
    :meth:`start_build`, rank 0's own build, :meth:`wait_built`: the ranks read their
    slices of the checkpoint at once)."""

    def __init__(self, config: Any, device: torch.device, *,
                 timeout: float | None = None) -> None:
        self.tp_size = int(config.tensor_parallel_size)
        self.pp_size = int(getattr(config, "pipeline_parallel_size", 1))
        self.world_size = self.tp_size * self.pp_size
        self.backend = config.distributed_executor_backend
        self.device = device
        self.timeout = timeout if timeout is not None else COLLECTIVE_TIMEOUT_SECONDS
        self._config_json = config.to_json()
        self._config = config
        self._num_layers = 0  # the model's layers, for rank 0's pipeline stage (init_rank0)
        self.place: Any = None  # rank 0's TensorParallel (with its stage), from init_rank0
        self._build: RankBuild | None = None
        self._peers: list[_Peer] = []
        self._store: Any = None
        self._server: socket.socket | None = None
        self._authkey = b""
        self._ray_started = False
        self._ray_dir: Path | None = None  # a local Ray's temp dir, in the runtime folder
        self._runtime_dir = getattr(config, "runtime_dir", None)
        self._placement: Any = None
        # Whether this group made the placement group (and removes it), or runs in its
        # core's (a data-parallel core placed by engine.process.ray_cores: bundle 0 is
        # the core, 1..N-1 its workers), which the front end removes.
        self._owns_placement = True
        self.broken = False
        self.stats = GroupStatistics()
        # Rank 0's share of the CPU threads while the group lives (restored by close()).
        self._threads_before = share_cpu_threads(device, self.world_size)
        try:
            self._start()
        except BaseException:
            self.close()  # the workers already started, a local Ray, the threads
            raise

    # -- starting ----------------------------------------------------------------------

    def _start(self) -> None:
        import torch.distributed as dist

        self.broken = False
        host = self._ray_host() if self.backend == "ray" else "127.0.0.1"
        self._authkey = os.urandom(32)
        self._server = socket.create_server((host, 0), backlog=self.world_size)
        address = (host, self._server.getsockname()[1])
        self._store = dist.TCPStore(host, 0, self.world_size, is_master=True,
                                    wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=START_TIMEOUT_SECONDS))
        store = (host, self._store.port)
        common = dict(world_size=self.world_size, address=address, authkey=self._authkey,
                      store=store, config_json=self._config_json, timeout=self.timeout)
        if self.backend == "ray":
            self._start_ray(common)
        else:
            for rank in range(1, self.world_size):
                # A fresh interpreter (not multiprocessing's spawn, which would re-run the
                # caller's __main__); the secret travels in its environment, not its argv.
                args = {**common, "rank": rank, "parent_pid": os.getpid(),
                        "authkey": self._authkey.hex(), "address": list(address),
                        "store": list(store)}
                process = subprocess.Popen(
                    [sys.executable, "-m", "engine.process.worker_rank"],
                    env={**os.environ, WORKER_ARGS_ENV: json.dumps(args)},
                    stdin=subprocess.DEVNULL)
                self._peers.append(_Peer(rank, process, os.pidfd_open(process.pid),
                                         pid=process.pid))
        logger.info("tensor parallel: %d ranks (%s backend, %s), workers %s", self.world_size,
                    self.backend, dist_backend(self.device),
                    ", ".join(f"rank {p.rank}" + (f" pid {p.pid}" if p.pid else "") for p in self._peers))

    def _ray_host(self) -> str:
        try:
            import ray
        except ImportError:
            raise ConfigError("--distributed-executor-backend ray needs Ray: install the "
                              "package's [ray] extra (pip install -e '.[ray]')",
                              field="distributed_executor_backend") from None

        if not ray.is_initialized():
            if os.environ.get("RAY_ADDRESS"):
                ray.init(log_to_driver=False)  # the cluster at $RAY_ADDRESS
            else:
                # A local Ray of our own, stopped in close(): loopback only, no dashboard,
                # a small object store, a CPU per worker rank; its session (sockets, logs)
                # in the engine's runtime folder rather than /tmp/ray, so that the next
                # start removes what a killed server's Ray left.
                self._ray_dir = ray_temp_dir(self._runtime_dir)
                ray.init(num_cpus=max(1, self.world_size - 1), include_dashboard=False,
                         object_store_memory=RAY_OBJECT_STORE_BYTES, log_to_driver=False,
                         _node_ip_address="127.0.0.1", _temp_dir=str(self._ray_dir))
                self._ray_started = True
        return ray.util.get_node_ip_address()

    def _start_ray(self, common: dict[str, Any]) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpu = self.device.type == "cuda"
        bundle = {"CPU": 1.0, "GPU": 1.0} if gpu else {"CPU": 1.0}
        current = ray.util.get_current_placement_group()
        if current is not None and len(current.bundle_specs) == self.world_size:
            # A data-parallel core's actor: its placement group holds a bundle for each
            # of its ranks, this one (rank 0) in bundle 0.
            self._placement, self._owns_placement, first = current, False, 1
        else:
            # One bundle per worker rank (rank 0 is this process, outside the group),
            # packed onto as few nodes as hold them.
            self._placement = placement_group(
                [dict(bundle) for _ in range(1, self.world_size)], strategy="PACK")
            self._owns_placement, first = True, 0
        ready, _ = ray.wait([self._placement.ready()], timeout=START_TIMEOUT_SECONDS)
        if not ready:
            raise WorkerLostError(f"Ray could not place {self.world_size - 1} tensor-parallel "
                                  f"workers ({bundle} each) within {START_TIMEOUT_SECONDS:.0f} s")
        actor_class = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0)(RayRank)
        for rank in range(1, self.world_size):
            actor = actor_class.options(
                name=None, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._placement, placement_group_bundle_index=rank - 1 + first),
            ).remote()
            ref = actor.run.remote(**{**common, "rank": rank, "parent_pid": 0})
            self._peers.append(_Peer(rank, actor, None, run_ref=ref))

    def name(self, rank: int) -> str:
        """How the messages name global rank ``rank``: its pipeline stage, if any."""
        if self.pp_size == 1:
            return f"tensor-parallel worker rank {rank}"
        stage, tp_rank = divmod(rank, self.tp_size)
        inside = f", tensor-parallel rank {tp_rank}" if self.tp_size > 1 else ""
        return f"pipeline stage {stage} (rank {rank}{inside})"

    def _dead(self, peer: _Peer) -> str | None:
        """Why ``peer`` is gone, or None while it lives."""
        if peer.sentinel is not None:
            code = peer.handle.poll()
            if code is None:
                return None
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
            return f"{self.name(peer.rank)} (pid {peer.pid}) died ({how})"
        import ray

        done, _ = ray.wait([peer.run_ref], timeout=0)
        if not done:
            return None
        try:
            ray.get(done[0])
            why = "returned"
        except Exception as exc:  # the actor died, or its run() raised
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return f"{self.name(peer.rank)} (Ray actor) stopped ({why})"

    def init_rank0(self, num_layers: int = 0) -> None:
        """Take every worker's connection, then join the process group as rank 0 (blocks
        until every worker joins; a worker that dies first raises). ``num_layers``: the
        model's, to place rank 0's pipeline stage (:attr:`place`)."""
        import torch.distributed as dist

        self._num_layers = num_layers or self._num_layers

        assert self._server is not None
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        self._server.settimeout(0.5)
        waiting = {p.rank: p for p in self._peers}
        while waiting:
            for peer in waiting.values():
                why = self._dead(peer)
                if why:
                    raise WorkerLostError(f"{why} while starting")
            if time.monotonic() > deadline:
                raise WorkerLostError(f"tensor-parallel workers {sorted(waiting)} did not start "
                                      f"within {START_TIMEOUT_SECONDS:.0f} s")
            try:
                sock, _ = self._server.accept()
            except TimeoutError:
                continue
            sock.setblocking(True)  # the Connection reads its fd with os.read
            conn = mpc.Connection(sock.detach())
            try:
                mpc.deliver_challenge(conn, self._authkey)
                mpc.answer_challenge(conn, self._authkey)
                hello = _receive(conn)
            except (mpc.AuthenticationError, OSError, EOFError, ValueError):
                conn.close()
                continue  # not one of ours
            if isinstance(hello, RankError):
                raise WorkerLostError(f"{self.name(hello.rank)} failed to start: {hello.message}")
            if not isinstance(hello, RankBuilt) or hello.rank not in waiting:
                conn.close()
                continue
            peer = waiting.pop(hello.rank)
            peer.conn, peer.pid = conn, hello.pid
        self._server.close()
        self._server = None
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(dist_backend(self.device), store=self._store, rank=0,
                                world_size=self.world_size,
                                timeout=datetime.timedelta(seconds=self.timeout))
        # Rank 0's place (its stage's groups made as every worker makes them).
        place = rank_place(self._config, 0, self._num_layers)
        if self.place is None:
            self.place = place
        else:
            # A restarted group: rank 0's model was built on the first place and holds it
            # (frozen, shared by every layer); its stage's new process group replaces the
            # old one there (the default group's ranks keep their numbers).
            object.__setattr__(self.place, "group", place.group)

    def build(self, config_json: str, num_blocks: int) -> None:
        """Every worker builds its runner with rank 0's resolved config and pool size."""
        self.start_build(config_json, num_blocks)
        self.wait_built()

    def start_build(self, config_json: str, num_blocks: int) -> None:
        """:meth:`build`'s first half: the workers start building (each reads its slices
        of the checkpoint), while rank 0 builds its own runner; then :meth:`wait_built`."""
        self._build = RankBuild(config_json, num_blocks)
        self._broadcast(self._build)

    def wait_built(self) -> None:
        """Wait for every worker's runner (a worker that fails or dies raises)."""
        self._answers(RankBuilt, deadline=time.monotonic() + START_TIMEOUT_SECONDS)

    # -- steps ---------------------------------------------------------------------------

    def _broadcast(self, message: object) -> int:
        """Write ``message`` to every worker; returns its frame's size."""
        payload = messages.pack((message,))
        for peer in self._peers:
            try:
                peer.conn.send_bytes(payload)
            except OSError:
                self.broken = True
                raise WorkerLostError(self._dead(peer) or f"{self.name(peer.rank)} closed its "
                                      "connection") from None
        return len(payload)

    def _answers(self, kind: type | tuple[type, ...], *, deadline: float,
                 patience: float = 0.0) -> list[Any]:
        """Each worker's answer (of type ``kind``), in rank order; ``patience``: the wait
        a worker that did not answer is said to have had (the collective timeout if 0)."""
        out = []
        for peer in self._peers:
            waitables = [peer.conn] + ([peer.sentinel] if peer.sentinel is not None else [])
            ready = mpc.wait(waitables, timeout=max(0.0, deadline - time.monotonic()))
            answer: object = None
            if peer.conn in ready:
                try:
                    answer = _receive(peer.conn)
                except (EOFError, OSError):
                    answer = None
            if answer is None:
                self.broken = True
                if not ready:
                    peer.stuck = True
                    raise WorkerLostError(f"{self.name(peer.rank)} did not answer within "
                                          f"{patience or self.timeout:.0f} s")
                time.sleep(0.05)  # let the process's exit status settle
                raise WorkerLostError(self._dead(peer) or f"{self.name(peer.rank)} closed its "
                                      "connection")
            if isinstance(answer, RankError):
                self.broken = True
                raise WorkerLostError(f"{self.name(answer.rank)}: {answer.message}")
            if not isinstance(answer, kind):
                self.broken = True
                raise WorkerLostError(f"{self.name(peer.rank)} answered "
                                      f"{type(answer).__name__}, not the step's answer")
            out.append(answer)
        return out

    def send_step(self, plan: StepPlan, grammars: tuple[RankGrammar, ...] = (),
                  results: tuple[StepResult, ...] = ()) -> None:
        t0 = time.perf_counter()
        self.stats.broadcast_bytes += self._broadcast(RankStep(plan, grammars, results))
        self.stats.broadcast_seconds += time.perf_counter() - t0

    def collect_step(self, step_id: int) -> tuple[StepResult, list[tuple[float, ...]]]:
        """Pipeline parallelism: every worker's answer to step ``step_id`` (the workers
        answer their steps in order); returns the last stage's result, checked against its
        tensor-parallel peers', and each worker's trace (rank order)."""
        t0 = time.perf_counter()
        # A step in flight waits behind at most pipeline_parallel_size - 1 others; each
        # stage's part of one is bounded by the collective timeout.
        patience = self.pp_size * self.timeout + min(5.0, self.timeout)
        answers = self._answers((RankDone, StageResult), deadline=time.monotonic() + patience,
                                patience=patience)
        self.stats.wait_seconds += time.perf_counter() - t0
        self.stats.steps += 1
        last = (self.pp_size - 1) * self.tp_size
        final = next(a.result for p, a in zip(self._peers, answers, strict=True) if p.rank == last
                     and isinstance(a, StageResult))
        sampled = tuple((t.sample_id, t.token_id) for t in final.sampled)
        failed = tuple(f.sample_id for f in final.failed)
        for peer, answer in zip(self._peers, answers, strict=True):
            got = answer.result.step_id if isinstance(answer, StageResult) else answer.step_id
            if got != step_id:
                self.broken = True
                raise WorkerLostError(f"{self.name(peer.rank)} answered step {got}, expected {step_id}")
            if peer.rank > last and (answer.sampled != sampled or answer.failed != failed):
                self.broken = True
                raise WorkerLostError(
                    f"{self.name(peer.rank)} diverged from its stage's rank 0 at step {step_id}")
        return final, [a.trace for a in answers]

    def check_step(self, result: StepResult) -> None:
        """Wait for every worker's answer to the step and check it against rank 0's."""
        t0 = time.perf_counter()
        # The workers ran the same collectives: they answer within the collective timeout
        # of rank 0's end of the step, or they are stuck.
        answers = self._answers(RankDone, deadline=time.monotonic() + self.timeout
                                + min(5.0, self.timeout))
        self.stats.wait_seconds += time.perf_counter() - t0
        self.stats.steps += 1
        sampled = tuple((t.sample_id, t.token_id) for t in result.sampled)
        failed = tuple(f.sample_id for f in result.failed)
        for peer, answer in zip(self._peers, answers, strict=True):
            if answer.sampled != sampled or answer.failed != failed:
                self.broken = True
                raise WorkerLostError(
                    f"{self.name(peer.rank)} diverged from rank 0 at step "
                    f"{result.step_id}: sampled {answer.sampled[:4]} failed {answer.failed[:4]}, "
                    f"rank 0 sampled {sampled[:4]} failed {failed[:4]}")

    def command(self, message: RankWarmUp | RankReset | RankSleep) -> None:
        """Send a warm-up, reset or sleep-mode change; :meth:`finish_command` collects the
        answers."""
        self._broadcast(message)

    def finish_command(self) -> None:
        self._answers(RankDone, deadline=time.monotonic() + START_TIMEOUT_SECONDS)

    def first_death(self) -> str | None:
        """Why the first dead worker is gone (None while all live)."""
        for peer in self._peers:
            why = self._dead(peer)
            if why is not None:
                return why
        return None

    def alive(self) -> bool:
        return not self.broken and self.first_death() is None

    def pids(self) -> list[int]:
        """The worker processes' ids (rank order)."""
        return [p.pid for p in self._peers]

    # -- stopping ----------------------------------------------------------------------------

    def _stop_workers(self) -> None:
        import torch.distributed as dist

        for peer in self._peers:
            if peer.conn is not None:
                peer.conn.close()  # a worker waiting for a step sees EOF and exits
        if self.backend == "ray" and (self._peers or self._placement is not None):
            import ray

            for peer in self._peers:
                try:
                    ray.kill(peer.handle, no_restart=True)
                except Exception:  # already gone
                    pass
            if self._placement is not None and self._owns_placement:
                from ray.util.placement_group import remove_placement_group

                try:
                    remove_placement_group(self._placement)
                except Exception:
                    pass
                self._placement = None
        elif self.backend != "ray":
            for peer in self._peers:
                if peer.stuck:
                    peer.handle.kill()
            deadline = time.monotonic() + 5.0
            for peer in self._peers:
                try:
                    peer.handle.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    peer.handle.kill()  # stuck in a collective: it holds nothing to save
                    peer.handle.wait(5.0)
                if peer.sentinel is not None:
                    os.close(peer.sentinel)
        self._peers = []
        if self._server is not None:
            self._server.close()
            self._server = None
        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None

    def restart(self) -> None:
        """Replace every worker (after one died): a new store, process group and runners."""
        logger.warning("restarting the tensor-parallel workers")
        build = self._build
        self._stop_workers()
        self._start()
        self.init_rank0()
        if build is not None:
            self.build(build.config_json, build.num_blocks)
        if self.place is not None:
            self.place.stage.drop_sent()

    def close(self) -> None:
        """Stop every worker (and a local Ray the group started)."""
        self._stop_workers()
        if self._ray_started:
            import ray

            ray.shutdown()
            self._ray_started = False
            if self._ray_dir is not None:
                forget_own_ray_sessions(self._ray_dir)
        torch.set_num_threads(self._threads_before)


class RankCommands:
    """What rank 0 and its workers do together outside steps: each command goes to the
    workers, rank 0 does it too, then every worker's answer is collected. Shared by
    :class:`TensorParallelRunner` and the pipeline's runner."""

    _runner: Any
    group: WorkerGroup

    def warm_up(self) -> None:
        self.group.command(RankWarmUp())
        self._runner.warm_up()
        self.group.finish_command()

    def sleep(self, level: int) -> int:
        """Sleep mode on every rank (engine.runner.sleep): each gives back its own slice's
        memory; how far rank 0's resident memory fell."""
        self.group.command(RankSleep(level))
        released = self._runner.sleep(level)
        self.group.finish_command()
        return released

    def wake_up(self, tags: Any = None) -> None:
        """Wake ``tags`` on every rank (each reads its slices of the checkpoint again)."""
        self.group.command(RankSleep(-1, tuple(tags or ())))
        self._runner.wake_up(tags)
        self.group.finish_command()

    def reload_weights(self) -> None:
        """Every rank reads its slice of the checkpoint again and rebuilds its model."""
        self.group.command(RankSleep(reload=True))
        self._runner.reload_weights()
        self.group.finish_command()


class TensorParallelRunner(RankCommands):
    """Rank 0's runner with its workers: what the executor drives when
    ``--tensor-parallel-size`` is above 1. Everything but the step-taking methods is rank
    0's runner's (its config, its model, its request count)."""

    def __init__(self, runner: Any, group: WorkerGroup) -> None:
        self._runner = runner
        self.group = group
        # The grammars the workers hold, so that each step sends them the others (they
        # never compile one: engine.process.grammars).
        self.grammars = GrammarMirror(runner.grammar)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    @property
    def rank0(self) -> Any:
        return self._runner

    def execute(self, plan: StepPlan) -> StepResult:
        if self.group.broken:
            raise WorkerLostError("the tensor-parallel workers are down")
        # A worker that died between steps: fail now, before rank 0 waits in a collective
        # for it (NCCL would wait out the whole timeout).
        why = self.group.first_death()
        if why is not None:
            self.group.broken = True
            raise WorkerLostError(why)
        self.group.send_step(plan, self.grammars.for_plan(plan))
        result = self._runner.execute(plan)
        self.group.check_step(result)
        return result

    def reset(self) -> None:
        """Forget every request on every rank; a broken group is replaced (blocking:
        seconds, the workers reload the model)."""
        self._runner.reset()
        self.grammars.reset()
        if self.group.alive():
            try:
                self.group.command(RankReset())
                self.group.finish_command()
                return
            except WorkerLostError:
                pass
        self.group.restart()

    def worker_pids(self) -> list[int]:
        return self.group.pids()

    def close(self) -> None:
        self.group.close()


# --- a worker's side -----------------------------------------------------------------------

