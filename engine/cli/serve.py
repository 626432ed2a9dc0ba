"""``python -m engine serve``: flags, startup, serving and graceful shutdown.

Lifetimes, outermost first::

    signal receiver (SIGINT, SIGTERM)     opened first: a signal during loading is kept
      engine.open_engine(...)             loads the model, sizes the KV pool, warms up
        hypercorn.trio.serve(app, ...)    returns once a signal came and requests drained

The first signal stops accepting connections and gives in-flight requests
``--shutdown-timeout`` seconds to finish; then hypercorn cancels them (each abort frees its
KV blocks), the engine closes, "shut down cleanly" is logged and the process exits 0 at
once (:func:`engine.cli._exit_now`). A second signal cancels at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import time
from typing import Any

import trio

from engine.api import open_engine
from engine.api.metrics import METRIC_PREFIXES
from engine.chat.reasoning import REASONING_PARSERS
from engine.chat.request import (
    DEFAULT_MAX_TOOL_SCHEMA_BYTES,
    DEFAULT_MAX_TOOLS,
    ChatSettings,
    load_chat_template,
)
from engine.chat.tool_parsers import TOOL_PARSERS
from engine.cli.args import VLLM_SERVE_FLAGS, add_engine_arguments, config_from_args
from engine.errors import ConfigError, EngineError
from engine.http import edge
from engine.http.app import DEFAULT_MAX_REQUEST_BYTES, create_app
from engine.http.middleware import load_middleware
from engine.http.serve import (
    bind_socket,
    bind_unix_socket,
    check_edge_limits,
    check_tls,
    serve_app,
)
from engine.http.stats_log import DEFAULT_INTERVAL_SECONDS, StatsLog
from engine.process.core import run_headless
from engine.process.heap import frozen_startup_heap
from engine.process.malloc import cap_arenas
from engine.process.names import resolve_config
from engine.process.runtime import sweep_at_start

logger = logging.getLogger("engine.http")

# vLLM's default port, so existing client configs work unchanged.
DEFAULT_PORT = 8000
# Long enough for a typical CPU generation (a few hundred tokens) to finish.
DEFAULT_SHUTDOWN_TIMEOUT = 30.0

# Exit status for a bad option found before serving (argparse's own usage errors use 2).
EXIT_BAD_OPTION = 2
# Exit status when the engine died for good (past --max-engine-restarts): a supervisor
# (systemd, Kubernetes) restarts the process.
EXIT_ENGINE_DEAD = 3
# A crash is a bug; restarting the actors in place a few times keeps serving while it is
# reported, and a process that keeps crashing is better restarted whole.
DEFAULT_MAX_ENGINE_RESTARTS = 5
# Grammar compiles in killable processes (engine.structured.pool): a pathological schema
# cannot hold a core past its budget nor outlive its client.
SERVE_GRAMMAR_COMPILE_WORKERS = 2


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve`` flags to ``parser`` (see docs/serving.md for each one): the
    server's own, then one per :class:`EngineConfig` field."""
    group = parser.add_argument_group("server")
    add = group.add_argument
    add("--host", default="127.0.0.1", metavar="ADDRESS", help="address to listen on (0.0.0.0 for all)")
    add("--port", type=int, default=DEFAULT_PORT, metavar="N", help="port to listen on (0 picks a free one)")
    add("--api-key", default=None, metavar="KEY",
        help="require 'Authorization: Bearer KEY' (visible in ps: prefer $ENGINE_API_KEY "
             "or --api-key-file) (default: --api-key-file, else $ENGINE_API_KEY, else none)")
    add("--api-key-file", default=None, metavar="PATH",
        help="read the API key from this file (its first line)")
    add("--ssl-keyfile", default=None, metavar="PATH", help="serve HTTPS with this PEM private key")
    add("--ssl-certfile", default=None, metavar="PATH", help="serve HTTPS with this PEM certificate (chain)")
    add("--allowed-origins", action="append", default=None, metavar="ORIGIN",
        help="allow browsers on these origins (CORS): '*' or https://host[:port]; "
             "repeat or separate with commas")
    add("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
        help="largest request body accepted; larger gets 413")
    add("--send-timeout", type=float, default=edge.SEND_TIMEOUT_SECONDS, metavar="S",
        help="seconds one write may wait for the client to read; then the response is "
             "abandoned, its requests aborted (their KV blocks freed)")
    add("--h2-max-concurrent-streams", type=int, default=edge.H2_MAX_CONCURRENT_STREAMS,
        metavar="N", help="concurrent requests (streams) on one HTTP/2 connection")
    add_chat_arguments(group)
    add("--enable-h2c", action="store_true",
        help="also serve HTTP/2 in cleartext (prior knowledge and Upgrade: h2c); without it "
             "HTTP/2 needs TLS (--ssl-keyfile/--ssl-certfile)")
    add("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT, metavar="S",
        help="seconds in-flight requests get to finish after SIGINT/SIGTERM")
    add("--headless", action="store_true",
        help="serve no HTTP: start this machine's engine cores (--data-parallel-size-local "
             "of them, from --data-parallel-start-rank) and connect them to the front end at "
             "--data-parallel-address")
    add("--data-parallel-secret-file", default=None, metavar="PATH",
        help="the secret that authenticates engine cores on other machines (its first "
             "line) (default: $ENGINE_DP_SECRET)")
    add("--log-level", default=os.environ.get("ENGINE_LOG_LEVEL", "info"),
        choices=["debug", "info", "warning", "error"], help="logging level ($ENGINE_LOG_LEVEL)")
    add("--disable-log-stats", action="store_true",
        help="log no periodic stats line (throughput, requests running and waiting, KV "
             "cache usage), as vLLM's")
    add("--log-stats-interval", type=float, default=DEFAULT_INTERVAL_SECONDS, metavar="S",
        help="seconds between stats lines (vLLM's VLLM_LOG_STATS_INTERVAL)")
    add("--root-path", default="", metavar="PREFIX",
        help="the path prefix a proxy serves this server under (/llm): routes answer with "
             "and without it")
    add("--uds", default=None, metavar="PATH",
        help="serve on this Unix domain socket instead of --host/--port")
    add("--enable-request-id-headers", action="store_true",
        help="put X-Request-Id on every response (a fresh id where the request had none)")
    add("--middleware", action="append", default=None, metavar="PATH",
        help="ASGI middleware around the app, as vLLM's: package.module.Name of a class "
             "(called with the app) or of an async function (request, call_next), run as "
             "Starlette's BaseHTTPMiddleware; repeat for more, the last outermost")
    add("--metrics-prefix", choices=METRIC_PREFIXES, default="engine",
        help="the prefix of the /metrics series: engine, or vllm for vLLM's names (its "
             "Grafana dashboard and alerts read them)")
    add("--allow-runtime-lora-updating", action="store_true",
        default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true"),
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with --enable-lora; "
             "the API key applies) (default: $VLLM_ALLOW_RUNTIME_LORA_UPDATING, else off)")
    add("--server-dev-mode", action="store_true",
        default=os.environ.get("VLLM_SERVER_DEV_MODE", "").strip().lower() in ("1", "true"),
        help="serve vLLM's development route POST /reset_prefix_cache (the API key applies) "
             "(default: $VLLM_SERVER_DEV_MODE, else off)")
    add("model_tag", nargs="?", default=None, metavar="MODEL",
        help="the model, as `vllm serve MODEL` takes it (same as --model)")
    add_engine_arguments(parser, max_engine_restarts=DEFAULT_MAX_ENGINE_RESTARTS,
                         grammar_compile_workers=SERVE_GRAMMAR_COMPILE_WORKERS,
                         engine_core="auto")
    _add_vllm_flags(parser)


