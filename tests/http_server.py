"""Run the HTTP server in a background thread (its own trio loop) on a free loopback port.

pytest-trio fixtures live inside one test's trio run, so a server shared by a whole module
runs in its own thread instead; tests talk to it over real sockets with the openai client
and httpx, exactly as users do. The server goes through :func:`engine.cli.serve.serve_app`,
the same path ``python -m engine serve`` takes.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import httpx
import trio

from engine.http.app import create_app
from engine.http.serve import bind_socket, serve_app

# Loading a tiny model and binding a port takes well under a second; this is a hang guard.
_START_TIMEOUT = 120.0


class ServerThread:
    """``with ServerThread(lambda: open_engine(...), api_key=...) as server:`` ..."""

    def __init__(self, open_engine: Callable[[], AbstractAsyncContextManager[Any]],
                 shutdown_timeout: float = 5.0, serve_options: dict[str, Any] | None = None,
                 **app_options: Any) -> None:
        self._open_engine = open_engine
        self._app_options = app_options
        self._serve_options = serve_options or {}
        self._shutdown_timeout = shutdown_timeout
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)
        self.engine: Any = None
        self.app: Any = None
        self.base_url = ""

    def __enter__(self) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT) or self._error is not None:
            raise RuntimeError("test server did not start") from self._error
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._token.run_sync_soon(self._stop.set)
            self._thread.join(_START_TIMEOUT)

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with self._open_engine() as eng:
            self.engine = eng
            app = self.app = create_app(eng, **self._app_options)
            with bind_socket("127.0.0.1", 0) as listener:
                async with trio.open_nursery() as nursery:
                    binds = await nursery.start(lambda task_status: serve_app(
                        app, listener, shutdown_timeout=self._shutdown_timeout,
                        shutdown_trigger=self._stop.wait, task_status=task_status,
                        **self._serve_options))
                    self.base_url = binds[0]
                    self._ready.set()

    def metric(self, name: str) -> float:
        """The value of one unlabelled-but-for-model_name metric from GET /metrics."""
        return self.metrics(name)[0]

    def metrics(self, *names: str) -> tuple[float, ...]:
        """Several such values from one scrape (one consistent snapshot)."""
        text = httpx.get(self.base_url + "/metrics").text
        values = []
        for name in names:
            match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
            if match is None:
                raise KeyError(name)
            values.append(float(match.group(1)))
        return tuple(values)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the server's trio loop and return its result.

        Works from a plain thread and from another trio loop (a trio test) alike.
        """
        done = threading.Event()
        result: list[Any] = []

        def run() -> None:
            try:
                result.append(fn(*args))
            finally:
                done.set()

        self._token.run_sync_soon(run)
        if not done.wait(_START_TIMEOUT) or not result:
            raise RuntimeError(f"{fn!r} failed on the server loop")
        return result[0]
