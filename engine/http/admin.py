"""The operational routes: ``/health`` and ``/ping``, ``/version``, ``/metrics``,
``/v1/models``, ``/load``, ``/openapi.json``, ``/tokenize``, ``/detokenize``, (with
``--enable-tokenizer-info-endpoint``) ``/tokenizer_info`` and (with
``--allow-runtime-lora-updating``) ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

``/health``, ``/ping``, ``/metrics`` and ``/load`` answer without the API key
(:data:`engine.http.auth.OPEN_PATHS`).
"""

from __future__ import annotations

import json
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio

from engine.api import tokenize_prompt
from engine.api.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from engine.chat.request import lax_bool, parse_chat_fields
from engine.chat.template import normalize_messages
from engine.core import admission
from engine.errors import EngineDeadError
from engine.http.bodies import json_response
from engine.http.completions.answer import now
from engine.http.completions.legacy import legacy_body
from engine.http.completions.protocol import is_token_id
from engine.http.errors import APIError, error_from_exception
from engine.http.openapi import openapi as openapi_document
from engine.http.server import Server
from engine.multimodal import has_images


class AdminRoutes:
    """The operational handlers, bound to one :class:`Server`."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.engine = server.engine

    def register(self, app: QuartTrio) -> None:
        app.add_url_rule("/v1/models", view_func=self.models, methods=["GET"])
        app.add_url_rule("/v1/models/<path:model_id>", view_func=self.model_card,
                         methods=["GET"])
        app.add_url_rule("/health", view_func=self.health, methods=["GET"])
        app.add_url_rule("/ping", view_func=self.health, methods=["GET", "POST"])
        app.add_url_rule("/version", view_func=self.version_route, methods=["GET"])
        app.add_url_rule("/metrics", view_func=self.metrics_route, methods=["GET"])
        app.add_url_rule("/tokenize", view_func=self.tokenize, methods=["POST"])
        app.add_url_rule("/detokenize", view_func=self.detokenize, methods=["POST"])
        app.add_url_rule("/openapi.json", view_func=self.openapi, methods=["GET"])
        if self.engine.config.enable_tokenizer_info_endpoint:
            app.add_url_rule("/tokenizer_info", view_func=self.tokenizer_info, methods=["GET"])
        app.add_url_rule("/load", view_func=self.load, methods=["GET"])
        if self.server.allow_runtime_lora_updating:
            app.add_url_rule("/v1/load_lora_adapter", view_func=self.load_lora, methods=["POST"])
            app.add_url_rule("/v1/unload_lora_adapter", view_func=self.unload_lora, methods=["POST"])
        if self.server.server_dev_mode:
            app.add_url_rule("/reset_prefix_cache", view_func=self.reset_prefix_cache,
                             methods=["POST"])
            app.add_url_rule("/server_info", view_func=self.server_info, methods=["GET"])
            app.add_url_rule("/is_sleeping", view_func=self.is_sleeping, methods=["GET"])
            app.add_url_rule("/sleep", view_func=self.sleep, methods=["POST"])
            app.add_url_rule("/wake_up", view_func=self.wake_up, methods=["POST"])
            app.add_url_rule("/pause", view_func=self.pause, methods=["POST"])
            app.add_url_rule("/resume", view_func=self.resume, methods=["POST"])
            app.add_url_rule("/is_paused", view_func=self.is_paused, methods=["GET"])
            app.add_url_rule("/collective_rpc", view_func=self.collective_rpc, methods=["POST"])
        if self.engine.config.profiler is not None:  # vLLM's, there only with a profiler
            app.add_url_rule("/start_profile", view_func=self.start_profile, methods=["POST"])
            app.add_url_rule("/stop_profile", view_func=self.stop_profile, methods=["POST"])

    async def health(self) -> Response:
        # 503 while the actors restart after a crash, and once the engine is dead.
        if self.engine.dead or self.engine.restarting:
            err = error_from_exception(
                EngineDeadError())
            return json_response(err.body(), 503)
        return json_response({"status": "ok"}, 200)

    async def version_route(self) -> Response:
        return json_response({"version": self.server.version}, 200)

    async def metrics_route(self) -> Response:
        return Response(self.server.metrics.render(), 200, content_type=METRICS_CONTENT_TYPE)

    def _card(self, name: str | None = None) -> dict[str, Any]:
        eng = self.engine
        return {
            "id": name or eng.model_name, "object": "model", "created": now(),
            "owned_by": "engine", "root": eng.config.model or eng.model_name, "parent": None,
            "max_model_len": eng.max_model_len,
        }

    def _base_cards(self) -> list[dict[str, Any]]:
        """The base model under each of its served names, as vLLM lists them (the first is
        the one answers carry)."""
        names = self.engine.config.served_model_names or (self.engine.model_name,)
        return [self._card(name) for name in names]

    def _adapter_cards(self) -> list[dict[str, Any]]:
        """Each LoRA adapter served, as vLLM lists them: its folder (or Hub id) as given as
        root, the base model (or its --lora-modules base_model_name) as parent."""
        return [{"id": s.adapter.name, "object": "model", "created": now(), "owned_by": "engine",
                 "root": s.source or s.adapter.path, "parent": s.parent, "max_model_len": self.engine.max_model_len}
                for s in self.engine.loras]

    async def models(self) -> Response:
        return json_response({"object": "list", "data": [*self._base_cards(), *self._adapter_cards()]}, 200)

    async def model_card(self, model_id: str) -> Response:
        if self.server.check_model(model_id) is not None:  # a 404 for a name not served
            return json_response(next(c for c in self._adapter_cards() if c["id"] == model_id), 200)
        return json_response(self._card(model_id), 200)

    async def load_lora(self) -> Response:
        """vLLM's ``POST /v1/load_lora_adapter`` {lora_name, lora_path}: the adapter is read
        and checked in a worker thread (steps go on), then served; a bad one is a 400
        naming it, and nothing changes."""
        body = await self.server.read_json()
        name, path = _lora_fields(body, "lora_name", "lora_path")
        await self.engine.loras.load(name, path)
        return Response(f"Success: LoRA adapter '{name}' added successfully.", 200,
                        content_type="text/plain; charset=utf-8")

    async def unload_lora(self) -> Response:
        """vLLM's ``POST /v1/unload_lora_adapter`` {lora_name}: new requests may no longer
        name it; those running with it finish. 404 for a name not loaded."""
        body = await self.server.read_json()
        (name,) = _lora_fields(body, "lora_name")
        self.engine.loras.unload(name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", 200,
                        content_type="text/plain; charset=utf-8")

    async def reset_prefix_cache(self) -> Response:
        """vLLM's dev-mode ``POST /reset_prefix_cache``: 200 with no body once every
        engine core dropped its cached prefixes. While requests hold KV blocks vLLM
        declines the reset yet answers 200; here the client is told: 409, nothing
        dropped. vLLM's ``reset_running_requests=true`` preempts the running requests
        first (they recompute later), so the reset happens."""
        running = request.args.get("reset_running_requests", "false").lower()
        if running not in ("true", "1", "false", "0"):
            raise APIError(400, "reset_running_requests must be true or false",
                           param="reset_running_requests", code="invalid_value")
        if not await self.engine.reset_prefix_cache(running in ("true", "1")):
            raise APIError(409, "the prefix cache was not reset: requests hold KV blocks; "
                           "retry when they have finished", code="prefix_cache_in_use")
        return Response("", 200)

    async def server_info(self) -> Response:
        """vLLM's dev-mode ``GET /server_info``: the engine's configuration, every field
        (``engine_config``; under vLLM's key ``vllm_config`` as its one-line text)."""
        fields = json.loads(self.engine.config.to_json())
        return json_response({"vllm_config": self.engine.config.to_json(),
                              "engine_config": fields}, 200)

    async def is_sleeping(self) -> Response:
        """vLLM's dev-mode ``GET /is_sleeping``: ``{"is_sleeping": bool}``."""
        return json_response({"is_sleeping": await self.engine.is_sleeping()}, 200)

    async def sleep(self) -> Response:
        """vLLM's dev-mode ``POST /sleep?level=1&mode=abort``: 200 with no body once every
        engine core sleeps (levels 1 and 2 need ``--enable-sleep-mode``; requests that
        arrive meanwhile wait for the wake-up)."""
        level = _query_int("level", 1)
        await self.engine.sleep(level, request.args.get("mode", "abort"))
        return Response("", 200)

    async def wake_up(self) -> Response:
        """vLLM's dev-mode ``POST /wake_up`` (``?tags=weights&tags=kv_cache``; none: all):
        200 with no body once every core is awake (then it schedules again)."""
        await self.engine.wake_up(request.args.getlist("tags") or None)
        return Response("", 200)

    async def pause(self) -> Response:
        """vLLM's dev-mode ``POST /pause?mode=abort&clear_cache=true`` (its older
        ``wait_for_inflight_requests=true`` is mode "wait"): ``{"status": "paused"}``."""
        mode = request.args.get("mode")
        wait = request.args.get("wait_for_inflight_requests", "false").lower()
        if wait not in ("true", "1", "false", "0"):
            raise APIError(400, "wait_for_inflight_requests must be true or false",
                           param="wait_for_inflight_requests", code="invalid_value")
        if mode is not None and mode != "wait" and wait in ("true", "1"):
            # Two answers to one question: neither is chosen.
            raise APIError(400, f"wait_for_inflight_requests=true is mode=wait; it contradicts "
                           f"mode={mode}", param="wait_for_inflight_requests", code="invalid_value")
        clear = request.args.get("clear_cache", "true").lower()
        if clear not in ("true", "1", "false", "0"):
            raise APIError(400, "clear_cache must be true or false", param="clear_cache",
                           code="invalid_value")
        await self.engine.pause_generation(
            mode=mode or ("wait" if wait in ("true", "1") else "abort"),
            clear_cache=clear in ("true", "1"))
        return json_response({"status": "paused"}, 200)

    async def resume(self) -> Response:
        """vLLM's dev-mode ``POST /resume``: ``{"status": "resumed"}``."""
        await self.engine.resume_generation()
        return json_response({"status": "resumed"}, 200)

    async def collective_rpc(self) -> Response:
        """vLLM's dev-mode ``POST /collective_rpc`` for ``{"method": "reload_weights"}``
        only (every rank reads the checkpoint again): ``{"results": [null, ...]}``, one a
        rank. Another method is a 400 naming ``method``: no caller's code runs here."""
        body = await self.server.read_json()
        if not isinstance(body, dict) or not isinstance(body.get("method"), str):
            raise APIError(400, "the body must be a JSON object with a string `method`",
                           param="method", code="invalid_value")
        timeout = body.get("timeout")
        if timeout is not None and (not isinstance(timeout, int | float) or isinstance(timeout, bool)
                                    or timeout <= 0):
            raise APIError(400, "timeout must be a positive number of seconds", param="timeout",
                           code="invalid_value")
        results = await self.engine.collective_rpc(body["method"], timeout, body.get("args") or (),
                                                   body.get("kwargs") or None)
        return json_response({"results": results}, 200)

    async def is_paused(self) -> Response:
        """vLLM's dev-mode ``GET /is_paused``: ``{"is_paused": bool}``."""
        return json_response({"is_paused": await self.engine.is_paused()}, 200)

    async def start_profile(self) -> Response:
        """vLLM's ``POST /start_profile`` (with ``--profiler-config``): 200 with no body
        once every engine core traces its steps."""
        await self.engine.start_profile()
        return Response("", 200)

    async def stop_profile(self) -> Response:
        """vLLM's ``POST /stop_profile``: 200 with no body once every engine core has
        written its trace to the profiler's folder."""
        await self.engine.stop_profile()
        return Response("", 200)

    async def openapi(self) -> Response:
        return json_response(openapi_document(
            self.server.version, api_key=self.server.api_key is not None,
            tokenizer_info=self.engine.config.enable_tokenizer_info_endpoint), 200)

    async def tokenize(self) -> Response:
        tok = self.engine.tokenizer

        def parse(body: dict[str, Any]) -> tuple[Any, Any, bool]:
            if body.get("messages") is not None and body.get("prompt") is not None:
                # Which one to count would change the answer: neither is guessed.
                raise APIError(400, "tokenize takes a `prompt` or `messages`, not both",
                               param="messages", code="invalid_value")
            if "messages" in body:
                body, _ = legacy_body(body)  # functions, function_call: as chat reads them
                fields = parse_chat_fields(body, self.server.chat_settings, tok.chat_template)
                messages = normalize_messages(body["messages"], images=True)
                if has_images(messages):  # the engine widens each image to its placeholders
                    return (messages, fields.template), True
                return admission.prompt_message(messages, fields.template.to_json()), True
            if isinstance(body.get("prompt"), str):
                return (admission.prompt_message(body["prompt"]),
                        lax_bool(body.get("add_special_tokens"), "add_special_tokens", True))
            raise APIError(400, "tokenize needs a string `prompt` or `messages`",
                           param="prompt", code="invalid_type")

        body = await self.server.read_checked("tokenize")
        self.server.check_model(body.get("model"))
        return_strs = lax_bool(body.get("return_token_strs"), "return_token_strs")
        prompt, add_special_tokens = await self.server.off_loop(lambda: parse(body))
        # Generation's own path (admission), with its guards.
        if isinstance(prompt, tuple):  # chat messages with images: as vLLM, the count
            options = body.get("mm_processor_kwargs")  # holds their placeholders
            if options is not None and not isinstance(options, dict):
                raise APIError(400, "mm_processor_kwargs must be an object",
                               param="mm_processor_kwargs", code="invalid_type")
            ids = await self.engine.tokenize_chat(*prompt, mm_processor_kwargs=options or None)
        else:
            ids = await tokenize_prompt(
                tok, prompt, limiter=self.server.prompt_limiter, add_special_tokens=add_special_tokens,
                template_seconds=self.engine.config.chat_template_timeout,
                max_model_len=self.engine.max_model_len,
                content_format=self.engine.config.chat_template_content_format,
                special_tokens_in_content=self.engine.config.allow_special_tokens_in_content)
        # vLLM's token_strs: each token as the vocabulary spells it (return_token_strs).
        strs = tok.convert_ids_to_tokens(ids) if return_strs else None
        return json_response({"count": len(ids), "max_model_len": self.engine.max_model_len,
                      "tokens": list(ids), "token_strs": strs}, 200)

    async def tokenizer_info(self) -> Response:
        """The tokenizer's configuration (tokenizer_config.json, as vLLM's route gives it)
        and the chat template this server renders with."""
        tok = self.engine.tokenizer
        info = {k: v for k, v in tok.tokenizer_config.items()
                if k not in ("vocab_file", "merges_file", "chat_template")}
        info.setdefault("tokenizer_class", type(tok).__name__)
        template = self.server.chat_settings.chat_template or tok.chat_template
        if template is not None:
            info["chat_template"] = template
        return json_response(info, 200)

    async def detokenize(self) -> Response:
        tok = self.engine.tokenizer
        vocab = tok.vocab_size

        def decode(tokens: Any) -> str:
            if not (isinstance(tokens, list)
                    and all(is_token_id(t) and t < vocab for t in tokens)):
                raise APIError(400, f"tokens must be a list of token ids below {vocab}",
                               param="tokens", code="invalid_value")
            return tok.decode(tokens)

        body = await self.server.read_checked("detokenize")
        self.server.check_model(body.get("model"))
        prompt = await self.server.off_loop(lambda: decode(body.get("tokens")))
        return json_response({"prompt": prompt}, 200)

    async def load(self) -> Response:
        return json_response({"server_load": self.server.in_flight}, 200)


def _lora_fields(body: Any, *names: str) -> tuple[str, ...]:
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_type")
    values = []
    for name in names:
        value = body.get(name)
        if not isinstance(value, str) or not value:
            raise APIError(400, f"{name} must be a non-empty string", param=name, code="invalid_value")
        values.append(value)
    return tuple(values)


def _query_int(name: str, default: int) -> int:
    """An integer query parameter (a 400 naming it when it is not one)."""
    raw = request.args.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise APIError(400, f"{name} must be an integer", param=name, code="invalid_value") from None
