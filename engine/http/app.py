"""The quart-trio app: OpenAI routes over the embedded engine API.

Request lifetime and cancellation
---------------------------------
quart-trio runs each HTTP request's handler *and* the sending of its response body in one
nursery next to a task that reads the connection; when the client disconnects that
nursery is cancelled. So:

* a non-streamed request waits for the engine inside the handler: a disconnect cancels the
  wait, ``async with stream`` aborts the request and the engine frees its KV blocks;
* a streamed request is submitted in the handler (so bad input is still a 4xx), and its
  outputs are pumped by tasks in a nursery that :class:`_TaskBody` opens while quart sends
  the body; a disconnect cancels those tasks the same way.
* A disconnect after the handler returned but before the body was entered would leave the
  submitted streams open; :class:`_Connection` aborts them in that case.
* A client that stops reading is treated as gone once one write to it has waited
  ``send_timeout`` seconds (see ``engine.http.edge``): the response is abandoned the same
  way, so its requests are aborted and their KV blocks freed.

Nothing heavy runs on the event loop: a body is parsed, checked and turned into engine
prompts in a worker thread (at most :data:`PARSE_THREADS` at once), and chat templates and
long prompts are tokenized in others (``engine.api.tokenize_prompt``), so ``/health`` and
``/metrics`` answer while any of them works.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any, TypeVar

import trio
from quart import Response, g, request
from quart.wrappers.response import ResponseBody
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from engine.api import PROMPT_THREADS, tokenize_prompt
from engine.chat.output import ChatOutputParser
from engine.chat.request import (
    ChatSettings,
    calls_constrained,
    check_tool_limits,
    parse_chat_fields,
    thinking_budget_params,
)
from engine.core import admission
from engine.errors import EngineDeadError, InvalidParamError
from engine.http import auth, edge, schema, sse
from engine.http.anthropic import protocol as anthropic
from engine.http.completions import answer, protocol, tokens
from engine.http.completions.protocol import CompletionRequest
from engine.http.errors import LOGGED_ELSEWHERE, APIError, error_from_exception
from engine.http.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from engine.http.metrics import Metrics, RequestTimer
from engine.http.pooling import protocol as pooling_http
from engine.http.responses import protocol as responses
from engine.http.responses.builder import ResponseBuilder, input_items_page
from engine.http.responses.store import MissingResponse, ResponseStore
from engine.http.strict_json import loads_body
from engine.messages import RequestOutput
from engine.models.tokenizer import normalize_messages
from engine.multimodal import has_images

if TYPE_CHECKING:
    from engine.api import EngineLike, StreamLike

logger = logging.getLogger("engine.http")

# 4 MiB: a full 128k-token context of text is ~0.5 MiB of JSON, or ~1 MiB as token ids;
# anything far beyond that is a mistake or abuse, not a prompt.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
# Retry-After on 429 (queue full) and 503 (restarting): whole seconds per RFC 9110; one is
# the shortest, and a step or a restart takes well under it.
RETRY_AFTER_SECONDS = 1
# Routes that answer errors in Anthropic's shape.
_ANTHROPIC_PATHS = "/v1/messages"

# A client's request id (echoed on the response, and the engine's id for the request), as
# vLLM and most gateways name it.
REQUEST_ID_HEADER = "X-Request-Id"
# ORCA load reports (vLLM's and Envoy's names): the request header asks for one, in "text"
# or "json", on the response's header.
ORCA_FORMAT_HEADER = "endpoint-load-metrics-format"
ORCA_HEADER = "endpoint-load-metrics"
# Long enough for any UUID-with-prefix scheme; short enough to keep out of the way in logs.
_MAX_REQUEST_ID = 256
# Worker threads parsing request bodies at once (JSON, schema, tools), apart from trio's
# default pool. A body is bounded by --max-request-bytes and MAX_JSON_VALUES, so each takes
# at most about a second; more at once would only share the GIL.
PARSE_THREADS = 4
# Bodies up to this size are parsed on the event loop: a few milliseconds at most, less
# than the thread hop costs. Hopping every request to a thread cut the soak's throughput
# by a fifth and grew the server's RSS without bound (1.08 GB flat became 1.7 GB rising
# over 90 s); a larger body, where the work is, still goes to a thread.
INLINE_BODY_BYTES = 64 * 1024

T = TypeVar("T")


def create_app(
    engine: EngineLike, *, api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, chat: ChatSettings | None = None,
    allowed_origins: tuple[str, ...] = (), root_path: str = "",
    enable_request_id_headers: bool = False, metrics_prefix: str = "engine", send_timeout: float = edge.SEND_TIMEOUT_SECONDS,
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
    read is abandoned (its requests aborted).
    """
    app = _App(__name__)
    app.root_prefix = _root_prefix(root_path)
    # Generations can take minutes; the engine's own limits bound a request, not a timer.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["MAX_CONTENT_LENGTH"] = max_request_bytes
    app.config["BODY_TIMEOUT"] = edge.BODY_TIMEOUT_SECONDS
    app.config[edge.SEND_TIMEOUT_CONFIG] = send_timeout
    server = _Server(engine, api_key=api_key, max_request_bytes=max_request_bytes,
                     chat=chat or ChatSettings(),
                     enable_request_id_headers=enable_request_id_headers,
                     metrics_prefix=metrics_prefix)
    server.register(app)
    # The /v1/responses store, for tests and operators' introspection (statistics()).
    app.extensions["responses_store"] = server.responses
    if allowed_origins:
        import quart_cors

        quart_cors.cors(
            app, allow_origin=list(allowed_origins),
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            # x-api-key and anthropic-version: what Anthropic's clients send.
            allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version"],
        )
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

        async def send_after_drain(message: Any) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                await edge.drain_unread_body(request)
            await edge.send_within(send, message, send_timeout)

        try:
            await self._send_response(send_after_drain, response)
        except* edge.SlowReaderError as group:
            # The client stopped reading: leave the response unfinished (hypercorn then
            # closes the HTTP/1 connection, or resets the HTTP/2 stream); a streamed body's
            # nursery has aborted its requests on the way out.
            logger.warning("%s %s: %s; response abandoned", request.method, request.path,
                           group.exceptions[0])
        finally:
            body = getattr(response, "response", None)
            if isinstance(body, _TaskBody):
                with trio.CancelScope(shield=True):  # cleanup that must finish
                    await body.close_unsent()
        nursery.cancel_scope.cancel()


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
        # Behind a proxy that keeps the prefix (/llm/v1/...) as well as one that strips it:
        # the routes see the path without it.
        prefix = self.root_prefix
        if prefix and scope.get("type") == "http":
            path = scope.get("path", "")
            if path == prefix or path.startswith(prefix + "/"):
                rest = path[len(prefix):] or "/"
                scope = {**scope, "path": rest, "raw_path": rest.encode()}
        await super().__call__(scope, receive, send)


