"""Data-parallel engine cores as Ray actors (``--data-parallel-backend ray``, issue 39).

Each core is a :class:`RayCore` actor whose one long call runs the engine-core process's
``main`` (:mod:`engine.process.core`): it connects back to the front end over TCP (the
address Ray reports for the front end's node), proves the shared secret, sends its hello,
and serves, exactly as a spawned core does. The front end's :class:`~engine.process.cores.CorePool`
holds a :class:`RayCoreHandle` where it holds a spawned core's process: waited on, killed,
its exit read. A core killed (its actor, or its worker process) closes its connection, and
the pool fails or moves its requests and restarts it within the restart budget, as for a
process.

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


class RayCore:
    """An engine core as a Ray actor: :meth:`run` is the core process's ``main``."""

    def run(self, argv: list[str], secret: str) -> int:
        os.environ[SECRET_ENV] = secret
        return core_main(argv)


class RayCluster:
    """The Ray the cores are placed on: joined (``$RAY_ADDRESS``) or started locally."""

    def __init__(self, runtime_dir: str | None, cores: int, gpu: bool) -> None:
        self.runtime_dir = runtime_dir
        self.cores = cores
        self.gpu = gpu
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
                ray.init(num_cpus=self.cores, include_dashboard=False,
                         object_store_memory=RAY_OBJECT_STORE_BYTES, log_to_driver=False,
                         _node_ip_address="127.0.0.1", _temp_dir=str(self._dir))
                self._started = True
        return str(ray.util.get_node_ip_address())

    def spawn(self, argv: list[str], secret: bytes) -> RayCoreHandle:
        """Start one core actor running ``python -m engine.process.core argv``."""
        import ray

        actor_class = ray.remote(num_cpus=1, num_gpus=1 if self.gpu else 0, max_restarts=0)(RayCore)
        actor = actor_class.remote()
        return RayCoreHandle(actor, actor.run.remote(argv, secret.decode()))

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

    def __init__(self, actor: Any, ref: Any) -> None:
        self.actor = actor
        self.ref = ref
        self.returncode: int | None = None

    def poll(self) -> int | None:
        import ray

        if self.returncode is None:
            done, _ = ray.wait([self.ref], timeout=0)
            if done:
                try:
                    self.returncode = int(ray.get(done[0]))
                except Exception:  # the actor died (killed, or its process exited)
                    self.returncode = 1
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
