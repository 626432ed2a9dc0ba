"""vLLM's ``--middleware``: ASGI middleware named by import path, put around the app.

vLLM takes a class (added as Starlette's ``app.add_middleware(cls)``: ``cls(app)`` is an
ASGI app that calls the one inside) or a coroutine function ``async def mw(request,
call_next)`` (added with ``@app.middleware("http")``). Here a class wraps the Quart app's
ASGI callable the same way, and a function runs in Starlette's ``BaseHTTPMiddleware``,
which is what ``@app.middleware("http")`` builds in vLLM's FastAPI app (Starlette is
imported only then; under this server's trio loop it runs on anyio's trio backend). The
last one named is the outermost, as each ``add_middleware`` in vLLM puts the new one
outside the others; all of them are outside the app's own hooks, so they see every
request before the API key is checked, as in vLLM.

Paths are vLLM's ``package.module.Name`` (``package.module:Name`` works too). A path
that does not import, or names neither a class nor a coroutine function, stops the
server before the model loads (:class:`ConfigError` naming ``middleware``).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from engine.errors import ConfigError

Wrap = Callable[[Any], Any]  # an ASGI app -> the ASGI app around it


def load_middleware(paths: Sequence[str]) -> list[Wrap]:
    """One wrapper per path, in the order given (checked, and imported, now)."""
    return [_load(path) for path in paths]


def wrap_app(app: Any, wraps: Sequence[Wrap]) -> None:
    """Put ``wraps`` around the Quart ``app``'s ASGI callable, the last outermost."""
    for wrap in wraps:
        app.asgi_app = wrap(app.asgi_app)


def _load(path: str) -> Wrap:
    module_name, sep, name = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not name:
        raise ConfigError(f"--middleware {path!r}: give an import path, package.module.Name",
                          field="middleware")
    try:
        target = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--middleware {path!r} does not import: {exc}", field="middleware") from None
    if inspect.isclass(target):
        return target  # type: ignore[no-any-return]
    if inspect.iscoroutinefunction(target):
        try:
            from starlette.middleware.base import BaseHTTPMiddleware
        except ImportError:
            raise ConfigError(f"--middleware {path!r} is a function: it runs as Starlette's "
                              "BaseHTTPMiddleware, and starlette is not installed "
                              "(pip install starlette)", field="middleware") from None
        return lambda app: BaseHTTPMiddleware(app, dispatch=target)
    raise ConfigError(f"--middleware {path!r} must name a class or an async function, "
                      f"not {type(target).__name__}", field="middleware")
