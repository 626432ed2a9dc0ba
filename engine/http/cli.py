"""``python -m engine serve``: flags, startup, serving and graceful shutdown.

Lifetimes, outermost first::

    signal receiver (SIGINT, SIGTERM)     opened first: a signal during loading is kept
      engine.open_engine(...)             loads the model, sizes the KV pool, warms up
        hypercorn.trio.serve(app, ...)    returns once a signal came and requests drained

The first signal stops accepting connections and gives in-flight requests
``--shutdown-timeout`` seconds to finish; then hypercorn cancels them (each abort frees its
KV blocks), the engine closes and the process exits 0. A second signal cancels at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from engine.chat.reasoning import REASONING_PARSERS
from engine.chat.request import ChatSettings, load_chat_template
from engine.chat.tool_parsers import TOOL_PARSERS
from engine.config import DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS, parse_memory
from engine.errors import EngineError, InvalidParamError
from engine.http import edge
from engine.http.app import DEFAULT_MAX_REQUEST_BYTES, create_app

logger = logging.getLogger("engine.http")

# vLLM's default port, so existing client configs work unchanged.
DEFAULT_PORT = 8000
# Long enough for a typical CPU generation (a few hundred tokens) to finish.
DEFAULT_SHUTDOWN_TIMEOUT = 30.0

# CLI flag dest -> EngineConfig field, for the flags passed to open_engine when given.
_ENGINE_OPTIONS = (
    "served_model_name", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
    "block_size", "kv_cache_memory", "kv_cache_dtype", "max_queued_requests", "dtype", "quantization", "device", "seed",
    "scheduling_policy", "async_scheduling", "ops_backend", "generation_config",
    "max_engine_restarts",
)
# Exit status when the engine died for good (past --max-engine-restarts): a supervisor
# (systemd, Kubernetes) restarts the process.
EXIT_ENGINE_DEAD = 3
# A crash is a bug; restarting the actors in place a few times keeps serving while it is
# reported, and a process that keeps crashing is better restarted whole.
DEFAULT_MAX_ENGINE_RESTARTS = 5


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve`` flags to ``parser`` (see docs/serving.md for each one)."""
    add = parser.add_argument
    add("--model", default=None,
        help="a Hugging Face folder or a .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    add("--served-model-name", default=None,
        help="the model name clients send and see (default: derived from the model path)")
    add("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all)")
    add("--port", type=int, default=DEFAULT_PORT, help="port to listen on (0 picks a free one)")
    add("--api-key", default=None,
        help="require 'Authorization: Bearer KEY' (visible in ps: prefer $ENGINE_API_KEY "
             "or --api-key-file)")
    add("--api-key-file", default=None,
        help="read the API key from this file (its first line)")
    add("--ssl-keyfile", default=None, help="serve HTTPS with this PEM private key")
    add("--ssl-certfile", default=None, help="serve HTTPS with this PEM certificate (chain)")
    add("--allowed-origins", action="append", default=None,
        help="allow browsers on these origins (CORS): '*' or https://host[:port]; "
             "repeat or separate with commas")
    add("--max-model-len", type=int, default=None,
        help="context length (default: the model's max_position_embeddings)")
    add("--max-num-seqs", type=int, default=None, help="most requests in one step")
    add("--max-num-batched-tokens", type=int, default=None, help="most tokens in one step")
    add("--block-size", type=int, default=None, help="tokens per KV-cache block (a power of 2)")
    add("--kv-cache-memory", type=parse_memory, default=None,
        help="KV pool budget: bytes ('2GiB', '512MB') or a fraction of free memory ('0.5')")
    add("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
        help="K/V storage: auto (the model dtype), int8 or fp8 (8-bit codes with a scale per "
             "token and head: about half of bf16's memory)")
    add("--max-queued-requests", type=int, default=None,
        help="waiting requests beyond which new ones get 429")
    add("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body accepted; larger gets 413")
    add("--dtype", choices=DTYPES, default=None, help="weight and activation dtype")
    add("--quantization", choices=QUANTIZATIONS, default=None,
        help="auto/gguf: keep a GGUF's quantized blocks (CPU); none: dequantize to --dtype")
    add("--device", default=None, help="auto, cpu, cuda or cuda:N")
    add("--seed", type=int, default=None, help="seed of the engine's sampling generator")
    add("--no-prefix-caching", action="store_true",
        help="do not share KV blocks between requests with a common prefix")
    add("--scheduling-policy", choices=("fcfs", "priority"), default=None,
        help="waiting-queue order: arrival, or the request's priority then arrival")
    add("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
        help="plan step N+1 while step N runs (default: on with CUDA, off on CPU)")
    add("--ops-backend", choices=("auto", "torch", "cpu", "triton"), default=None,
        help="kernels: auto picks triton on CUDA, the C kernels on CPU")
    add("--generation-config", choices=("auto", "none"), default=None,
        help="auto: the model's generation_config.json sampling defaults apply to requests "
             "that leave those fields out (default); none: the engine's own defaults")
    add("--chat-template", default=None,
        help="a jinja chat template (a file, or the template itself) replacing the model's")
    add("--trust-request-chat-template", action="store_true",
        help="let requests send their own chat_template")
    add("--enable-auto-tool-choice", action="store_true",
        help='read tool calls from free text for tool_choice "auto" (needs --tool-call-parser)')
    add("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
        help="how the model writes tool calls (see docs/serving.md)")
    add("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
        help="split <think>...</think> into reasoning_content")
    add("--max-engine-restarts", type=int, default=DEFAULT_MAX_ENGINE_RESTARTS,
        help="restart the engine's actors in place after a crash this many times, then "
             f"exit with status {EXIT_ENGINE_DEAD}")
    add("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT,
        help="seconds in-flight requests get to finish after SIGINT/SIGTERM")
    add("--log-level", default=os.environ.get("ENGINE_LOG_LEVEL", "info"),
        choices=["debug", "info", "warning", "error"], help="logging level")