Produce = Callable[[trio.MemorySendChannel[bytes]], Awaitable[None]]


class _TaskBody(ResponseBody):
    """A response body written by a task that runs while quart sends it.

    Entering the body opens a nursery in the sending task (so the producer is cancelled
    with the connection) and starts ``produce(send_channel)``; the body yields what the
    producer sends until it closes the channel. ``on_unsent`` runs if the body is never
    entered.
    """

    def __init__(self, produce: Produce, on_unsent: Callable[[], Awaitable[None]]) -> None:
        self._produce = produce
        self._on_unsent = on_unsent
        self._entered = False
        self._manager: Any = None
        self._nursery: trio.Nursery | None = None
        self._receive: trio.MemoryReceiveChannel[bytes] | None = None

    async def __aenter__(self) -> _TaskBody:
        self._entered = True
        # Unbuffered: back-pressure from a slow client reaches the engine's bounded
        # per-request channel instead of piling up here.
        send, self._receive = trio.open_memory_channel[bytes](0)
        self._manager = trio.open_nursery()
        self._nursery = await self._manager.__aenter__()
        self._nursery.start_soon(self._produce, send)
        return self

    # quart types this as returning None; the nursery's answer (whether it handled the
    # exception) has to be passed on, so this returns it.
    async def __aexit__(self, *exc_info: Any) -> bool:  # type: ignore[override]
        assert self._nursery is not None and self._receive is not None  # set by __aenter__
        # Leaving before the producer finished (send failed, cancelled): stop it.
        self._nursery.cancel_scope.cancel()
        self._receive.close()
        return bool(await self._manager.__aexit__(*exc_info))

    def __aiter__(self) -> trio.MemoryReceiveChannel[bytes]:
        assert self._receive is not None
        return self._receive

    async def close_unsent(self) -> None:
        if not self._entered:
            await self._on_unsent()


