"""What every child process of the engine shares: how it learns the front end's secret,
and how it dies with its parent.

Engine cores (:mod:`engine.process.core`) and tensor-parallel worker ranks
(:mod:`engine.process.workers`) are started with the parent's pid and exit at once when
that parent is gone, so nothing is left running after a front end is killed.
"""

from __future__ import annotations

import os
import threading
import time

# The environment variable that carries an engine core's shared secret (hex), read only at
# the edge of the core process.
SECRET_ENV = "ENGINE_CORE_SECRET"
# How often a child checks that its parent still lives (a parent killed while the child
# loads has no connection yet whose closing would tell it).
PARENT_POLL_SECONDS = 0.5


def exit_with_parent(parent_pid: int) -> None:
    """Exit at once when the parent process is gone (its pid is no longer our parent),
    even in the middle of a collective.

    A daemon thread polls ``getppid`` rather than asking for ``PR_SET_PDEATHSIG``: Linux
    sends that signal when the *thread* that forked us exits, and trio forks from a
    worker thread that its thread cache retires after a few idle seconds.
    """

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
