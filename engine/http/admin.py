"""The operational routes: ``/health`` and ``/ping``, ``/version``, ``/metrics``,
``/v1/models``, ``/load``, ``/openapi.json``, ``/tokenize``, ``/detokenize`` and (with
``--enable-tokenizer-info-endpoint``) ``/tokenizer_info``.

``/health``, ``/ping``, ``/metrics`` and ``/load`` answer without the API key
(:data:`engine.http.auth.OPEN_PATHS`).
"""

from __future__ import annotations

from typing import Any

from quart import Response
from quart_trio import QuartTrio

from engine.api import tokenize_prompt
from engine.chat.request import lax_bool, parse_chat_fields
from engine.chat.template import normalize_messages
from engine.core import admission
from engine.errors import EngineDeadError
from engine.http import schema
from engine.http.bodies import json_response
from engine.http.completions.answer import now
from engine.http.completions.protocol import is_token_id
from engine.http.errors import APIError, error_from_exception
from engine.http.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
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

    def _card(self) -> dict[str, Any]:
        eng = self.engine
        return {
            "id": eng.model_name, "object": "model", "created": now(),
            "owned_by": "engine", "root": eng.config.model or eng.model_name, "parent": None,
            "max_model_len": eng.max_model_len,
        }

    async def models(self) -> Response:
        return json_response({"object": "list", "data": [self._card()]}, 200)

    async def model_card(self, model_id: str) -> Response:
        if model_id != self.engine.model_name:
            raise APIError(404, f"The model `{model_id}` does not exist; this server serves "
                           f"`{self.engine.model_name}`.", param="model",
                           code="model_not_found")
        return json_response(self._card(), 200)

    async def openapi(self) -> Response:
        return json_response(schema.openapi(
            self.server.version, api_key=self.server.api_key is not None,
            tokenizer_info=self.engine.config.enable_tokenizer_info_endpoint), 200)

    async def tokenize(self) -> Response:
        tok = self.engine.tokenizer

        def parse(body: dict[str, Any]) -> tuple[Any, Any, bool]:
            if "messages" in body:
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
            ids = await self.engine.tokenize_chat(*prompt)  # holds their placeholders
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