class _Server:
    """Route handlers bound to one engine."""

    def __init__(self, engine: EngineLike, *, api_key: str | None, max_request_bytes: int,
                 chat: ChatSettings, enable_request_id_headers: bool = False,
                 metrics_prefix: str = "engine") -> None:
        self.engine = engine
        self.enable_request_id_headers = enable_request_id_headers
        # Generation requests in flight (submitted, not yet answered or streamed to the
        # end): GET /load, as vLLM's server-load tracking counts them.
        self.in_flight = 0
        self.chat_settings = chat
        # The model's sampling defaults (--generation-config auto), for fields a body omits.
        self.sampling_defaults: dict[str, Any] = dict(engine.sampling_defaults)
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.metrics = Metrics(engine, engine.model_name, prefix=metrics_prefix)
        config = engine.config
        self.answer_options = answer.AnswerOptions(
            prompt_tokens_details=config.enable_prompt_tokens_details,
            force_include_usage=config.enable_force_include_usage,
            tokens_as_token_ids=config.return_tokens_as_token_ids)
        # /v1/responses' store: in memory, bounded, lost on restart (docs/serving.md).
        self.responses = ResponseStore(engine.config.responses_store_bytes,
                                       engine.config.responses_store_ttl)
        self.parse_limiter = trio.CapacityLimiter(PARSE_THREADS)
        self.prompt_limiter = trio.CapacityLimiter(PROMPT_THREADS)
        try:
            self.version = importlib.metadata.version("engine")
        except importlib.metadata.PackageNotFoundError:
            self.version = "unknown"

    def register(self, app: QuartTrio) -> None:
        app.before_request(self._check_auth)
        app.register_error_handler(Exception, self._error_response)
        app.add_url_rule("/v1/completions", view_func=self.completions, methods=["POST"])
        app.add_url_rule("/v1/chat/completions", view_func=self.chat, methods=["POST"])
        app.add_url_rule("/v1/messages", view_func=self.messages, methods=["POST"])
        app.add_url_rule("/v1/messages/count_tokens", view_func=self.count_tokens,
                         methods=["POST"])
        app.add_url_rule("/v1/responses", view_func=self.create_response, methods=["POST"])
        app.add_url_rule("/v1/responses/<response_id>", view_func=self.get_response,
                         methods=["GET"])
        app.add_url_rule("/v1/responses/<response_id>", view_func=self.delete_response,
                         methods=["DELETE"])
        app.add_url_rule("/v1/responses/<response_id>/input_items",
                         view_func=self.response_input_items, methods=["GET"])
        app.add_url_rule("/v1/models", view_func=self.models, methods=["GET"])
        app.add_url_rule("/v1/models/<path:model_id>", view_func=self.model_card,
                         methods=["GET"])
        app.add_url_rule("/health", view_func=self.health, methods=["GET"])
        app.add_url_rule("/ping", view_func=self.health, methods=["GET", "POST"])
        app.after_request(self._echo_request_id)
        app.add_url_rule("/version", view_func=self.version_route, methods=["GET"])
        app.add_url_rule("/metrics", view_func=self.metrics_route, methods=["GET"])
        app.add_url_rule("/tokenize", view_func=self.tokenize, methods=["POST"])
        app.add_url_rule("/v1/embeddings", view_func=self.embeddings, methods=["POST"])
        # vLLM's paths for the same two routes, with and without the version.
        for path in ("/v1/score", "/score"):
            app.add_url_rule(path, view_func=self.score, methods=["POST"])
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            app.add_url_rule(path, view_func=self.rerank, methods=["POST"])
        app.add_url_rule("/detokenize", view_func=self.detokenize, methods=["POST"])
        app.add_url_rule("/openapi.json", view_func=self.openapi, methods=["GET"])
        if self.engine.config.enable_tokenizer_info_endpoint:
            app.add_url_rule("/tokenizer_info", view_func=self.tokenizer_info, methods=["GET"])
        app.add_url_rule("/load", view_func=self.load, methods=["GET"])
        app.add_url_rule("/invocations", view_func=self.invocations, methods=["POST"])
        app.add_url_rule("/inference/v1/generate", view_func=self.generate_tokens,
                         methods=["POST"])
        app.add_url_rule("/v1/chat/completions/render", view_func=self.render_chat,
                         methods=["POST"])
        app.add_url_rule("/v1/completions/render", view_func=self.render_completions,
                         methods=["POST"])

    # -- plumbing ---------------------------------------------------------------------

    async def _check_auth(self) -> None:
        # h11 bounds a head that arrives in pieces; one that arrives whole is checked here.
        size = sum(len(k) + len(v) for k, v in request.headers.items())
        if len(request.headers) > edge.MAX_HEADERS or size > edge.MAX_HEADER_BYTES:
            raise APIError(431, f"The request headers are too large ({len(request.headers)} "
                           f"headers, {size} bytes; at most {edge.MAX_HEADERS} headers and "
                           f"{edge.MAX_HEADER_BYTES} bytes).", code="headers_too_large")
        if request.method == "OPTIONS":
            return  # a CORS preflight carries no credentials; the request it announces does
        if not (auth.authorized(self.api_key, request.path, request.headers.get("Authorization"))
                or auth.key_matches(self.api_key, request.headers.get("x-api-key"))):
            raise APIError(401, "Invalid or missing API key (Authorization: Bearer <key>, "
                           "or x-api-key: <key>).", code="invalid_api_key")

    async def _error_response(self, exc: Exception) -> Response:
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
        body = anthropic.error_body(err) if rule.startswith(_ANTHROPIC_PATHS) else err.body()
        response = _json(body, err.status)
        if err.status in (429, 503):
            # The queue drains in about a step; a restart takes about as long. Clients
            # (the openai library among them) honour this before retrying.
            response.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
        return response

    async def _read_body(self) -> bytes:
        """The body's bytes: refused with a 413 past --max-request-bytes, counted as they
        arrive (quart stops storing a body once it is over the limit)."""
        length = request.content_length
        if length is not None and length > self.max_request_bytes:
            raise self._too_large(length)
        try:
            data = await request.get_data(as_text=False)
        except RequestEntityTooLarge:
            raise self._too_large(None) from None
        data = data if isinstance(data, bytes) else data.encode()
        g.engine_body_bytes = len(data)
        return data

    async def _off_loop(self, work: Callable[[], T]) -> T:
        """``work()`` (pure request parsing) in a worker thread under the parse limiter,
        for a body over :data:`INLINE_BODY_BYTES`; a smaller one's here. A cancelled
        caller need not wait for it; the limiter holds its slot until the thread ends, so
        abandoned work still counts."""
        if getattr(g, "engine_body_bytes", 0) <= INLINE_BODY_BYTES:
            await trio.lowlevel.checkpoint()
            return work()
        return await trio.to_thread.run_sync(work, limiter=self.parse_limiter,
                                             abandon_on_cancel=True)

    async def _read_json(self) -> Any:
        """The body as JSON (``loads_body``), decoded in a worker thread."""
        data = await self._read_body()
        return await self._off_loop(lambda: loads_body(data))

    async def _read_checked(self, name: str) -> Any:
        """The body, checked against its JSON Schema (the one /openapi.json publishes),
        in a worker thread."""
        data = await self._read_body()
        return await self._off_loop(lambda: self._checked(loads_body(data), name))

    def _checked(self, body: Any, name: str) -> Any:
        if name == "chat" and isinstance(body, dict):
            # Before the schema check, which would read each of 60,000 tools.
            check_tool_limits(body.get("tools"), self.chat_settings)
        schema.check_body(body, name)
        return body

    def _too_large(self, length: int | None) -> APIError:
        size = f" ({length} bytes)" if length is not None else ""
        return APIError(413, f"The request body{size} is over the limit of "
                        f"{self.max_request_bytes} bytes.", code="request_too_large")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.engine.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                           f"`{self.engine.model_name}`.", param="model",
                           code="model_not_found")

    def _token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- small routes -----------------------------------------------------------------

    async def health(self) -> Response:
        # 503 while the actors restart after a crash, and once the engine is dead.
        if self.engine.dead or self.engine.restarting:
            err = error_from_exception(
                EngineDeadError())
            return _json(err.body(), 503)
        return _json({"status": "ok"}, 200)

    async def version_route(self) -> Response:
        return _json({"version": self.version}, 200)

    async def metrics_route(self) -> Response:
        return Response(self.metrics.render(), 200, content_type=METRICS_CONTENT_TYPE)

    def _card(self) -> dict[str, Any]:
        eng = self.engine
        return {
            "id": eng.model_name, "object": "model", "created": answer.now(),
            "owned_by": "engine", "root": eng.config.model or eng.model_name, "parent": None,
            "max_model_len": eng.max_model_len,
        }

    async def models(self) -> Response:
        return _json({"object": "list", "data": [self._card()]}, 200)

    async def model_card(self, model_id: str) -> Response:
        if model_id != self.engine.model_name:
            raise APIError(404, f"The model `{model_id}` does not exist; this server serves "
                           f"`{self.engine.model_name}`.", param="model",
                           code="model_not_found")
        return _json(self._card(), 200)

    async def _echo_request_id(self, response: Response) -> Response:
        request_id = request.headers.get(REQUEST_ID_HEADER)
        if request_id is None and self.enable_request_id_headers:
            # The id the request ran under when it generated, else a fresh one.
            request_id = getattr(g, "request_id", None) or uuid.uuid4().hex
        if request_id is not None:
            response.headers[REQUEST_ID_HEADER] = request_id
        return response

    def _request_id(self) -> str | None:
        """The client's ``X-Request-Id``, used as the engine's request id (checked: ids
        show up in logs and metrics labels-free, so printable ASCII only). With
        ``--enable-request-id-headers`` a request without one gets a fresh id, which the
        response's header then carries."""
        value = request.headers.get(REQUEST_ID_HEADER)
        if value is None:
            if self.enable_request_id_headers:
                g.request_id = uuid.uuid4().hex
                return str(g.request_id)
            return None
        if not 0 < len(value) <= _MAX_REQUEST_ID or not value.isascii() or not value.isprintable():
            raise APIError(400, f"{REQUEST_ID_HEADER} must be 1-{_MAX_REQUEST_ID} printable "
                           "ASCII characters", param=REQUEST_ID_HEADER, code="invalid_value")
        return value

    async def openapi(self) -> Response:
        return _json(schema.openapi(
            self.version, api_key=self.api_key is not None,
            tokenizer_info=self.engine.config.enable_tokenizer_info_endpoint), 200)

    async def tokenize(self) -> Response:
        tok = self.engine.tokenizer

        def parse(body: dict[str, Any]) -> tuple[Any, Any, bool]:
            if "messages" in body:
                fields = parse_chat_fields(body, self.chat_settings, tok.chat_template)
                messages = normalize_messages(body["messages"], images=True)
                if has_images(messages):  # the engine widens each image to its placeholders
                    return (messages, fields.template), True
                return admission.prompt_message(messages, fields.template.to_json()), True
            if isinstance(body.get("prompt"), str):
                return (admission.prompt_message(body["prompt"]),
                        bool(body.get("add_special_tokens", True)))
            raise APIError(400, "tokenize needs a string `prompt` or `messages`",
                           param="prompt", code="invalid_type")

        body = await self._read_checked("tokenize")
        self._check_model(body.get("model"))
        return_strs = body.get("return_token_strs")
        prompt, add_special_tokens = await self._off_loop(lambda: parse(body))
        # Generation's own path (admission), with its guards.
        if isinstance(prompt, tuple):  # chat messages with images: as vLLM, the count
            ids = await self.engine.tokenize_chat(*prompt)  # holds their placeholders
        else:
            ids = await tokenize_prompt(
                tok, prompt, limiter=self.prompt_limiter, add_special_tokens=add_special_tokens,
                template_seconds=self.engine.config.chat_template_timeout,
                max_model_len=self.engine.max_model_len,
                special_tokens_in_content=self.engine.config.allow_special_tokens_in_content)
        # vLLM's token_strs: each token as the vocabulary spells it (return_token_strs).
        strs = tok.convert_ids_to_tokens(ids) if return_strs else None
        return _json({"count": len(ids), "max_model_len": self.engine.max_model_len,
                      "tokens": list(ids), "token_strs": strs}, 200)

    async def tokenizer_info(self) -> Response:
        """The tokenizer's configuration (tokenizer_config.json, as vLLM's route gives it)
        and the chat template this server renders with."""
        tok = self.engine.tokenizer
        info = {k: v for k, v in tok.tokenizer_config.items()
                if k not in ("vocab_file", "merges_file", "chat_template")}
        info.setdefault("tokenizer_class", type(tok).__name__)
        template = self.chat_settings.chat_template or tok.chat_template
        if template is not None:
            info["chat_template"] = template
        return _json(info, 200)

    async def detokenize(self) -> Response:
        tok = self.engine.tokenizer
        vocab = tok.vocab_size

        def decode(tokens: Any) -> str:
            if not (isinstance(tokens, list)
                    and all(protocol.is_token_id(t) and t < vocab for t in tokens)):
                raise APIError(400, f"tokens must be a list of token ids below {vocab}",
                               param="tokens", code="invalid_value")
            return tok.decode(tokens)

        body = await self._read_checked("detokenize")
        self._check_model(body.get("model"))
        return _json({"prompt": await self._off_loop(lambda: decode(body.get("tokens")))}, 200)

    # -- pooling ------------------------------------------------------------------------
    # Each waits for its answer in the handler: a disconnect cancels the wait, and
    # Engine.pool's cleanup aborts the inputs still running and frees their blocks.

    async def embeddings(self) -> Response:
        return await self._embeddings_body(await self._read_checked("embeddings"))

    async def _embeddings_body(self, body: Any) -> Response:
        req = pooling_http.parse_embedding(body)
        self._check_model(req.model)
        timer = self.metrics.timer()
        pooled = await self.engine.embed(
            req.input, dimensions=req.dimensions, truncate_prompt_tokens=req.truncate_prompt_tokens,
            request_id=self._request_id(), priority=req.priority)
        self._observe(timer, [p.prompt_tokens for p in pooled])
        return _json(pooling_http.embedding_response(self.engine.model_name, pooled,
                                                     req.encoding_format), 200)

    async def score(self) -> Response:
        req = pooling_http.parse_score(await self._read_checked("score"))
        self._check_model(req.model)
        timer = self.metrics.timer()
        scores = await self.engine.score(
            req.first, req.second, truncate_prompt_tokens=req.truncate_prompt_tokens,
            request_id=self._request_id(), priority=req.priority)
        self._observe(timer, [n for _, n in scores])
        return _json(pooling_http.score_response(self.engine.model_name, scores), 200)

    async def rerank(self) -> Response:
        req = pooling_http.parse_rerank(await self._read_checked("rerank"))
        self._check_model(req.model)
        timer = self.metrics.timer()
        scores = await self.engine.score(
            req.first, req.second, truncate_prompt_tokens=req.truncate_prompt_tokens,
            request_id=self._request_id(), priority=req.priority)
        self._observe(timer, [n for _, n in scores])
        return _json(pooling_http.rerank_response(self.engine.model_name, req, scores), 200)

    @staticmethod
    def _observe(timer: RequestTimer, prompt_tokens: list[int]) -> None:
        """A pooling request's metrics: its inputs' tokens (prompt tokens), one successful
        "stop" per input, and its end-to-end latency; nothing is generated."""
        timer.prompt(sum(prompt_tokens))
        for i in range(len(prompt_tokens)):
            timer.output(i, 0, "stop")
        timer.done()

    # -- completions --------------------------------------------------------------------

    async def completions(self) -> Response:
        return await self._completions_body(await self._read_checked("completion"))

    async def chat(self) -> Response:
        return await self._chat_body(await self._read_checked("chat"))

    async def _completions_body(self, body: Any) -> Response:
        def parse() -> CompletionRequest:
            req = protocol.parse_completion(body, defaults=self.sampling_defaults)
            _check_token_prompts(req, self.engine.max_model_len)
            return req

        return await self._generate(await self._off_loop(parse))

    async def _chat_body(self, body: Any) -> Response:
        def parse() -> CompletionRequest:
            req = protocol.parse_chat(body, self.chat_settings,
                                      self.engine.tokenizer.chat_template,
                                      defaults=self.sampling_defaults)
            if body.get("thinking_token_budget") is not None:
                tok = self.engine.tokenizer
                req = dataclasses.replace(req, params=thinking_budget_params(
                    body, req.params, self.chat_settings,
                    lambda text: tok.encode(text, add_special_tokens=False)))
            return req

        return await self._generate(await self._off_loop(parse))

    # -- Anthropic Messages ---------------------------------------------------------------

    async def messages(self) -> Response:
        """``POST /v1/messages``: the chat path, said in Anthropic's shapes."""
        origins: dict[str, str] = {}  # chat paths of image blocks -> their Messages paths
        chat = anthropic.chat_body(await self._read_json(), origins=origins,
                                   reasoning=self.chat_settings.reasoning_parser is not None)
        try:
            req = await self._off_loop(lambda: protocol.parse_chat(
                chat, self.chat_settings, self.engine.tokenizer.chat_template,
                defaults=self.sampling_defaults))
            self._check_model(req.model)
            run = _Run(self.engine, req, self.metrics.timer(), self.answer_options,
                       self._load_tracker())
            await run.submit_all(self._request_id())
        except (APIError, InvalidParamError) as exc:
            raise anthropic.rename_param(error_from_exception(exc), origins) from None
        msg_id, model = anthropic.new_id(), self.engine.model_name
        if req.stream:
            events = anthropic.MessageEvents(
                msg_id, model, sum(len(s.prompt_token_ids) for s in run.streams))
            body = _TaskBody(lambda send: run.write_events(send, events), run.close)
            return Response(body, 200, headers=sse.HEADERS, content_type=sse.CONTENT_TYPE)
        return _json(anthropic.message_from_chat(await run.collect(), msg_id, model), 200)

    async def count_tokens(self) -> Response:
        """``POST /v1/messages/count_tokens``: the prompt's length, as the route would
        template it."""
        origins: dict[str, str] = {}
        chat = anthropic.chat_body(await self._read_json(), count_only=True, origins=origins,
                                   reasoning=self.chat_settings.reasoning_parser is not None)
        self._check_model(chat["model"])
        tok = self.engine.tokenizer

        def parse() -> Any:
            fields = parse_chat_fields(chat, self.chat_settings, tok.chat_template)
            messages = normalize_messages(chat["messages"], images=True)
            if has_images(messages):
                return messages, fields.template
            return admission.prompt_message(messages, fields.template.to_json())

        try:
            prompt = await self._off_loop(parse)
            if isinstance(prompt, tuple):  # image blocks count as their placeholder tokens
                ids = await self.engine.tokenize_chat(*prompt)
            else:
                ids = await tokenize_prompt(
                    tok, prompt, limiter=self.prompt_limiter,
                    template_seconds=self.engine.config.chat_template_timeout,
                    max_model_len=self.engine.max_model_len,
                    special_tokens_in_content=self.engine.config.allow_special_tokens_in_content)
        except (APIError, InvalidParamError) as exc:
            raise anthropic.rename_param(error_from_exception(exc), origins) from None
        return _json({"input_tokens": len(ids)}, 200)

    # -- responses ----------------------------------------------------------------------

    async def create_response(self) -> Response:
        body = await self._read_checked("responses")
        req = await self._off_loop(lambda: responses.parse_responses(
            body, history=self.responses.history, settings=self.chat_settings,
            model_template=self.engine.tokenizer.chat_template,
            defaults=self.sampling_defaults))
        self._check_model(req.chat.model)
        run = _ResponsesRun(self.engine, req, self.metrics.timer(), self.answer_options,
                            self.responses)
        try:
            await run.submit_all(self._request_id())
        except (APIError, InvalidParamError) as exc:
            responses.rename(exc, req)  # a bad image: its input part
            raise
        if req.stream:
            body = _TaskBody(run.write_response_events, run.close)
            return Response(body, 200, headers=sse.HEADERS, content_type=sse.CONTENT_TYPE)
        return _json(await run.collect_response(), 200)

    def _stored(self, response_id: str) -> Any:
        try:
            return self.responses.get(response_id)
        except MissingResponse:
            raise APIError(404, f"Response with id {response_id!r} not found (stored "
                           "responses live in memory, bounded in size and age, and are lost "
                           "on restart).", param="response_id", code="not_found") from None

    async def get_response(self, response_id: str) -> Response:
        for name in ("stream", "include", "include[]", "starting_after"):
            if request.args.get(name) not in (None, "", "false"):
                raise APIError(400, f"{name} is not supported when retrieving a response",
                               param=name, code="unsupported_parameter")
        return _json(self._stored(response_id).body, 200)

    async def delete_response(self, response_id: str) -> Response:
        self._stored(response_id)
        self.responses.delete(response_id)
        return _json({"id": response_id, "object": "response.deleted", "deleted": True}, 200)

    async def response_input_items(self, response_id: str) -> Response:
        args = request.args
        limit = args.get("limit", "20")
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise APIError(400, "limit must be an integer from 1 to 100", param="limit",
                           code="invalid_value")
        order = args.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(400, 'order must be "asc" or "desc"', param="order",
                           code="invalid_value")
        if args.get("include") or args.get("include[]"):
            raise APIError(400, "include is not supported", param="include",
                           code="unsupported_parameter")
        items = list(self._stored(response_id).input_items)
        return _json(input_items_page(items, limit=int(limit), order=order,
                                                after=args.get("after")), 200)


    async def invocations(self) -> Response:
        """SageMaker's one route: a chat body (``messages``), a completions body
        (``prompt``) or an embeddings body (``input``), told apart by shape as vLLM
        does."""
        body = await self._read_json()
        if isinstance(body, dict) and "messages" in body:
            return await self._chat_body(await self._off_loop(lambda: self._checked(body, "chat")))
        if isinstance(body, dict) and "prompt" in body:
            return await self._completions_body(
                await self._off_loop(lambda: self._checked(body, "completion")))
        if isinstance(body, dict) and "input" in body:
            return await self._embeddings_body(
                await self._off_loop(lambda: self._checked(body, "embeddings")))
        raise APIError(400, "/invocations takes a chat completions body (with `messages`), "
                       "a completions body (with `prompt`) or an embeddings body (with "
                       "`input`)", code="invalid_value")

    async def _generate(self, req: CompletionRequest) -> Response:
        self._check_model(req.model)
        run = _Run(self.engine, req, self.metrics.timer(), self.answer_options,
                   self._load_tracker())
        await run.submit_all(self._request_id())
        if req.stream:
            body = _TaskBody(run.write_sse, run.close)
            return Response(body, 200, headers=sse.HEADERS, content_type=sse.CONTENT_TYPE)
        response = _json(await run.collect(), 200)
        self._add_load_report(response)
        return response

    # -- load reporting -----------------------------------------------------------------

    def _load_tracker(self) -> Callable[[], None]:
        """Count one generation request in flight; the returned call (idempotent) ends it."""
        self.in_flight += 1
        done = False

        def finish() -> None:
            nonlocal done
            if not done:
                done = True
                self.in_flight -= 1

        return finish

    async def load(self) -> Response:
        return _json({"server_load": self.in_flight}, 200)

    def _add_load_report(self, response: Response) -> None:
        """The ORCA load report (``endpoint-load-metrics``) a load balancer asked for with
        ``endpoint-load-metrics-format: text`` or ``json``, as vLLM sends it."""
        wanted = request.headers.get(ORCA_FORMAT_HEADER, "").strip().lower()
        if wanted not in ("text", "json"):
            return
        stats = self.engine.statistics()
        total = stats.kv_blocks_total
        named = {
            "kv_cache_usage_perc": (total - stats.kv_blocks_free) / total if total else 0.0,
            "num_requests_waiting": float(stats.waiting),
        }
        if wanted == "text":
            value = "TEXT " + ", ".join(f"named_metrics.{k}={float(v)}" for k, v in named.items())
        else:
            value = "JSON " + sse.dumps({"named_metrics": named}).decode()
        response.headers[ORCA_HEADER] = value

    # -- render: what a request would run ------------------------------------------------

    async def render_chat(self) -> Response:
        """vLLM's ``/v1/chat/completions/render``: the ``/inference/v1/generate`` request a
        chat body would run (its prompt through the chat template), without running it."""
        body = await self._read_checked("chat")
        req = protocol.parse_chat(body, self.chat_settings,
                                  self.engine.tokenizer.chat_template,
                                  defaults=self.sampling_defaults)
        self._check_model(req.model)
        if body.get("thinking_token_budget") is not None:
            raise APIError(400, "render does not support thinking_token_budget (the "
                           "generate request cannot carry it)", param="thinking_token_budget",
                           code="unsupported_parameter")
        assert req.chat_fields is not None  # a chat request has them
        (messages,) = req.prompts
        prompt = admission.prompt_message(messages, req.chat_fields.template.to_json())
        return _json(self._rendered(req, 0, list(admission.prompt_token_ids(
            self.engine.tokenizer, prompt))), 200)

    async def render_completions(self) -> Response:
        """vLLM's ``/v1/completions/render``: one ``/inference/v1/generate`` request per
        prompt of a completions body, without running them."""
        req = protocol.parse_completion(await self._read_checked("completion"),
                                        defaults=self.sampling_defaults)
        self._check_model(req.model)
        tok = self.engine.tokenizer
        rendered = []
        for i, prompt in enumerate(req.prompts):
            ids = (list(admission.prompt_token_ids(tok, admission.prompt_message(prompt)))
                   if isinstance(prompt, str) else list(prompt))
            rendered.append(self._rendered(req, i, ids))
        return _json(rendered, 200)

    def _rendered(self, req: CompletionRequest, index: int, ids: list[int]) -> dict[str, Any]:
        if req.params.structured_outputs is not None:
            # /inference/v1/generate takes no grammar: the request it runs would drop it.
            raise APIError(400, "render does not support requests with an output "
                           "constraint (response_format, structured outputs, tool calls)",
                           param=req.structured_param or "response_format",
                           code="unsupported_parameter")
        if req.echo or req.params.prompt_logprobs is not None:
            raise APIError(400, "render does not support echo or prompt_logprobs",
                           param="echo" if req.echo else "prompt_logprobs",
                           code="unsupported_parameter")
        if len(ids) >= self.engine.max_model_len:
            raise APIError(400, f"The prompt is {len(ids)} tokens; the context is "
                           f"{self.engine.max_model_len}.", param="messages" if req.chat
                           else "prompt", code="context_length_exceeded")
        base = self._request_id() or uuid.uuid4().hex
        request_id = base if len(req.prompts) == 1 else f"{base}-{index}"
        return tokens.render_body(ids, req.params, max_model_len=self.engine.max_model_len,
                                  model=self.engine.model_name, request_id=request_id,
                                  priority=req.priority, cache_salt=req.cache_salt)

    # -- tokens in, tokens out ----------------------------------------------------------

    async def generate_tokens(self) -> Response:
        """vLLM's ``POST /inference/v1/generate``: token ids and sampling params in, token
        ids out (no text, no chat template)."""
        req = tokens.parse_generate(await self._read_json(), defaults=self.sampling_defaults)
        self._check_model(req.model)
        base_id = self._request_id() if req.request_id is None else req.request_id
        finish = self._load_tracker()
        try:
            stream = await self.engine.submit(list(req.token_ids), req.params,
                                              request_id=base_id, priority=req.priority,
                                              cache_salt=req.cache_salt)
            async with stream:
                answer = tokens.GenerateAnswer(stream.request_id, req.params.n,
                                               self._token_text)
                async for out in stream:
                    answer.record(out)
        finally:
            finish()
        response = _json(answer.response(), 200)
        self._add_load_report(response)
        return response


