"""What every route shares: one engine, the server's settings, and the request plumbing.

One :class:`Server` per app, built by :func:`engine.http.app.create_app` and handed to
each API family's routes. The plumbing: reading a body within ``--max-request-bytes``,
parsing it off the event loop (a worker thread for a large one, at most
:data:`PARSE_THREADS` at once), checking it against its JSON Schema, the model check,
the client's request id (``X-Request-Id``), and load tracking (``GET /load`` and ORCA
load reports on answers).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import trio
from quart import Response, g, request
from werkzeug.exceptions import RequestEntityTooLarge

from engine._version import VERSION
from engine.api import PROMPT_THREADS
from engine.api.metrics import Metrics
from engine.chat.request import ChatSettings, check_tool_limits
from engine.http import schema, sse
from engine.http.completions.answer import AnswerOptions
from engine.http.errors import APIError
from engine.http.strict_json import loads_body

if TYPE_CHECKING:
    from engine.api import EngineLike

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


class Server:
    """One engine served over HTTP: its settings and the plumbing every route uses."""

    def __init__(self, engine: EngineLike, *, api_key: str | None, max_request_bytes: int,
                 chat: ChatSettings, enable_request_id_headers: bool = False,
                 metrics_prefix: str = "engine", allow_runtime_lora_updating: bool = False,
                 server_dev_mode: bool = False) -> None:
        self.engine = engine
        # vLLM's development routes (POST /reset_prefix_cache), off by default as behind
        # its VLLM_SERVER_DEV_MODE.
        self.server_dev_mode = server_dev_mode
        # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (off by default, as vLLM's
        # VLLM_ALLOW_RUNTIME_LORA_UPDATING).
        self.allow_runtime_lora_updating = allow_runtime_lora_updating
        self.enable_request_id_headers = enable_request_id_headers
        # Generation requests in flight (submitted, not yet answered or streamed to the
        # end): GET /load, as vLLM's server-load tracking counts them.
        self.in_flight = 0
        self.chat_settings = chat
        # The model's sampling defaults (--generation-config auto, with
        # --override-generation-config over them), for fields a body omits; "max_tokens"
        # and "max_tokens_cap" there are the max_tokens default and cap (see
        # completions.protocol's _sampling_params).
        self.sampling_defaults: dict[str, Any] = dict(engine.sampling_defaults)
        if engine.default_max_tokens is not None:
            self.sampling_defaults["max_tokens"] = engine.default_max_tokens
        if engine.max_tokens_cap is not None:
            self.sampling_defaults["max_tokens_cap"] = engine.max_tokens_cap
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.metrics = Metrics(engine, engine.model_name, prefix=metrics_prefix)
        config = engine.config
        self.answer_options = AnswerOptions(
            prompt_tokens_details=config.enable_prompt_tokens_details,
            force_include_usage=config.enable_force_include_usage,
            tokens_as_token_ids=config.return_tokens_as_token_ids)
        self.parse_limiter = trio.CapacityLimiter(PARSE_THREADS)
        self.prompt_limiter = trio.CapacityLimiter(PROMPT_THREADS)
        self.version = VERSION

    # -- the body -----------------------------------------------------------------------

    async def read_body(self) -> bytes:
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

    async def off_loop(self, work: Callable[[], T]) -> T:
        """``work()`` (pure request parsing) in a worker thread under the parse limiter,
        for a body over :data:`INLINE_BODY_BYTES`; a smaller one's here. A cancelled
        caller need not wait for it; the limiter holds its slot until the thread ends, so
        abandoned work still counts."""
        if getattr(g, "engine_body_bytes", 0) <= INLINE_BODY_BYTES:
            await trio.lowlevel.checkpoint()
            return work()
        return await trio.to_thread.run_sync(work, limiter=self.parse_limiter,
                                             abandon_on_cancel=True)

    async def read_json(self) -> Any:
        """The body as JSON (:func:`engine.http.strict_json.loads_body`), decoded in a
        worker thread."""
        data = await self.read_body()
        return await self.off_loop(lambda: loads_body(data))

    async def read_checked(self, name: str) -> Any:
        """The body, checked against its JSON Schema (the one /openapi.json publishes),
        in a worker thread."""
        data = await self.read_body()
        return await self.off_loop(lambda: self.checked(loads_body(data), name))

    def checked(self, body: Any, name: str) -> Any:
        if name == "chat" and isinstance(body, dict):
            # Before the schema check, which would read each of 60,000 tools.
            check_tool_limits(body.get("tools"), self.chat_settings)
        schema.check_body(body, name)
        return body

    def _too_large(self, length: int | None) -> APIError:
        size = f" ({length} bytes)" if length is not None else ""
        return APIError(413, f"The request body{size} is over the limit of "
                        f"{self.max_request_bytes} bytes.", code="request_too_large")

    # -- the request --------------------------------------------------------------------

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter a body's ``model`` names (None: the base model, or no model);
        a 404 for a name this server does not serve."""
        if model is None or model == self.engine.model_name or model in self.engine.config.served_model_names:
            return None  # the base model, under any of its served names
        if model in self.engine.loras:
            return model
        raise APIError(404, f"The model `{model}` does not exist; this server serves "
                       f"`{self.engine.model_name}`" + (" and its LoRA adapters" if self.engine.loras.enabled
                                                        else "") + ".", param="model",
                       code="model_not_found")

    def check_base_model(self, model: str | None) -> None:
        """:meth:`check_model` for a route that runs the base model only: an adapter's name
        is a 400 (the request would otherwise run without its adapter)."""
        if self.check_model(model) is not None:
            raise APIError(400, f"`{model}` is a LoRA adapter; adapters are served on "
                           "/v1/completions, /v1/chat/completions, /inference/v1/generate "
                           "and, with a decoder embedder, the embedding and score routes",
                           param="model", code="unsupported_parameter")

    def token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def request_id(self, body_id: str | None = None) -> str | None:
        """The client's ``X-Request-Id``, used as the engine's request id (checked: ids
        show up in logs and metrics labels-free, so printable ASCII only); without one,
        the body's ``request_id`` (vLLM's field, checked by the parser). With
        ``--enable-request-id-headers`` a request without either gets a fresh id, which
        the response's header then carries."""
        value = request.headers.get(REQUEST_ID_HEADER)
        if value is None:
            if body_id is not None:
                if self.enable_request_id_headers:
                    g.request_id = body_id
                return body_id
            if self.enable_request_id_headers:
                g.request_id = uuid.uuid4().hex
                return str(g.request_id)
            return None
        if not 0 < len(value) <= _MAX_REQUEST_ID or not value.isascii() or not value.isprintable():
            raise APIError(400, f"{REQUEST_ID_HEADER} must be 1-{_MAX_REQUEST_ID} printable "
                           "ASCII characters", param=REQUEST_ID_HEADER, code="invalid_value")
        return value

    # -- load reporting -----------------------------------------------------------------

    def load_tracker(self) -> Callable[[], None]:
        """Count one generation request in flight; the returned call (idempotent) ends it."""
        self.in_flight += 1
        done = False

        def finish() -> None:
            nonlocal done
            if not done:
                done = True
                self.in_flight -= 1

        return finish

    def add_load_report(self, response: Response) -> None:
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