def api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key, else --api-key-file, else $ENGINE_API_KEY, else None."""
    if args.api_key:
        return str(args.api_key)
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as exc:
            raise InvalidParamError(f"--api-key-file: {exc}", param="api_key_file") from None
        if not key:
            raise InvalidParamError(f"--api-key-file: {args.api_key_file} holds no key",
                                    param="api_key_file")
        return key
    return os.environ.get("ENGINE_API_KEY") or None


def allowed_origins(args: argparse.Namespace) -> tuple[str, ...]:
    """Every --allowed-origins value, commas split, blanks dropped."""
    values = args.allowed_origins or ()
    return tuple(o.strip() for v in values for o in v.split(",") if o.strip())


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields the user set on the command line."""
    options = {k: getattr(args, k) for k in _ENGINE_OPTIONS if getattr(args, k, None) is not None}
    if getattr(args, "no_prefix_caching", False):
        options["enable_prefix_caching"] = False
    return options


def run_serve(args: argparse.Namespace) -> int:
    """Run the server until SIGINT/SIGTERM; return the process exit status."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # engine/__main__.py may have configured the root logger already; the flag wins.
    logging.getLogger().setLevel(args.log_level.upper())
    try:
        return trio.run(_serve, args)
    except EngineError as exc:  # a model that does not load, a bad option
        logger.error("%s", exc)
        return 1
    except ValueError as exc:  # InvalidParamError from EngineConfig
        logger.error("invalid option: %s", exc)
        return 2


def chat_settings(args: argparse.Namespace) -> ChatSettings:
    """The chat flags as :class:`ChatSettings`; ``ValueError`` for a bad combination."""
    template = getattr(args, "chat_template", None)
    return ChatSettings(
        tool_call_parser=getattr(args, "tool_call_parser", None),
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
        reasoning_parser=getattr(args, "reasoning_parser", None),
        chat_template=load_chat_template(template) if template is not None else None,
        trust_request_chat_template=getattr(args, "trust_request_chat_template", False),
    )


async def _serve(args: argparse.Namespace) -> int:
    import engine.api

    settings = chat_settings(args)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        t0 = time.monotonic()
        with _LoadProgress() as progress:
            async with engine.api.open_engine(args.model, **engine_options(args)) as eng:
                progress.close()
                logger.info("engine ready: %s, max_model_len %d (%.2f s)", eng.model_name,
                            eng.max_model_len, time.monotonic() - t0)
                logger.info("sampling defaults from generation_config.json: %s",
                            json.dumps(eng.sampling_defaults) if eng.sampling_defaults else
                            "none" + (" (--generation-config none)"
                                      if eng.config.generation_config == "none" else ""))
                app = create_app(eng, api_key=api_key(args),
                                 max_request_bytes=args.max_request_bytes, chat=settings,
                                 allowed_origins=allowed_origins(args))
                died = await _serve_until_signal(app, args, signals, eng)
        if died:
            return EXIT_ENGINE_DEAD
        logger.info("shut down cleanly")
        return 0


async def _serve_until_signal(
    app: Any, args: argparse.Namespace, signals: Any, eng: Any
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
            await serve_app(app, host=args.host, port=args.port,
                            shutdown_timeout=args.shutdown_timeout,
                            ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                            shutdown_trigger=shutdown_trigger, task_status=task_status)
            # Drained: stop the second-signal watcher so the nursery can close.
            nursery.cancel_scope.cancel()

        t1 = time.monotonic()
        binds = await nursery.start(run_server)
        logger.info("listening on %s (%.2f s)", ", ".join(binds), time.monotonic() - t1)
    return died


async def _cancel_on_second_signal(signals: Any, scope: trio.CancelScope) -> None:
    async for signum in signals:
        logger.warning("%s again: cancelling in-flight requests now",
                       signal.Signals(signum).name)
        scope.cancel()
        return


async def serve_app(
    app: Any, *, host: str, port: int, shutdown_timeout: float,
    shutdown_trigger: Callable[[], Awaitable[None]],
    ssl_keyfile: str | None = None, ssl_certfile: str | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` with hypercorn's trio worker until ``shutdown_trigger`` returns.

    ``task_status.started`` gets the bound URLs (``port=0`` picks a free port). After the
    trigger, new connections are refused and in-flight requests get ``shutdown_timeout``
    seconds before they are cancelled.
    """
    config = HypercornConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.graceful_timeout = shutdown_timeout
    config.accesslog = None
    if bool(ssl_keyfile) != bool(ssl_certfile):
        raise InvalidParamError("TLS needs both --ssl-keyfile and --ssl-certfile",
                                param="ssl_certfile" if ssl_keyfile else "ssl_keyfile")
    # hypercorn serves HTTPS (and offers HTTP/2 through ALPN) when both are set.
    config.keyfile = ssl_keyfile
    config.certfile = ssl_certfile
    edge.hypercorn_limits(config)
    edge.shield_hypercorn_close()
    # Hypercorn's own "Running on" line duplicates ours; its errors still reach the log.
    config.loglevel = "WARNING"
    await hypercorn_serve(app, config, shutdown_trigger=shutdown_trigger,
                          task_status=task_status)


class _LoadProgress:
    """A tqdm bar over the engine's startup phases, advanced by its log lines.

    The loader reports progress as one "engine" log line per phase; this turns those
    lines into a bar on stderr while the model loads (disabled when stderr is no tty).
    """

    # load weights, tokenizer, size the KV pool and build the runner, warm up: the phases
    # the engine logs.
    PHASES = 4

    def __enter__(self) -> _LoadProgress:
        from tqdm import tqdm

        self._bar = tqdm(total=self.PHASES, desc="loading model", unit="phase",
                         leave=False, disable=None)
        self._handler = _PhaseHandler(self._bar)
        logging.getLogger("engine").addHandler(self._handler)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Finish the bar (idempotent): loading is over."""
        logging.getLogger("engine").removeHandler(self._handler)
        self._bar.close()


class _PhaseHandler(logging.Handler):
    def __init__(self, bar: Any) -> None:
        super().__init__(level=logging.INFO)
        self._bar = bar

    def emit(self, record: logging.LogRecord) -> None:
        # Only the engine's own phase lines, not this module's (engine.http).
        if not record.name.startswith("engine.http") and self._bar.n < self._bar.total:
            self._bar.update(1)
