"""SageMaker's one route, ``POST /invocations``: a chat, completions or embeddings body,
told apart by its shape as vLLM does, handed to that family's handler."""

from __future__ import annotations

from quart import Response
from quart_trio import QuartTrio

from engine.http.completions.routes import CompletionsRoutes
from engine.http.errors import APIError
from engine.http.pooling.routes import PoolingRoutes
from engine.http.server import Server


class InvocationsRoute:
    """``/invocations`` over the completions and pooling families' handlers."""

    def __init__(self, server: Server, completions: CompletionsRoutes,
                 pooling: PoolingRoutes) -> None:
        self.server = server
        self.completions = completions
        self.pooling = pooling

    def register(self, app: QuartTrio) -> None:
        app.add_url_rule("/invocations", view_func=self.invocations, methods=["POST"])

    async def invocations(self) -> Response:
        """SageMaker's one route: a chat body (``messages``), a completions body
        (``prompt``) or an embeddings body (``input``), told apart by shape as vLLM
        does."""
        body = await self.server.read_json()
        if isinstance(body, dict) and "messages" in body:
            return await self.completions.chat_body(
                await self.server.off_loop(lambda: self.server.checked(body, "chat")))
        if isinstance(body, dict) and "prompt" in body:
            return await self.completions.completions_body(
                await self.server.off_loop(lambda: self.server.checked(body, "completion")))
        if isinstance(body, dict) and "input" in body:
            return await self.pooling.embeddings_body(
                await self.server.off_loop(lambda: self.server.checked(body, "embeddings")))
        raise APIError(400, "/invocations takes a chat completions body (with `messages`), "
                       "a completions body (with `prompt`) or an embeddings body (with "
                       "`input`)", code="invalid_value")
