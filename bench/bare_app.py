"""The HTTP stack alone: a quart-trio app with one route, ``GET /health`` answering
``{"status": "ok"}``, served by hypercorn's trio worker with its defaults (no access log).
``bench/served.py --sections requests`` serves it beside the engine's server, so what a
request costs there (hypercorn, h11, quart, trio) is a baseline for what it costs the
engine's server.

    python bench/bare_app.py PORT
"""

from __future__ import annotations

import sys

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from quart_trio import QuartTrio

app = QuartTrio(__name__)


@app.route("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


def main() -> None:
    config = Config()
    config.bind = [f"127.0.0.1:{int(sys.argv[1])}"]
    config.accesslog = None
    config.loglevel = "WARNING"
    trio.run(serve, app, config)


if __name__ == "__main__":
    main()
