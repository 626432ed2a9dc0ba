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
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from quart import Response, request
from quart.wrappers.response import ResponseBody
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from engine.http import auth, protocol, sse
from engine.http.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from engine.http.metrics import Metrics, RequestTimer
from engine.http.protocol import APIError, CompletionRequest

logger = logging.getLogger("engine.http")

# 4 MiB: a full 128k-token context of text is ~0.5 MiB of JSON, or ~1 MiB as token ids;
# anything far beyond that is a mistake or abuse, not a prompt.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024


def create_app(
    engine: Any, *, api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> QuartTrio:
    """Build the OpenAI-compatible app serving ``engine`` (an open :class:`engine.api.Engine`).

    ``api_key`` (when set) is required as ``Authorization: Bearer <key>`` on every route
    but ``/health`` and ``/metrics``. Bodies over ``max_request_bytes`` get a 413.
    """
    app = _App(__name__)
    # Generations can take minutes; the engine's own limits bound a request, not a timer.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["MAX_CONTENT_LENGTH"] = max_request_bytes
    server = _Server(engine, api_key=api_key, max_request_bytes=max_request_bytes)
    server.register(app)
    app.extensions["engine_server"] = server
    return app


class _Connection(TrioASGIHTTPConnection):
    """quart-trio's HTTP connection, aborting streams whose body was never sent."""

    async def _send_response(self, send: Any, response: Any) -> None:
        try:
            await super()._send_response(send, response)
        finally:
            body = getattr(response, "response", None)
            if isinstance(body, _TaskBody):
                body.abort_unsent()


class _App(QuartTrio):
    asgi_http_class = _Connection


Produce = Callable[[trio.MemorySendChannel[bytes]], Awaitable[None]]


class _TaskBody(ResponseBody):
    """A response body written by a task that runs while quart sends it.

    Entering the body opens a nursery in the sending task (so the producer is cancelled
    with the connection) and starts ``produce(send_channel)``; the body yields what the
    producer sends until it closes the channel. ``on_unsent`` runs (sync) if the body is
    never entered.
    """

    def __init__(self, produce: Produce, on_unsent: Callable[[], None]) -> None:
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

    def abort_unsent(self) -> None:
        if not self._entered:
            self._on_unsent()


class _Choice:
    """What one choice (one sample of one prompt) has produced so far."""

    __slots__ = ("index", "text", "logprobs", "prompt_logprobs", "finish_reason", "stop_reason",
                 "tokens")

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.logprobs: list[Any] = []
        self.prompt_logprobs: list[Any] | None = None  # echo + logprobs: the prompt's entries
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.tokens = 0


class _Server:
    """Route handlers bound to one engine."""

    def __init__(self, engine: Any, *, api_key: str | None, max_request_bytes: int) -> None:
        self.engine = engine
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.metrics = Metrics(engine, engine.model_name)
        try:
            self.version = importlib.metadata.version("engine")
        except importlib.metadata.PackageNotFoundError:
            self.version = "unknown"

    def register(self, app: QuartTrio) -> None:
        app.before_request(self._check_auth)
        app.register_error_handler(Exception, self._error_response)
        app.add_url_rule("/v1/completions", view_func=self.completions, methods=["POST"])
        app.add_url_rule("/v1/chat/completions", view_func=self.chat, methods=["POST"])
        app.add_url_rule("/v1/models", view_func=self.models, methods=["GET"])
        app.add_url_rule("/health", view_func=self.health, methods=["GET"])
        app.add_url_rule("/version", view_func=self.version_route, methods=["GET"])
        app.add_url_rule("/metrics", view_func=self.metrics_route, methods=["GET"])
        app.add_url_rule("/tokenize", view_func=self.tokenize, methods=["POST"])
        app.add_url_rule("/detokenize", view_func=self.detokenize, methods=["POST"])

    # -- plumbing ---------------------------------------------------------------------

    async def _check_auth(self) -> None:
        if not auth.authorized(self.api_key, request.path, request.headers.get("Authorization")):
            raise APIError(401, "Invalid or missing API key (Authorization: Bearer <key>).",
                           code="invalid_api_key")

    async def _error_response(self, exc: Exception) -> Response:
        if isinstance(exc, HTTPException):
            err = APIError(exc.code or 500, exc.description or exc.name,
                           code=exc.name.lower().replace(" ", "_"))
        else:
            err = protocol.error_from_exception(exc)
            if err.status >= 500 and err.code != "engine_dead":
                logger.error("unhandled error in %s %s", request.method, request.path,
                             exc_info=exc)
        return _json(err.body(), err.status)

    async def _read_json(self) -> Any:
        length = request.content_length
        if length is not None and length > self.max_request_bytes:
            raise self._too_large(length)
        try:
            data = await request.get_data(as_text=False)
        except RequestEntityTooLarge:
            raise self._too_large(None) from None
        try:
            return json.loads(data)
        except ValueError as exc:
            raise APIError(400, f"The request body is not valid JSON: {exc}",
                           code="invalid_json") from None

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
        if self.engine.dead:
            err = protocol.error_from_exception(
                _dead_error(self.engine.dead_reason))
            return _json(err.body(), 503)
        return _json({"status": "ok"}, 200)

    async def version_route(self) -> Response:
        return _json({"version": self.version}, 200)

    async def metrics_route(self) -> Response:
        return Response(self.metrics.render(), 200, content_type=METRICS_CONTENT_TYPE)

    async def models(self) -> Response:
        eng = self.engine
        card = {
            "id": eng.model_name, "object": "model", "created": protocol.now(),
            "owned_by": "engine", "root": eng.config.model or eng.model_name, "parent": None,
            "max_model_len": eng.max_model_len,
        }
        return _json({"object": "list", "data": [card]}, 200)

    async def tokenize(self) -> Response:
        body = protocol._require_object(await self._read_json())
        self._check_model(body.get("model"))
        tok = self.engine.tokenizer
        if "messages" in body:
            messages = protocol._chat_messages(body["messages"])
            add_gen = body.get("add_generation_prompt", True)
            text = tok.apply_chat_template(messages, add_generation_prompt=bool(add_gen))
            ids = tok.encode(text, add_special_tokens=False)
        elif isinstance(body.get("prompt"), str):
            ids = tok.encode(body["prompt"],
                             add_special_tokens=bool(body.get("add_special_tokens", True)))
        else:
            raise APIError(400, "tokenize needs a string `prompt` or `messages`",
                           param="prompt", code="invalid_type")
        return _json({"count": len(ids), "max_model_len": self.engine.max_model_len,
                      "tokens": list(ids)}, 200)

    async def detokenize(self) -> Response:
        body = protocol._require_object(await self._read_json())
        self._check_model(body.get("model"))
        tokens = body.get("tokens")
        vocab = self.engine.tokenizer.vocab_size
        if not (isinstance(tokens, list)
                and all(protocol._is_token_id(t) and t < vocab for t in tokens)):
            raise APIError(400, f"tokens must be a list of token ids below {vocab}",
                           param="tokens", code="invalid_value")
        return _json({"prompt": self.engine.tokenizer.decode(tokens)}, 200)

    # -- completions --------------------------------------------------------------------

    async def completions(self) -> Response:
        return await self._generate(protocol.parse_completion(await self._read_json()))

    async def chat(self) -> Response:
        return await self._generate(protocol.parse_chat(await self._read_json()))

    async def _generate(self, req: CompletionRequest) -> Response:
        self._check_model(req.model)
        timer = self.metrics.timer()
        streams = await self._submit_all(req, timer)
        if req.stream:
            run = _Run(self, req, streams, timer)
            body = _TaskBody(run.stream, run.abort)
            return Response(body, 200, headers=sse.HEADERS, content_type=sse.CONTENT_TYPE)
        return _json(await _Run(self, req, streams, timer).collect(), 200)

    async def _submit_all(self, req: CompletionRequest, timer: RequestTimer) -> list[Any]:
        """Submit every prompt before answering, so validation errors are a proper 4xx."""
        streams: list[Any] = []
        try:
            for prompt in req.prompts:
                stream = await self.engine.submit(
                    prompt, req.params, priority=req.priority, cache_salt=req.cache_salt
                )
                streams.append(stream)
                timer.prompt(len(stream.prompt_token_ids))
        except BaseException:
            for stream in streams:
                self.engine.abort(stream.request_id)
            raise
        return streams


class _Run:
    """One OpenAI request in flight: its engine streams and its choices."""

    def __init__(self, server: _Server, req: CompletionRequest, streams: list[Any],
                 timer: RequestTimer) -> None:
        self.server = server
        self.req = req
        self.streams = streams
        self.timer = timer
        self.n = req.params.n
        self.id = protocol.new_id(req.chat)
        self.created = protocol.now()
        self.model = server.engine.model_name
        self.choices = [_Choice(i) for i in range(len(streams) * self.n)]
        self.error: APIError | None = None

    def abort(self) -> None:
        for stream in self.streams:
            self.server.engine.abort(stream.request_id)

    def _echo_text(self, prompt_index: int) -> str:
        prompt = self.req.prompts[prompt_index]
        if isinstance(prompt, str):
            return prompt
        return self.server.engine.tokenizer.decode(list(prompt))

    def _prompt_entries(self, choice: _Choice, out: Any) -> list[Any] | None:
        """The echoed prompt's logprob entries, from the first output that carries them."""
        if out.prompt_logprobs is None:
            return None
        stream = self.streams[choice.index // self.n]
        return protocol.prompt_logprob_entries(stream.prompt_token_ids, out.prompt_logprobs)

    def _logprobs(self, choice: _Choice, new: Any) -> dict[str, Any] | None:
        if self.req.top_logprobs is None or new is None:
            return None
        if self.req.chat:
            return protocol.chat_logprobs(new, self.server._token_text)
        return protocol.completion_logprobs(new, self.server._token_text, len(choice.text))

    def _usage(self) -> dict[str, int]:
        prompt = sum(len(s.prompt_token_ids) for s in self.streams)
        return protocol.usage_dict(prompt, sum(c.tokens for c in self.choices))

    async def _pump(self, prompt_index: int, stream: Any, on_output: Any,
                    cancel: trio.CancelScope) -> None:
        """Feed one engine stream into ``on_output``; the first failure cancels the rest."""
        try:
            async with stream:
                async for out in stream:
                    choice = self.choices[prompt_index * self.n + out.index]
                    self.timer.output(choice.index, len(out.token_ids), out.finish_reason)
                    await on_output(choice, out)
        except Exception as exc:
            if self.error is None:
                self.error = protocol.error_from_exception(exc)
                if self.error.status >= 500 and self.error.code != "engine_dead":
                    logger.error("request %s failed", stream.request_id, exc_info=exc)
            cancel.cancel()
        finally:
            self.server.engine.abort(stream.request_id)

    async def _run_all(self, on_output: Any) -> None:
        try:
            async with trio.open_nursery() as nursery:
                for i, stream in enumerate(self.streams):
                    nursery.start_soon(self._pump, i, stream, on_output, nursery.cancel_scope)
        finally:
            self.abort()
            if self.error is None:
                # Cut short (the client went away): count the unfinished samples as vLLM
                # does, under finished_reason="abort".
                for choice in self.choices:
                    if choice.finish_reason is None:
                        self.timer.output(choice.index, 0, "abort")
        self.timer.done()

    # -- non-streamed -----------------------------------------------------------------

    async def collect(self) -> dict[str, Any]:
        async def on_output(choice: _Choice, out: Any) -> None:
            self._record(choice, out)

        if self.req.echo:
            for choice in self.choices:
                choice.text = self._echo_text(choice.index // self.n)
        await self._run_all(on_output)
        if self.error is not None:
            raise self.error
        build = protocol.chat_choice if self.req.chat else protocol.completion_choice
        choices = [
            build(c.index, c.text, c.finish_reason, c.stop_reason, self._final_logprobs(c))
            for c in self.choices
        ]
        return protocol.response_body(self.req.chat, self.id, self.created, self.model,
                                      choices, self._usage())

    def _record(self, choice: _Choice, out: Any) -> None:
        if choice.prompt_logprobs is None:
            choice.prompt_logprobs = self._prompt_entries(choice, out)
        choice.text += out.text
        choice.tokens += len(out.token_ids)
        if out.logprobs:
            choice.logprobs.extend(out.logprobs)
        if out.finished:
            choice.finish_reason = out.finish_reason
            choice.stop_reason = out.stop_reason

    def _final_logprobs(self, choice: _Choice) -> dict[str, Any] | None:
        if self.req.top_logprobs is None:
            return None
        if self.req.chat:
            return protocol.chat_logprobs(choice.logprobs, self.server._token_text)
        if self.req.echo:
            # The prompt's tokens first (offsets from 0), then the completion's after the
            # echoed text.
            scored = protocol.completion_logprobs(
                choice.prompt_logprobs or [], self.server._token_text, 0
            )
            offset = len(self._echo_text(choice.index // self.n))
            generated = protocol.completion_logprobs(choice.logprobs, self.server._token_text, offset)
            return {key: scored[key] + generated[key] for key in generated}
        return protocol.completion_logprobs(choice.logprobs, self.server._token_text, 0)

    # -- streamed -----------------------------------------------------------------------

    async def stream(self, send: trio.MemorySendChannel[bytes]) -> None:
        """Write the SSE body: role/echo chunks, token chunks, usage, errors, ``[DONE]``."""
        # With logprobs, an echoed prompt waits for its logprobs, which come with the
        # choice's first output; without, it goes out at once.
        echo_later = self.req.echo and self.req.top_logprobs is not None
        async with send:
            for choice in self.choices:
                if self.req.chat:
                    await send.send(self._chunk([protocol.chunk_choice(
                        True, choice.index, "", None, None, None, role=True)]))
                elif self.req.echo and not echo_later:
                    await self._send_echo(send, choice, None)

            pending: dict[int, list[Any]] = {}

            async def on_output(choice: _Choice, out: Any) -> None:
                if echo_later and choice.prompt_logprobs is None:
                    choice.prompt_logprobs = self._prompt_entries(choice, out) or []
                    await self._send_echo(send, choice, protocol.completion_logprobs(
                        choice.prompt_logprobs, self.server._token_text, 0))
                # Tokens that are not yet text (half a UTF-8 character) wait, with their
                # logprobs, for the chunk that completes the text.
                held = pending.setdefault(choice.index, [])
                held.extend(out.logprobs or ())
                if not out.text and not out.finished:
                    self._record(choice, out)
                    return
                logprobs = self._logprobs(choice, held if out.logprobs is not None else None)
                pending[choice.index] = []
                self._record(choice, out)
                await send.send(self._chunk([protocol.chunk_choice(
                    self.req.chat, choice.index, out.text, out.finish_reason if out.finished
                    else None, out.stop_reason if out.finished else None, logprobs)]))

            await self._run_all(on_output)
            if self.error is not None:
                await send.send(sse.event(self.error.body()))
            elif self.req.include_usage:
                await send.send(self._chunk([], usage=self._usage()))
            await send.send(sse.DONE)

    async def _send_echo(self, send: trio.MemorySendChannel[bytes], choice: _Choice,
                         logprobs: dict[str, Any] | None) -> None:
        choice.text = self._echo_text(choice.index // self.n)
        await send.send(self._chunk([protocol.chunk_choice(
            False, choice.index, choice.text, None, None, logprobs)]))

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None
               ) -> bytes:
        return sse.event(protocol.chunk_body(self.req.chat, self.id, self.created, self.model,
                                             choices, self.req.include_usage, usage))


def _dead_error(reason: BaseException | None) -> Exception:
    from engine.errors import EngineDeadError

    return EngineDeadError(f"{type(reason).__name__}: {reason}" if reason else "engine closed")


def _json(obj: Any, status: int) -> Response:
    return Response(sse.dumps(obj), status, content_type="application/json")
