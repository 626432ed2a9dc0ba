"""The quart-trio app: the API families' routes over the embedded engine API.

:func:`create_app` builds one :class:`engine.http.server.Server` (the engine, the server's
settings, the request plumbing) and hands it to each family, whose routes object adds its
URL rules with ``register(app)``:

==========================================  =============================================
family                                      routes
==========================================  =============================================
:mod:`engine.http.completions.routes`       ``/v1/completions``, ``/v1/chat/completions``,
                                            their ``/render`` routes,
                                            ``/inference/v1/generate``
:mod:`engine.http.anthropic.routes`         ``/v1/messages``, ``/v1/messages/count_tokens``
:mod:`engine.http.responses.routes`         ``/v1/responses`` and a stored response's
                                            ``GET``, ``DELETE``, ``/input_items`` and
                                            ``/cancel``
:mod:`engine.http.pooling.routes`           ``/v1/embeddings``, ``/v1/score``,
                                            ``/v1/rerank`` (and vLLM's other paths)
:mod:`engine.http.audio`                    ``/v1/audio/transcriptions``,
                                            ``/v1/audio/translations`` (Whisper)
:mod:`engine.http.admin`                    ``/health``, ``/ping``, ``/version``,
                                            ``/metrics``, ``/v1/models``, ``/load``,
                                            ``/openapi.json``, ``/tokenize``,
                                            ``/detokenize``, ``/tokenizer_info``
:mod:`engine.http.invocations`              ``/invocations`` (SageMaker)
==========================================  =============================================

What every route shares is here: the header limits and the API key before each request,
the error bodies (OpenAI's, or Anthropic's on ``/v1/messages*``), the ``X-Request-Id``
echo, ``--root-path``, CORS, the connection that drains and cleans up, and the 400 that
answers a WebSocket handshake on any route (no route speaks WebSocket).

Request lifetime and cancellation
---------------------------------
quart-trio runs each HTTP request's handler *and* the sending of its response body in one
nursery next to a task that reads the connection; when the client disconnects that
nursery is cancelled. So:

* a non-streamed request waits for the engine inside the handler: a disconnect cancels the
  wait, ``async with stream`` aborts the request and the engine frees its KV blocks;
* a streamed request is submitted in the handler (so bad input is still a 4xx), and its
  outputs are pumped, in the task that sends the response, by the producer of its
  :class:`engine.http.bodies.TaskBody`, which writes each frame to the connection itself;
  a disconnect cancels that task the same way.
* A disconnect after the handler returned but before the body was entered would leave the
  submitted streams open; :class:`_Connection` aborts them in that case.
* A client that stops reading is treated as gone once one write to it has waited
  ``send_timeout`` seconds (see ``engine.http.edge``): the response is abandoned the same
  way, so its requests are aborted and their KV blocks freed.

Nothing heavy runs on the event loop: a body is parsed, checked and turned into engine
prompts in a worker thread (at most :data:`engine.http.server.PARSE_THREADS` at once), and
chat templates and long prompts are tokenized in others (``engine.api.tokenize_prompt``),
so ``/health`` and ``/metrics`` answer while any of them works.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import quart_cors
import trio
from quart import Response, g, request
from quart.utils import encode_headers
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection
from werkzeug.exceptions import HTTPException

from engine.chat.request import ChatSettings
from engine.http import auth, edge, sse
from engine.http.admin import AdminRoutes
from engine.http.anthropic.protocol import error_body as anthropic_error_body
from engine.http.anthropic.routes import AnthropicRoutes
from engine.http.audio import AudioRoutes
from engine.http.bodies import TaskBody, json_response
from engine.http.completions.routes import CompletionsRoutes
from engine.http.errors import LOGGED_ELSEWHERE, APIError, error_from_exception
from engine.http.invocations import InvocationsRoute
from engine.http.middleware import Wrap, wrap_app
from engine.http.pooling.routes import PoolingRoutes
from engine.http.responses.routes import ResponsesRoutes
from engine.http.server import REQUEST_ID_HEADER, Server

if TYPE_CHECKING:
    from engine.api import EngineLike

logger = logging.getLogger("engine.http")

# 4 MiB: a full 128k-token context of text is ~0.5 MiB of JSON, or ~1 MiB as token ids;
# anything far beyond that is a mistake or abuse, not a prompt.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
# Retry-After on 429 (queue full) and 503 (restarting): whole seconds per RFC 9110; one is
# the shortest, and a step or a restart takes well under it.
RETRY_AFTER_SECONDS = 1
# Routes that answer errors in Anthropic's shape.
_ANTHROPIC_PATHS = "/v1/messages"


def create_app(
    engine: EngineLike, *, api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, chat: ChatSettings | None = None,
    allowed_origins: tuple[str, ...] = (), root_path: str = "",
    enable_request_id_headers: bool = False, metrics_prefix: str = "engine", send_timeout: float = edge.SEND_TIMEOUT_SECONDS,
    allow_runtime_lora_updating: bool = False, server_dev_mode: bool = False,
    middleware: Sequence[Wrap] = (),
) -> QuartTrio:
    """Build the OpenAI-compatible app serving ``engine`` (an open :class:`engine.api.Engine`).

    ``api_key`` (when set) is required as ``Authorization: Bearer <key>`` on every route
    but ``/health``, ``/ping`` and ``/metrics``. Bodies over ``max_request_bytes`` get a
    413. ``chat`` holds the chat flags (tool-call and reasoning parsers, chat template,
    tool limits).
    ``allowed_origins`` (``"*"`` or full origins like ``https://app.example``) turns on
    CORS for browsers on those origins (quart-cors; preflights need no API key).
    ``root_path`` (``/llm``) is the prefix a proxy serves the app under: every route
    answers with and without it, as vLLM's ``--root-path``. ``enable_request_id_headers``
    puts an ``X-Request-Id`` on every response, a fresh one where the client sent none.
    ``metrics_prefix`` names the Prometheus series ``engine:*`` or, as vLLM's, ``vllm:*``.
    A response one of whose writes waits ``send_timeout`` seconds for the client to
    read is abandoned (its requests aborted). ``allow_runtime_lora_updating`` serves
    ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``; ``server_dev_mode``
    ``POST /reset_prefix_cache``. An engine with a ``profiler_config`` gets vLLM's
    ``POST /start_profile`` and ``/stop_profile``. ``middleware`` (from
    :func:`engine.http.middleware.load_middleware`, vLLM's ``--middleware``) goes around
    everything, the last outermost.
    """
    app = _App(__name__)
    app.root_prefix = _root_prefix(root_path)
    # Generations can take minutes; the engine's own limits bound a request, not a timer.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["MAX_CONTENT_LENGTH"] = max_request_bytes
    app.config["BODY_TIMEOUT"] = edge.BODY_TIMEOUT_SECONDS
    app.config[edge.SEND_TIMEOUT_CONFIG] = send_timeout
    server = Server(engine, api_key=api_key, max_request_bytes=max_request_bytes,
                    chat=chat or ChatSettings(),
                    enable_request_id_headers=enable_request_id_headers,
                    metrics_prefix=metrics_prefix,
                    allow_runtime_lora_updating=allow_runtime_lora_updating,
                    server_dev_mode=server_dev_mode)
    _Hooks(server).register(app)
    completions = CompletionsRoutes(server)
    pooling = PoolingRoutes(server)
    responses = ResponsesRoutes(server)
    for routes in (completions, AnthropicRoutes(server), responses, pooling, AudioRoutes(server),
                   AdminRoutes(server), InvocationsRoute(server, completions, pooling)):
        routes.register(app)
    # The /v1/responses store, for tests and operators' introspection (statistics()).
    app.extensions["responses_store"] = responses.store
    # The server's metrics, which the periodic stats line (stats_log.StatsLog) reads.
    app.extensions["metrics"] = server.metrics
    if allowed_origins:
        quart_cors.cors(
            app, allow_origin=list(allowed_origins),
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            # x-api-key and anthropic-version: what Anthropic's clients send.
            allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version"],
        )
    wrap_app(app, middleware)
    return app


class _Connection(TrioASGIHTTPConnection):
    """quart-trio's HTTP connection, draining a request body that an early answer left
    unread (see ``engine.http.edge``), and closing the engine streams of a response whose
    body was never sent (the client left between the handler's return and the body)."""

    async def handle_request(self, nursery: trio.Nursery, request: Any, send: Any) -> None:  # type: ignore[override]
        # quart-trio's own version, minus per-response timeouts (RESPONSE_TIMEOUT is None
        # here), plus the drain. hypercorn closes the connection when a response ends
        # while the request body is unfinished, so the drain goes before the response's
        # last message: the client already has the whole answer (its length is known).
        response = await self.app.handle_request(request)
        send_timeout = self.app.config[edge.SEND_TIMEOUT_CONFIG]
        # HTTP/1 writes go straight to the socket, where edge.shield_hypercorn_close bounds
        # each by the same --send-timeout; only an HTTP/2 stream can wait in hypercorn (on
        # its flow-control window), so only there does the application time its sends. A
        # timer per streamed token was about a twentieth of the event loop's CPU time at
        # concurrency 32 (docs/benchmarks.md, issue 42).
        timed = not str(getattr(request, "http_version", "")).startswith("1")

        async def send_after_drain(message: Any) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                await edge.drain_unread_body(request)
            if timed:
                await edge.send_within(send, message, send_timeout)
            else:
                await send(message)

        try:
            body = getattr(response, "response", None)
            if isinstance(body, TaskBody):
                await self._send_task_body(send_after_drain, response, body)
            else:
                await self._send_response(send_after_drain, response)
        except* edge.SlowReaderError as group:
            # The client stopped reading: leave the response unfinished (hypercorn then
            # closes the HTTP/1 connection, or resets the HTTP/2 stream); a streamed body's
            # nursery has aborted its requests on the way out.
            logger.warning("%s %s: %s; response abandoned", request.method, request.path,
                           group.exceptions[0])
        finally:
            body = getattr(response, "response", None)
            if isinstance(body, TaskBody):
                with trio.CancelScope(shield=True):  # cleanup that must finish
                    await body.close_unsent()
        nursery.cancel_scope.cancel()

    @staticmethod
    async def _send_task_body(send: Any, response: Any, body: TaskBody) -> None:
        """quart's ``_send_response`` for a streamed body, its frames written by the
        producer's own task (:meth:`TaskBody.write_into`): the same ASGI messages."""
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": encode_headers(response.headers)})

        async def write(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        await body.write_into(write)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _root_prefix(root_path: str) -> str:
    """``--root-path`` as a prefix to strip: ``/llm`` (no trailing slash), or ``""``."""
    prefix = root_path.strip().rstrip("/")
    if prefix and not prefix.startswith("/"):
        prefix = "/" + prefix
    return prefix


class _App(QuartTrio):
    asgi_http_class = _Connection
    request_class = edge.EdgeRequest
    root_prefix = ""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:  # type: ignore[override]
        if scope.get("type") == "websocket":
            # No route speaks WebSocket. Left to quart, the handshake reached the error
            # handler outside a request context and became a 500 with tracebacks.
            await _refuse_websocket(scope, receive, send)
            return
        # Behind a proxy that keeps the prefix (/llm/v1/...) as well as one that strips it:
        # the routes see the path without it.
        prefix = self.root_prefix
        if prefix and scope.get("type") == "http":
            path = scope.get("path", "")
            if path == prefix or path.startswith(prefix + "/"):
                rest = path[len(prefix):] or "/"
                scope = {**scope, "path": rest, "raw_path": rest.encode()}
        await super().__call__(scope, receive, send)


_WEBSOCKET_REFUSAL = APIError(
    400, "This server does not serve WebSocket connections: send the request over plain "
    "HTTP, without Upgrade: websocket.", code="websocket_not_supported")


async def _refuse_websocket(scope: Any, receive: Any, send: Any) -> None:
    """Answer a WebSocket handshake (HTTP/1.1 ``Upgrade: websocket`` or HTTP/2's extended
    CONNECT, on any route) with a 400 in OpenAI's error shape, as the ASGI spec's
    ``websocket.http.response`` extension lets a server deny one; the connection is then
    closed (hypercorn's rule for a refused upgrade)."""
    await receive()  # websocket.connect: the handshake is complete
    if "websocket.http.response" not in scope.get("extensions", {}):
        # A server without the extension (hypercorn has it) answers a close with a 403.
        await send({"type": "websocket.close"})
        return
    data = sse.dumps(_WEBSOCKET_REFUSAL.body())
    await send({"type": "websocket.http.response.start", "status": _WEBSOCKET_REFUSAL.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "websocket.http.response.body", "body": data})


class _Hooks:
    """The app-wide hooks: the header limits and the API key before every request, the
    error bodies, and the ``X-Request-Id`` echo after."""

    def __init__(self, server: Server) -> None:
        self.server = server

    def register(self, app: QuartTrio) -> None:
        app.before_request(self.check_auth)
        app.register_error_handler(Exception, self.error_response)
        app.after_request(self.echo_request_id)

    async def check_auth(self) -> None:
        # h11 bounds a head that arrives in pieces; one that arrives whole is checked here.
        size = sum(len(k) + len(v) for k, v in request.headers.items())
        if len(request.headers) > edge.MAX_HEADERS or size > edge.MAX_HEADER_BYTES:
            raise APIError(431, f"The request headers are too large ({len(request.headers)} "
                           f"headers, {size} bytes; at most {edge.MAX_HEADERS} headers and "
                           f"{edge.MAX_HEADER_BYTES} bytes).", code="headers_too_large")
        if request.method == "OPTIONS":
            return  # a CORS preflight carries no credentials; the request it announces does
        api_key = self.server.api_key
        if api_key is None:
            return  # no --api-key: nothing to compare (two header lookups a request saved)
        if not (auth.authorized(api_key, request.path, request.headers.get("Authorization"))
                or auth.key_matches(api_key, request.headers.get("x-api-key"))):
            raise APIError(401, "Invalid or missing API key (Authorization: Bearer <key>, "
                           "or x-api-key: <key>).", code="invalid_api_key")

    async def error_response(self, exc: Exception) -> Response:
        if isinstance(exc, HTTPException):
            err = APIError(exc.code or 500, exc.description or exc.name,
                           code=exc.name.lower().replace(" ", "_"))
        else:
            err = error_from_exception(exc)
            if err.status >= 500 and err.code not in LOGGED_ELSEWHERE:
                logger.error("unhandled error in %s %s", request.method, request.path,
                             exc_info=exc)
        # The matched route, not the raw path (which a --root-path prefix may lead).
        rule = getattr(request.url_rule, "rule", None) or request.path
        body = anthropic_error_body(err) if rule.startswith(_ANTHROPIC_PATHS) else err.body()
        response = json_response(body, err.status)
        if err.status in (429, 503):
            # The queue drains in about a step; a restart takes about as long. Clients
            # (the openai library among them) honour this before retrying.
            response.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
        return response

    async def echo_request_id(self, response: Response) -> Response:
        request_id = request.headers.get(REQUEST_ID_HEADER)
        if request_id is None and self.server.enable_request_id_headers:
            # The id the request ran under when it generated, else a fresh one.
            request_id = getattr(g, "request_id", None) or uuid.uuid4().hex
        if request_id is not None:
            response.headers[REQUEST_ID_HEADER] = request_id
        return response
