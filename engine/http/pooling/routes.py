"""The pooling routes: ``/v1/embeddings``, ``/v1/score`` (also ``/score``),
``/v1/rerank`` (also ``/rerank``, ``/v2/rerank``), ``/classify`` (also ``/v1/classify``) and
vLLM's generic ``/pooling``.

Each waits for its answer in the handler: a disconnect cancels the wait, and
``Engine.pool``'s cleanup aborts the inputs still running and frees their blocks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from quart import Response
from quart_trio import QuartTrio

from engine.api import tokenize_prompt
from engine.api.metrics import RequestTimer
from engine.chat.request import template_options
from engine.chat.template import normalize_messages
from engine.core import admission
from engine.core.pooling import Pooled
from engine.http.bodies import json_response
from engine.http.errors import APIError
from engine.http.pooling import protocol
from engine.http.server import Server


class PoolingRoutes:
    """The handlers of the pooling family, bound to one :class:`Server`."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.engine = server.engine

    def register(self, app: QuartTrio) -> None:
        app.add_url_rule("/v1/embeddings", view_func=self.embeddings, methods=["POST"])
        # vLLM's paths for the same two routes, with and without the version.
        for path in ("/v1/score", "/score"):
            app.add_url_rule(path, view_func=self.score, methods=["POST"])
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            app.add_url_rule(path, view_func=self.rerank, methods=["POST"])
        for path in ("/classify", "/v1/classify"):  # vLLM's, and SGLang's
            app.add_url_rule(path, view_func=self.classify, methods=["POST"])
        app.add_url_rule("/pooling", view_func=self.pooling, methods=["POST"])

    async def embeddings(self) -> Response:
        return await self.embeddings_body(await self.server.read_checked("embeddings"))

    async def embeddings_body(self, body: Any) -> Response:
        req = protocol.parse_embedding(body)
        lora = self.server.check_model(req.model)  # a decoder embedder's adapter, or None
        timer = self.server.metrics.timer()
        source = req.input if req.input is not None else [await self._chat_ids(body, req)]
        pooled = await self.engine.embed(
            source, dimensions=req.dimensions, normalize=req.normalize,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            add_special_tokens=req.add_special_tokens, request_id=self.server.request_id(),
            priority=req.priority, lora=lora)
        self._observe(timer, [p.prompt_tokens for p in pooled])
        if req.encoding.format.startswith("bytes"):
            return self._binary("embd", lora or self.engine.model_name, pooled, False, req.encoding)
        return Response(protocol.embedding_response(lora or self.engine.model_name, pooled,
                                                    req.encoding),
                        200, content_type="application/json")

    @staticmethod
    def _binary(prefix: str, model: str, pooled: list[Pooled], per_token: bool,
                encoding: protocol.Encoding) -> Response:
        body, headers = protocol.binary_response(prefix, model, pooled, per_token, encoding)
        return Response(body, 200, content_type="application/octet-stream", headers=headers)

    async def pooling(self) -> Response:
        """vLLM's generic pooling route: the embeddings body (``input`` or ``messages``)
        with a ``task``: ``embed`` (as /v1/embeddings), ``classify`` (as /classify's
        probabilities), ``token_embed`` (every token's hidden state, the default for an
        embedding model) or ``token_classify`` (a token classifier's probabilities for
        every token, its default)."""
        body = await self.server.read_checked("pooling")
        req = protocol.parse_embedding(body, "pooling")
        lora = self.server.check_model(req.model)  # adapters exist for decoder embedders only
        if self.engine.pooler is None:
            raise APIError(400, f"the model {self.engine.model_name} generates; it has no "
                           "pooler (serve it with --convert embed to pool with it)",
                           param="model", code="invalid_value")
        task = protocol.pooling_task(body, self.engine.pooler.task)
        timer = self.server.metrics.timer()
        source = req.input if req.input is not None else [await self._chat_ids(body, req)]
        common = dict(truncate_prompt_tokens=req.truncate_prompt_tokens,
                      add_special_tokens=req.add_special_tokens,
                      request_id=self.server.request_id(), priority=req.priority)
        if task == "embed":
            pooled = await self.engine.embed(source, dimensions=req.dimensions,
                                             normalize=req.normalize, lora=lora, **common)
        elif task == "token_embed":
            pooled = await self.engine.embed_tokens(source, normalize=req.normalize, lora=lora,
                                                    **common)
        elif task == "token_classify":
            pooled = await self.engine.classify_tokens(source, use_activation=req.use_activation,
                                                       **common)
        else:
            results = await self.engine.classify(source, use_activation=req.use_activation,
                                                 **common)
            pooled = [Pooled(np.asarray(probs, dtype="<f4").tobytes(), n) for probs, n in results]
        self._observe(timer, [p.prompt_tokens for p in pooled])
        if req.encoding.format.startswith("bytes"):
            return self._binary("pool", lora or self.engine.model_name, pooled,
                                task.startswith("token_"), req.encoding)
        return Response(protocol.pooling_response(lora or self.engine.model_name, pooled, task,
                                                  req.encoding),
                        200, content_type="application/json")

    async def _chat_ids(self, body: dict[str, Any], req: protocol.EmbeddingRequest) -> list[int]:
        """vLLM's chat embeddings: ``messages`` rendered by the chat template (as a chat
        request renders them, with its guards, but no generation prompt unless asked),
        tokenized."""
        tok = self.engine.tokenizer

        def render() -> Any:
            template = template_options(body, self.server.chat_settings, generation_prompt=False)
            messages = normalize_messages(body["messages"])
            return admission.prompt_message(messages, template.to_json())

        prompt = await self.server.off_loop(render)
        config = self.engine.config
        ids = await tokenize_prompt(
            tok, prompt, limiter=self.server.prompt_limiter,
            add_special_tokens=req.add_special_tokens,
            template_seconds=config.chat_template_timeout, max_model_len=self.engine.max_model_len,
            content_format=config.chat_template_content_format,
            special_tokens_in_content=config.allow_special_tokens_in_content)
        return list(ids)

    async def classify(self) -> Response:
        req = protocol.parse_classify(await self.server.read_checked("classify"))
        self.server.check_base_model(req.model)
        timer = self.server.metrics.timer()
        results = await self.engine.classify(
            req.input, use_activation=req.use_activation,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            add_special_tokens=req.add_special_tokens, request_id=self.server.request_id(),
            priority=req.priority)
        self._observe(timer, [n for _, n in results])
        assert self.engine.pooler is not None  # classify refuses a generation model
        return json_response(protocol.classify_response(
            self.engine.model_name, self.engine.pooler.labels, results), 200)

    async def score(self) -> Response:
        req = protocol.parse_score(await self.server.read_checked("score"))
        lora = self.server.check_model(req.model)  # a decoder embedder's adapter, or None
        timer = self.server.metrics.timer()
        scores = await self.engine.score(
            req.first, req.second, truncate_prompt_tokens=req.truncate_prompt_tokens,
            request_id=self.server.request_id(), priority=req.priority, lora=lora)
        self._observe(timer, [n for _, n in scores])
        return json_response(protocol.score_response(lora or self.engine.model_name, scores), 200)

    async def rerank(self) -> Response:
        req = protocol.parse_rerank(await self.server.read_checked("rerank"))
        lora = self.server.check_model(req.model)
        timer = self.server.metrics.timer()
        scores = await self.engine.score(
            req.first, req.second, truncate_prompt_tokens=req.truncate_prompt_tokens,
            request_id=self.server.request_id(), priority=req.priority, lora=lora)
        self._observe(timer, [n for _, n in scores])
        return json_response(protocol.rerank_response(lora or self.engine.model_name, req,
                                                      scores), 200)

    @staticmethod
    def _observe(timer: RequestTimer, prompt_tokens: list[int]) -> None:
        """A pooling request's metrics: its inputs' tokens (prompt tokens), one successful
        "stop" per input, and its end-to-end latency; nothing is generated."""
        timer.prompt(sum(prompt_tokens))
        for i in range(len(prompt_tokens)):
            timer.output(i, 0, "stop")
        timer.done()
