"""The HTTP stack alone: one route, ``GET /health`` answering ``{"status": "ok"}``, served
by hypercorn's trio worker with its defaults (no access log). ``bench/served.py --sections
requests`` serves it beside the engine's server, so what a request costs there is a
baseline for what it costs the engine's server.

    python bench/bare_app.py PORT           # a quart-trio app (hypercorn, h11, quart, trio)
    python bench/bare_app.py PORT asgi      # a bare ASGI callable: hypercorn, h11, trio

The second splits the stack's cost between hypercorn and quart: the callable answers every
request with the same two ASGI events and reads nothing.
"""

from __future__ import annotations

import sys

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from quart_trio import QuartTrio

app = QuartTrio(__name__)

_BODY = b'{"status": "ok"}'
_START = {"type": "http.response.start", "status": 200,
          "headers": [(b"content-type", b"application/json"),
                      (b"content-length", str(len(_BODY)).encode())]}


@app.route("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


async def asgi_app(scope: dict, receive, send) -> None:
    """Every HTTP request gets ``_BODY``; lifespan events are acknowledged."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            kind = message["type"].removeprefix("lifespan.")
            await send({"type": f"lifespan.{kind}.complete"})
            if kind == "shutdown":
                return
    await send(_START)
    await send({"type": "http.response.body", "body": _BODY})


def main() -> None:
    config = Config()
    config.bind = [f"127.0.0.1:{int(sys.argv[1])}"]
    config.accesslog = None
    config.loglevel = "WARNING"
    kind = sys.argv[2] if len(sys.argv) > 2 else "quart"
    if kind not in ("quart", "asgi"):
        raise SystemExit(f"unknown app {kind!r}: quart or asgi")
    trio.run(serve, app if kind == "quart" else asgi_app, config)


if __name__ == "__main__":
    main()
