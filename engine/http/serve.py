"""Running the HTTP app: the listening socket (TCP or Unix) bound before the model loads,
and hypercorn's trio worker serving the app on it with the edge limits and HTTP/2 settings
(:mod:`engine.http.edge`, :mod:`engine.http.h2c`) until a shutdown trigger fires.

The command line (:mod:`engine.cli.serve`) decides when; this module knows how.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from engine.errors import ConfigError
from engine.http import edge, h2c


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``port=0``: a free one), for :func:`serve_app`.

    ``serve`` binds it before the model loads, so a port in use is a one-line
    :class:`ConfigError` rather than a failure after the whole load.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        # As hypercorn sets them on the sockets it binds itself: a restarted server reuses
        # its port while old connections sit in TIME_WAIT, and small SSE writes go at once.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                          field="port") from None
    return sock


@contextlib.contextmanager
def bind_unix_socket(path: str) -> Any:
    """A Unix domain socket bound at ``path`` (``--uds``), for :func:`serve_app`; the
    file is removed when the server is done. A stale socket file (a server that died) is
    replaced; anything else at ``path`` is a :class:`ConfigError`."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(mode):
            raise ConfigError(f"--uds {path}: the path exists and is not a socket",
                              field="uds")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens: a dead server's socket file
        else:
            raise ConfigError(f"--uds {path}: another server is listening there", field="uds")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {path}: {exc.strerror or exc}", field="uds") from None
    try:
        with sock:
            yield sock
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def check_edge_limits(send_timeout: float, h2_max_concurrent_streams: int) -> None:
    """:class:`ConfigError` for a connection limit out of range."""
    if not send_timeout > 0:
        raise ConfigError(f"--send-timeout must be a positive number of seconds, got "
                          f"{send_timeout}", field="send_timeout")
    if h2_max_concurrent_streams < 1:
        raise ConfigError(f"--h2-max-concurrent-streams must be at least 1, got "
                          f"{h2_max_concurrent_streams}", field="h2_max_concurrent_streams")


def check_tls(ssl_keyfile: str | None, ssl_certfile: str | None) -> None:
    """HTTPS needs both files; :class:`ConfigError` for one alone."""
    if bool(ssl_keyfile) != bool(ssl_certfile):
        raise ConfigError("TLS needs both --ssl-keyfile and --ssl-certfile",
                          field="ssl_certfile" if ssl_keyfile else "ssl_keyfile")


async def serve_app(
    app: Any, listener: socket.socket, *, shutdown_timeout: float,
    shutdown_trigger: Callable[[], Awaitable[None]],
    ssl_keyfile: str | None = None, ssl_certfile: str | None = None,
    enable_h2c: bool = False,
    h2_max_concurrent_streams: int = edge.H2_MAX_CONCURRENT_STREAMS,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` with hypercorn's trio worker on ``listener`` (from :func:`bind_socket`,
    which it takes over) until ``shutdown_trigger`` returns.

    ``task_status.started`` gets the bound URLs. After the trigger, new connections are
    refused and in-flight requests get ``shutdown_timeout`` seconds before they are
    cancelled. HTTP/2 in cleartext is served only with ``enable_h2c`` (:mod:`engine.http.h2c`).
    A socket write waits at most the app's send timeout (``create_app``'s ``send_timeout``)
    before the connection is closed. When the process runs out of file descriptors, a new
    connection is answered with a 503 and closed rather than left in the listen backlog.
    """
    check_tls(ssl_keyfile, ssl_certfile)
    config = HypercornConfig()
    config.graceful_timeout = shutdown_timeout
    config.accesslog = None
    # hypercorn serves HTTPS (and offers HTTP/2 through ALPN) when both are set.
    config.keyfile = ssl_keyfile
    config.certfile = ssl_certfile
    edge.hypercorn_limits(config, h2_max_concurrent_streams=h2_max_concurrent_streams)
    config.engine_send_timeout = getattr(app, "config", {}).get(
        edge.SEND_TIMEOUT_CONFIG, edge.SEND_TIMEOUT_SECONDS)
    edge.shield_hypercorn_close()
    edge.frame_h11_body_chunks()
    edge.use_idle_timer()
    h2c.configure(config, enable_h2c=enable_h2c)
    edge.patch_hypercorn_h2()
    # Hypercorn's own "Running on" line duplicates ours; its errors still reach the log.
    config.loglevel = "WARNING"
    # hypercorn wraps the descriptor in a socket of its own and closes it when done:
    # detached, ``listener`` no longer owns it, so it is closed exactly once.
    fd = listener.detach()
    config.bind = [f"fd://{fd}"]
    # Out of descriptors, a new connection gets a 503 at once (edge.DescriptorReserve).
    with edge.reserve_descriptors(fd, tls=bool(ssl_keyfile)):
        await hypercorn_serve(app, config, shutdown_trigger=shutdown_trigger,
                              task_status=task_status)