class _Run:
    """One OpenAI request in flight: the one owner of its engine streams (an
    ``AsyncExitStack``: closing it aborts what has not finished), and the two writers of
    its answer (one JSON body, or SSE chunks). What the answer says is
    :class:`answer.Completion`'s."""

    def __init__(self, engine: EngineLike, req: CompletionRequest, timer: RequestTimer,
                 options: answer.AnswerOptions,
                 on_close: Callable[[], None] = lambda: None) -> None:
        self.engine = engine
        self.req = req
        self.options = options
        self.timer = timer
        self._on_close = on_close
        self.streams: list[StreamLike] = []
        self.error: APIError | None = None
        self._exit = AsyncExitStack()
        self._answer: answer.Completion | None = None

    @property
    def answer(self) -> answer.Completion:
        assert self._answer is not None  # set by submit_all
        return self._answer

    async def submit_all(self, base_id: str | None) -> None:
        """Submit every prompt before answering, so validation errors are a proper 4xx.
        ``base_id`` is the client's request id: the engine's id for its one prompt, or
        ``{base_id}-{i}`` for prompt ``i`` of several."""
        extra: dict[str, Any] = {}
        if self.req.chat_fields is not None:
            extra["chat_options"] = self.req.chat_fields.template
        try:
            for i, prompt in enumerate(self.req.prompts):
                if base_id is not None:
                    extra["request_id"] = base_id if len(self.req.prompts) == 1 else f"{base_id}-{i}"
                stream = await self.engine.submit(
                    prompt, self.req.params, priority=self.req.priority,
                    cache_salt=self.req.cache_salt, **extra,
                )
                self._exit.push_async_exit(stream)  # sync: no checkpoint between
                self.streams.append(stream)
                self.timer.prompt(len(stream.prompt_token_ids))
                max_tokens = self.req.params.max_tokens
                if max_tokens is None:  # up to the context
                    max_tokens = self.engine.max_model_len - len(stream.prompt_token_ids)
                self.timer.params(self.req.params.n, max_tokens)
        except BaseException as exc:
            if (isinstance(exc, InvalidParamError) and exc.param == "structured_outputs"
                    and self.req.structured_param is not None):
                # The engine compiled the constraint; name the body field that carried it.
                exc.param = self.req.structured_param
            with trio.CancelScope(shield=True):  # cleanup that must finish
                await self.close()
            raise
        tok = self.engine.tokenizer
        self._answer = answer.Completion(
            self.req, self.engine.model_name, [s.prompt_token_ids for s in self.streams],
            lambda token_id: tok.decode([token_id], skip_special_tokens=False),
            # An echoed token-id prompt shows its special tokens, as the model read them.
            lambda ids: tok.decode(ids, skip_special_tokens=False), base_id, self.options,
        )

    async def close(self) -> None:
        """Leave every stream (aborting those not finished); idempotent."""
        try:
            await self._exit.aclose()
        finally:
            self._on_close()

    async def collect(self) -> dict[str, Any]:
        self.answer.begin_collected()

        async def on_output(prompt_index: int, out: RequestOutput) -> None:
            self.answer.record(prompt_index, out)

        await self._pump_all(on_output)
        if self.error is not None:
            raise self.error
        return self.answer.response()

    async def write_sse(self, send: trio.MemorySendChannel[bytes]) -> None:
        """The SSE body: opening chunks, token chunks, then usage or an error, ``[DONE]``."""
        async with send:
            for chunk in self.answer.opening_chunks():
                await send.send(sse.event(chunk))

            async def on_output(prompt_index: int, out: RequestOutput) -> None:
                for chunk in self.answer.stream_output(prompt_index, out):
                    await send.send(sse.event(chunk))

            await self._pump_all(on_output)
            if self.error is not None:
                await send.send(sse.event(self.error.body()))
            elif self.answer.include_usage:
                await send.send(sse.event(self.answer.usage_chunk()))
            await send.send(sse.DONE)

    async def write_events(self, send: trio.MemorySendChannel[bytes],
                           events: anthropic.MessageEvents) -> None:
        """The SSE body of an Anthropic Messages stream: the same chunks as
        :meth:`write_sse`, said as Messages events; an error ends it with an error event."""
        async with send:
            for frame in events.start():
                await send.send(frame)

            async def say(chunks: list[dict[str, Any]]) -> None:
                for chunk in chunks:
                    for frame in events.chunk(chunk):
                        await send.send(frame)

            await say(self.answer.opening_chunks())

            async def on_output(prompt_index: int, out: RequestOutput) -> None:
                await say(self.answer.stream_output(prompt_index, out))

            await self._pump_all(on_output)
            if self.error is not None:
                await send.send(events.error(self.error))
            else:
                await say([self.answer.usage_chunk()])

    async def _pump_all(self, on_output: Callable[[int, RequestOutput], Awaitable[None]]) -> None:
        """Feed every stream's outputs to ``on_output``; the first failure stops them all."""
        try:
            async with trio.open_nursery() as nursery:
                for i, stream in enumerate(self.streams):
                    nursery.start_soon(self._pump, i, stream, on_output, nursery.cancel_scope)
        finally:
            with trio.CancelScope(shield=True):  # cleanup that must finish
                await self.close()
            if self.error is None:
                # Cut short (the client went away): count the unfinished samples as vLLM
                # does, under finished_reason="abort".
                for index in self.answer.unfinished():
                    self.timer.output(index, 0, "abort")
        self.timer.done()

    async def _pump(self, prompt_index: int, stream: StreamLike,
                    on_output: Callable[[int, RequestOutput], Awaitable[None]],
                    cancel: trio.CancelScope) -> None:
        try:
            async for out in stream:
                self.timer.output(prompt_index * self.req.params.n + out.index,
                                  len(out.token_ids), out.finish_reason,
                                  out.scheduled_time)
                await on_output(prompt_index, out)
        except Exception as exc:
            if self.error is None:
                self.error = error_from_exception(exc)
                if self.error.status >= 500 and self.error.code not in LOGGED_ELSEWHERE:
                    logger.error("request %s failed", stream.request_id, exc_info=exc)
            cancel.cancel()