def add_chat_arguments(group: Any) -> None:
    """The chat flags (tools, chat template, tool-call and reasoning parsers), read back by
    :func:`chat_settings`; ``serve`` and ``run-batch`` share them."""
    add = group.add_argument
    add("--max-tools", type=int, default=DEFAULT_MAX_TOOLS, metavar="N",
        help="most tools (functions) one chat request may declare; more gets 400")
    add("--max-tool-schema-bytes", type=int, default=DEFAULT_MAX_TOOL_SCHEMA_BYTES,
        metavar="N", help="largest `tools` of one request, as JSON; larger gets 400")
    add("--chat-template", default=None, metavar="T",
        help="a jinja chat template (a file, or the template itself) replacing the model's")
    add("--trust-request-chat-template", action="store_true",
        help="let requests send their own chat_template")
    add("--response-role", default="assistant", metavar="ROLE",
        help="the role a chat answer's message carries when the template opened a reply "
             "(vLLM's; default: assistant)")
    add("--default-chat-template-kwargs", default=None, metavar="JSON",
        help="chat_template_kwargs every chat request renders with unless it sets the key "
             "itself, e.g. '{\"enable_thinking\": false}'")
    add("--enable-auto-tool-choice", action="store_true",
        help='read tool calls from free text for tool_choice "auto" (needs --tool-call-parser)')
    add("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None, metavar="NAME",
        help=f"how the model writes tool calls: {', '.join(sorted(TOOL_PARSERS))} (see "
             "docs/serving.md)")
    add("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None, metavar="NAME",
        help=f"split <think>...</think> into reasoning (and reasoning_content): "
             f"{', '.join(sorted(REASONING_PARSERS))}")


