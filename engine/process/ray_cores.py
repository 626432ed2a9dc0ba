"""Data-parallel engine cores as Ray actors (``--data-parallel-backend ray``, issue 39).

Each core is a :class:`RayCore` actor whose one long call runs the engine-core process's
``main`` (:mod:`engine.process.core`): it connects back to the front end over TCP (the
address Ray reports for the front end's node), proves the shared secret, sends its hello,
and serves, exactly as a spawned core does. The front end's :class:`~engine.process.cores.CorePool`
holds a :class:`RayCoreHandle` where it holds a spawned core's process: waited on, killed,
its exit read. A core killed (its actor, or its worker process) closes its connection, and
the pool fails or moves its requests and restarts it within the restart budget, as for a
process.

Each core is placed in a placement group of its own, a bundle per rank of its group: the
core (rank 0) in bundle 0 and, with ``--tensor-parallel-size`` / ``--pipeline-parallel-size``
above 1, its worker actors in bundles 1..N-1 (the core's
:class:`~engine.process.workers.WorkerGroup` finds the group it runs in and places its
workers there). The group is packed: on a cluster of several nodes a core and its workers
share one node whenever one holds them all, and each core's torch.distributed rendezvous
is its own (a store on a free port of its node), so cores never collide. Removing the
group when its core is gone stops whatever of it still runs (a worker orphaned by a core
that crashed).

With ``$RAY_ADDRESS`` the engine joins that cluster; otherwise it starts a local Ray
(loopback, no dashboard, a small object store, a CPU per core; its session in the engine's
runtime folder) and stops it when the pool closes.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import trio

from engine.errors import ConfigError
from engine.process.core import main as core_main
from engine.process.runtime import forget_own_ray_sessions, ray_temp_dir
from engine.process.spawn import SECRET_ENV

logger = logging.getLogger("engine")

# A local Ray's object store: the cores pass nothing through it (frames go over their
# sockets); Ray's floor is about 75 MB.
RAY_OBJECT_STORE_BYTES = 100 * 2**20
# How long Ray may take to place a core's bundles (a busy cluster frees them as other work
# ends) before the engine gives up on the core: as long as a worker rank gets to start
# (engine.process.worker_rank.START_TIMEOUT_SECONDS).
PLACE_TIMEOUT_SECONDS = 600.0


class RayCore:
    """An engine core as a Ray actor: :meth:`run` is the core process's ``main``."""

    def run(self, argv: list[str], secret: str) -> int:
        os.environ[SECRET_ENV] = secret
        return core_main(argv)


class RayCluster:
    """The Ray the cores are placed on: joined (``$RAY_ADDRESS``) or started locally."""

    def __init__(self, runtime_dir: str | None, cores: int, gpu: bool, group: int = 1) -> None:
        self.runtime_dir = runtime_dir
        self.cores = cores
        self.gpu = gpu
        self.group = group  # the ranks of one core: a bundle each
        self._started = False
        self._dir: Path | None = None

    def start(self) -> str:
        """Join or start Ray (blocking: seconds); returns the address cores reach this
        node at."""
        try:
            import ray
        except ImportError:
            raise ConfigError("--data-parallel-backend ray needs Ray: install the package's "
                              "[ray] extra (pip install -e '.[ray]')",
                              field="data_parallel_backend") from None
        if not ray.is_initialized():
            if os.environ.get("RAY_ADDRESS"):
                ray.init(log_to_driver=False)
            else:
                self._dir = ray_temp_dir(self.runtime_dir)
                ray.init(num_cpus=self.cores * self.group, include_dashboard=False,
                         object_store_memory=RAY_OBJECT_STORE_BYTES, log_to_driver=False,
                         _node_ip_address="127.0.0.1", _temp_dir=str(self._dir))
                self._started = True
        return str(ray.util.get_node_ip_address())

    def spawn(self, argv: list[str], secret: bytes, index: int = 0) -> RayCoreHandle:
        """Start core ``index``'s actor running ``python -m engine.process.core argv``, in
        a placement group of its own (blocking until Ray has placed the group)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": 1.0, "GPU": 1.0} if self.gpu else {"CPU": 1.0}
        group = placement_group([dict(bundle) for _ in range(self.group)], strategy="PACK")
        ready, _ = ray.wait([group.ready()], timeout=PLACE_TIMEOUT_SECONDS)
        if not ready:
            remove_placement_group(group)
            raise ConfigError(f"Ray could not place engine core {index} ({self.group} "
                              f"bundle(s) of {bundle}) within {PLACE_TIMEOUT_SECONDS:.0f} s",
                              field="data_parallel_backend")
        actor_class = ray.remote(num_cpus=1, num_gpus=1 if self.gpu else 0, max_restarts=0)(RayCore)
        actor = actor_class.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=0)).remote()
        return RayCoreHandle(actor, actor.run.remote(argv, secret.decode()), group)

    def close(self) -> None:
        if self._started:
            import ray

            ray.shutdown()
            self._started = False
            if self._dir is not None:
                forget_own_ray_sessions(self._dir)


class RayCoreHandle:
    """A core actor, as the pool holds a core's process: ``returncode`` (None while it
    runs), :meth:`wait`, :meth:`kill`."""

    def __init__(self, actor: Any, ref: Any, group: Any = None) -> None:
        self.actor = actor
        self.ref = ref
        self.group = group  # the core's placement group, removed once the core is gone
        self.returncode: int | None = None

    def _release(self) -> None:
        """Remove the core's placement group: its bundles go back to the cluster, and any
        worker of the core still running is stopped with it."""
        group, self.group = self.group, None
        if group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(group)
            except Exception:  # Ray is stopping
                pass

    def poll(self) -> int | None:
        import ray

        if self.returncode is None:
            done, _ = ray.wait([self.ref], timeout=0)
            if done:
                try:
                    self.returncode = int(ray.get(done[0]))
                except Exception:  # the actor died (killed, or its process exited)
                    self.returncode = 1
                self._release()
        return self.returncode

    async def wait(self) -> int:
        import ray

        if self.poll() is None:
            # Ray's wait blocks its thread until the call ends; abandoned if the pool stops
            # waiting (it returns once the actor is gone).
            await trio.to_thread.run_sync(lambda: ray.wait([self.ref]), abandon_on_cancel=True)
        code = self.poll()
        assert code is not None
        return code

    def kill(self) -> None:
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # already gone
            pass
        self._release()