class _ResponsesRun(_Run):
    """A ``/v1/responses`` request: a chat run whose outputs go through a
    :class:`ResponseBuilder` (one JSON response, or typed SSE events), and
    whose finished answer is stored (``store``) before its last event is sent, so the
    client's next turn finds it."""

    def __init__(self, engine: EngineLike, req: responses.ResponsesRequest,
                 timer: RequestTimer, options: answer.AnswerOptions,
                 store: ResponseStore) -> None:
        super().__init__(engine, req.chat, timer, options)
        self.responses_req = req
        self.store = store

    def _builder(self) -> ResponseBuilder:
        fields = self.req.chat_fields
        assert fields is not None  # a chat request
        parser = ChatOutputParser(fields.output,
                                  constrained=calls_constrained(fields, self.req.params))
        return ResponseBuilder(self.responses_req, self.engine.model_name, parser)

    def _events(self, builder: ResponseBuilder,
                out: RequestOutput) -> list[dict[str, Any]]:
        self.answer.record(0, out)
        events = builder.feed(out.text, len(out.token_ids))
        if out.finished:
            usage = self.answer.usage()
            # Responses' usage always has cached_tokens (the prefix cache's hit).
            events += builder.finish(out.finish_reason, usage["prompt_tokens"],
                                     usage["completion_tokens"], self.answer.choices[0].cached)
            self._keep(builder)
        return events

    def _keep(self, builder: ResponseBuilder) -> None:
        req = self.responses_req
        if req.store and not self.store.put(
                builder.id, builder.response(), req.input_items,
                [*req.turn, builder.turn_message()], req.previous_response_id):
            logger.info("response %s not stored: larger than --responses-store-bytes",
                        builder.id)

    async def collect_response(self) -> dict[str, Any]:
        builder = self._builder()

        async def on_output(prompt_index: int, out: RequestOutput) -> None:
            self._events(builder, out)

        await self._pump_all(on_output)
        if self.error is not None:
            raise self.error
        return builder.response()

    async def write_response_events(self, send: trio.MemorySendChannel[bytes]) -> None:
        async with send:
            builder = self._builder()
            for event in builder.start():
                await send.send(sse.typed_event(event))

            async def on_output(prompt_index: int, out: RequestOutput) -> None:
                for event in self._events(builder, out):
                    await send.send(sse.typed_event(event))

            await self._pump_all(on_output)
            if self.error is not None:
                for event in builder.fail(self.error):
                    await send.send(sse.typed_event(event))


def _check_token_prompts(req: CompletionRequest, max_model_len: int) -> None:
    """Refuse a token-id prompt that cannot fit the context here, in the parse thread:
    admission would too, but only after walking its ids on the event loop."""
    for prompt in req.prompts:
        if isinstance(prompt, list) and len(prompt) >= max_model_len:
            raise APIError(
                400, f"This model's maximum context length is {max_model_len} tokens. "
                f"However, the prompt holds {len(prompt)} token ids, which leaves no room "
                "for the completion. Please reduce the prompt.", param="prompt",
                code="context_length_exceeded")


def _json(obj: Any, status: int) -> Response:
    return Response(sse.dumps(obj), status, content_type="application/json")