class _VllmNoOp(argparse.Action):
    """A vLLM flag with nothing to do here: noted (logged at startup), or a usage error at
    a value this server cannot honour."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        flag = VLLM_SERVE_FLAGS[option_string or ""]
        if flag.allowed is not None and values not in flag.allowed:
            parser.error(f"{option_string} {values} (a vLLM flag) is not supported: "
                         f"{flag.reason}; only {', '.join(flag.allowed)} is accepted")
        notes = list(getattr(namespace, "vllm_no_ops", []))
        notes.append(f"{option_string}: no effect here ({flag.reason})")
        namespace.vllm_no_ops = notes


class _VllmRefused(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        flag = VLLM_SERVE_FLAGS[option_string or ""]
        parser.error(f"{option_string} is a vLLM flag this server does not support: "
                     f"{flag.reason} (see 'Coming from vLLM' in docs/serving.md)")


def _add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's serve flags (:data:`engine.config.VLLM_SERVE_FLAGS`): its names for this
    server's flags, flags with nothing to do here, and flags refused with their reason.
    Hidden from --help; docs/serving.md lists them."""
    group = parser.add_argument_group("vLLM's flags")
    for option, flag in VLLM_SERVE_FLAGS.items():
        if option in parser._option_string_actions:
            continue  # this server has the flag itself now: its own meaning wins
        nargs = None if flag.takes_value else 0
        if flag.action == "alias":
            target = parser._option_string_actions[flag.target or ""]
            group.add_argument(option, dest=target.dest, type=target.type,
                               choices=target.choices, metavar=target.metavar,
                               default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        elif flag.action == "no_op":
            group.add_argument(option, action=_VllmNoOp, nargs=nargs,
                               default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        else:
            group.add_argument(option, action=_VllmRefused, nargs=nargs if nargs == 0 else "?",
                               default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key, else --api-key-file, else $ENGINE_API_KEY, else None."""
    if args.api_key:
        return str(args.api_key)
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as exc:
            raise ConfigError(f"--api-key-file: {exc}", field="api_key_file") from None
        if not key:
            raise ConfigError(f"--api-key-file: {args.api_key_file} holds no key",
                              field="api_key_file")
        return key
    return os.environ.get("ENGINE_API_KEY") or None


def data_parallel_secret(args: argparse.Namespace) -> bytes | None:
    """The shared secret of remote engine cores: --data-parallel-secret-file, else
    $ENGINE_DP_SECRET, else None."""
    path = getattr(args, "data_parallel_secret_file", None)
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                secret = f.readline().strip()
        except OSError as exc:
            raise ConfigError(f"--data-parallel-secret-file: {exc}",
                              field="data_parallel_secret_file") from None
        if not secret:
            raise ConfigError(f"--data-parallel-secret-file: {path} holds no secret",
                              field="data_parallel_secret_file")
        return secret.encode()
    env = os.environ.get("ENGINE_DP_SECRET")
    return env.encode() if env else None


def allowed_origins(args: argparse.Namespace) -> tuple[str, ...]:
    """Every --allowed-origins value, commas split, blanks dropped."""
    values = args.allowed_origins or ()
    return tuple(o.strip() for v in values for o in v.split(",") if o.strip())


def run_serve(args: argparse.Namespace) -> int:
    """Run the server until SIGINT/SIGTERM; return the process exit status."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # engine.cli.main may have configured the root logger already; the flag wins.
    logging.getLogger().setLevel(args.log_level.upper())
    for note in getattr(args, "vllm_no_ops", ()):
        logger.info("%s", note)
    raise_open_file_limit()
    cap_arenas()
    edge.quiet_accept_errors()
    try:
        model_from_tag(args)
        if not getattr(args, "headless", False):
            preflight(args)
        resolve_models(args)
        if getattr(args, "headless", False):
            return trio.run(_headless, args)
        status = trio.run(_serve, args)
    except ValueError as exc:  # a bad option or one the model refuses; a port in use
        logger.error("%s", " ".join(str(exc).split()))
        return EXIT_BAD_OPTION
    except EngineError as exc:  # a model that does not load
        logger.error("%s", exc)
        return 1
    if status == 0:
        # Outside the trio run: the server, the engine and every request are gone, and
        # ``python -m engine serve`` exits right after this line (engine.cli._exit_now)
        # without waiting on worker threads left behind.
        logger.info("shut down cleanly")
    return status


def model_from_tag(args: argparse.Namespace) -> None:
    """``serve MODEL`` (vLLM's positional form) sets ``--model``; both must agree."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model is not None and args.model != tag:
        raise ConfigError(f"the model is given twice: {tag!r} and --model {args.model!r}",
                          field="model")
    args.model = tag


def preflight(args: argparse.Namespace) -> None:
    """What the flags alone decide, the port included, checked before a Hub download as
    before a load: a clash or a bad option is one line at once, not after minutes of
    fetching. ``_serve`` checks them again and binds for real (a port taken in between
    is the same one-line error then)."""
    config_from_args(args)
    chat_settings(args)
    api_key(args)
    check_tls(args.ssl_keyfile, args.ssl_certfile)
    check_edge_limits(args.send_timeout, args.h2_max_concurrent_streams)
    _check_stats_interval(args)
    load_middleware(getattr(args, "middleware", None) or ())
    uds = getattr(args, "uds", None)
    if not uds:
        bind_socket(args.host, args.port).close()


def _check_stats_interval(args: argparse.Namespace) -> None:
    interval = getattr(args, "log_stats_interval", DEFAULT_INTERVAL_SECONDS)
    if not interval > 0 or interval == float("inf"):
        raise ConfigError(f"--log-stats-interval must be a positive number of seconds, got "
                          f"{interval}", field="log_stats_interval")


def resolve_models(args: argparse.Namespace) -> None:
    """Hub ids in ``--model``, ``--tokenizer`` and the draft's ``model`` become local paths
    (fetched if not cached; engine.process.names), before the trio run: a download is
    interrupted by Ctrl-C as any blocking call is, and refusals come before anything loads.
    ``--served-model-name`` defaults to the id."""
    resolved = resolve_config(config_from_args(args))
    for name in ("model", "served_model_name", "tokenizer", "speculative_config"):
        setattr(args, name, getattr(resolved, name))


def raise_open_file_limit() -> None:
    """Raise the soft limit on open files to the hard limit, as vLLM does: every client
    connection is a descriptor, and distributions' default soft limit (1024) is reached
    by a thousand idle keep-alive connections."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An unlimited hard limit cannot be the soft one for descriptors (the kernel caps it at
    # fs.nr_open, 1048576 by default).
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= target:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        logger.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
        return
    logger.debug("open-file limit raised from %d to %d", soft, target)


def chat_settings(args: argparse.Namespace) -> ChatSettings:
    """The chat flags as :class:`ChatSettings`; ``ValueError`` for a bad combination."""
    template = getattr(args, "chat_template", None)
    return ChatSettings(
        tool_call_parser=getattr(args, "tool_call_parser", None),
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
        reasoning_parser=getattr(args, "reasoning_parser", None),
        chat_template=load_chat_template(template) if template is not None else None,
        trust_request_chat_template=getattr(args, "trust_request_chat_template", False),
        default_chat_template_kwargs=_template_kwargs(
            getattr(args, "default_chat_template_kwargs", None)),
        response_role=getattr(args, "response_role", "assistant"),
        max_tools=getattr(args, "max_tools", DEFAULT_MAX_TOOLS),
        max_tool_schema_bytes=getattr(args, "max_tool_schema_bytes",
                                      DEFAULT_MAX_TOOL_SCHEMA_BYTES),
    )


def _template_kwargs(text: str | None) -> dict[str, Any] | None:
    """``--default-chat-template-kwargs``: a JSON object, else ``ValueError``."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--default-chat-template-kwargs is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("--default-chat-template-kwargs must be a JSON object")
    return value


async def _headless(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    secret = data_parallel_secret(args)
    if not secret:
        raise ConfigError("--headless needs the front end's secret ($ENGINE_DP_SECRET or "
                          "--data-parallel-secret-file)", field="data_parallel_secret_file")
    status = await run_headless(config, secret)
    logger.info("engine cores exited (status %d)", status)
    return status


async def _serve(args: argparse.Namespace) -> int:
    # Everything the flags alone decide is checked before the model loads, the port too.
    config = config_from_args(args)
    sweep_at_start(config.runtime_dir)  # what a killed server left
    settings = chat_settings(args)
    key = api_key(args)
    secret = data_parallel_secret(args)
    check_tls(args.ssl_keyfile, args.ssl_certfile)
    check_edge_limits(args.send_timeout, args.h2_max_concurrent_streams)
    _check_stats_interval(args)
    middleware = load_middleware(getattr(args, "middleware", None) or ())
    uds = getattr(args, "uds", None)
    with (bind_unix_socket(uds) if uds else bind_socket(args.host, args.port)) as listener, \
            trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        t0 = time.monotonic()
        with _LoadProgress() as progress:
            async with open_engine(config=config, core_secret=secret) as eng:
                progress.close()
                logger.info("engine ready: %s, max_model_len %d (%.2f s)", eng.model_name,
                            eng.max_model_len, time.monotonic() - t0)
                logger.info("sampling defaults from %s%s: %s",
                            "generation_config.json" if eng.config.generation_config
                            in ("auto", "none", "vllm") else
                            f"{eng.config.generation_config}/generation_config.json",
                            " and --override-generation-config"
                            if eng.config.override_generation_config else "",
                            json.dumps(eng.sampling_defaults) if eng.sampling_defaults else
                            "none" + (" (--generation-config none)"
                                      if eng.config.generation_config in ("none", "vllm")
                                      else ""))
                if eng.default_max_tokens is not None:
                    logger.info("max_tokens: %d when a chat request sets none%s",
                                eng.default_max_tokens,
                                "" if eng.max_tokens_cap is None else
                                f", at most {eng.max_tokens_cap} for any request")
                app = create_app(eng, api_key=key, max_request_bytes=args.max_request_bytes,
                                 chat=settings, allowed_origins=allowed_origins(args),
                                 root_path=getattr(args, "root_path", ""),
                                 enable_request_id_headers=getattr(
                                     args, "enable_request_id_headers", False),
                                 metrics_prefix=getattr(args, "metrics_prefix", "engine"),
                                 send_timeout=args.send_timeout,
                                 allow_runtime_lora_updating=getattr(
                                     args, "allow_runtime_lora_updating", False),
                                 server_dev_mode=getattr(args, "server_dev_mode", False),
                                 middleware=middleware)
                with frozen_startup_heap():  # out of the full collections (process/heap.py)
                    died = await _serve_until_signal(app, args, listener, signals, eng)
        return EXIT_ENGINE_DEAD if died else 0


async def _serve_until_signal(
    app: Any, args: argparse.Namespace, listener: socket.socket, signals: Any, eng: Any
) -> bool:
    """Serve until a signal (False) or the engine's death for good (True) starts the
    graceful shutdown; returns once the requests in flight are drained."""
    died = False
    async with trio.open_nursery() as nursery:

        async def on_signal(race: trio.CancelScope) -> None:
            async for signum in signals:
                logger.info("%s: draining in-flight requests (up to %.0f s)",
                            signal.Signals(signum).name, args.shutdown_timeout)
                nursery.start_soon(_cancel_on_second_signal, signals, nursery.cancel_scope)
                race.cancel()
                return

        async def on_engine_death(race: trio.CancelScope) -> None:
            nonlocal died
            await eng.wait_dead()
            died = True
            # The requests in flight have failed with it; they still get their 503s.
            logger.error("the engine is dead after %d restart(s) (--max-engine-restarts "
                         "%d); exiting with status %d", eng.restarts,
                         args.max_engine_restarts, EXIT_ENGINE_DEAD)
            race.cancel()

        async def shutdown_trigger() -> None:
            async with trio.open_nursery() as race:
                race.start_soon(on_signal, race.cancel_scope)
                race.start_soon(on_engine_death, race.cancel_scope)

        async def run_server(task_status: trio.TaskStatus[list[str]]) -> None:
            await serve_app(app, listener, shutdown_timeout=args.shutdown_timeout,
                            ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                            enable_h2c=getattr(args, "enable_h2c", False),
                            h2_max_concurrent_streams=args.h2_max_concurrent_streams,
                            shutdown_trigger=shutdown_trigger, task_status=task_status)
            # Drained: stop the second-signal watcher so the nursery can close.
            nursery.cancel_scope.cancel()

        t1 = time.monotonic()
        binds = await nursery.start(run_server)
        logger.info("listening on %s (%.2f s)", ", ".join(binds), time.monotonic() - t1)
        if not getattr(args, "disable_log_stats", False):
            stats = StatsLog(eng, app.extensions["metrics"])
            nursery.start_soon(stats.run, args.log_stats_interval)
    return died


async def _cancel_on_second_signal(signals: Any, scope: trio.CancelScope) -> None:
    async for signum in signals:
        logger.warning("%s again: cancelling in-flight requests now",
                       signal.Signals(signum).name)
        scope.cancel()
        return


class _LoadProgress:
    """A tqdm bar over the engine's startup phases, advanced by its log lines.

    The loader reports progress as one "engine" log line per phase; this turns those
    lines into a bar on stderr while the model loads (disabled when stderr is no tty).
    While the bar shows, the console log handlers write through ``tqdm.write``, which
    clears the bar, prints the line and redraws the bar below it: a log line written
    straight to the terminal would land in the middle of the bar's line.
    """

    # load weights, tokenizer, size the KV pool and build the runner, warm up: the phases
    # the engine logs.
    PHASES = 4

    def __enter__(self) -> _LoadProgress:
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self._bar = tqdm(total=self.PHASES, desc="loading model", unit="phase",
                         leave=False, disable=None)
        self._handler = _PhaseHandler(self._bar)
        logging.getLogger("engine").addHandler(self._handler)
        self._redirect = contextlib.ExitStack()
        if not self._bar.disable:
            self._redirect.enter_context(logging_redirect_tqdm())
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Finish the bar (idempotent): loading is over."""
        logging.getLogger("engine").removeHandler(self._handler)
        self._bar.close()
        self._redirect.close()


class _PhaseHandler(logging.Handler):
    def __init__(self, bar: Any) -> None:
        super().__init__(level=logging.INFO)
        self._bar = bar

    def emit(self, record: logging.LogRecord) -> None:
        # Only the engine's own phase lines, not this module's (engine.http).
        if not record.name.startswith("engine.http") and self._bar.n < self._bar.total:
            self._bar.update(1)
