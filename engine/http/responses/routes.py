"""The Responses routes: ``POST /v1/responses``, and ``GET``/``DELETE`` of a stored response
and its input items.

A Responses request runs as a chat request (:class:`ResponsesRun`, a
:class:`engine.http.completions.run.Run`) whose outputs a
:class:`engine.http.responses.builder.ResponseBuilder` says as output items and typed
events. The routes own the store (:class:`engine.http.responses.store.ResponseStore`:
in memory, bounded, lost on restart; see docs/serving.md).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import trio
from quart import Response, request
from quart_trio import QuartTrio

from engine.api.metrics import RequestTimer
from engine.chat.output import ChatOutputParser
from engine.chat.request import calls_constrained
from engine.errors import InvalidParamError, PromptTooLongError
from engine.http import sse
from engine.http.bodies import json_response, sse_response
from engine.http.completions.answer import AnswerOptions
from engine.http.completions.run import Run
from engine.http.errors import APIError
from engine.http.responses.builder import ResponseBuilder, input_items_page
from engine.http.responses.protocol import ResponsesRequest, parse_responses, rename, truncated
from engine.http.responses.store import MissingResponse, ResponseStore
from engine.http.server import Server
from engine.messages import RequestOutput

if TYPE_CHECKING:
    from engine.api import EngineLike

logger = logging.getLogger("engine.http")


class ResponsesRoutes:
    """The handlers of the Responses family, bound to one :class:`Server`, and the store
    they keep responses in."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.engine = server.engine
        # /v1/responses' store: in memory, bounded, lost on restart (docs/serving.md).
        self.store = ResponseStore(server.engine.config.responses_store_bytes,
                                   server.engine.config.responses_store_ttl)

    def register(self, app: QuartTrio) -> None:
        app.add_url_rule("/v1/responses", view_func=self.create_response, methods=["POST"])
        app.add_url_rule("/v1/responses/<response_id>", view_func=self.get_response,
                         methods=["GET"])
        app.add_url_rule("/v1/responses/<response_id>", view_func=self.delete_response,
                         methods=["DELETE"])
        app.add_url_rule("/v1/responses/<response_id>/input_items",
                         view_func=self.response_input_items, methods=["GET"])
        app.add_url_rule("/v1/responses/<response_id>/cancel",
                         view_func=self.cancel_response, methods=["POST"])

    async def create_response(self) -> Response:
        body = await self.server.read_checked("responses")
        req = await self.server.off_loop(lambda: parse_responses(
            body, history=self.store.history, settings=self.server.chat_settings,
            model_template=self.engine.tokenizer.chat_template,
            defaults=self.server.sampling_defaults))
        self.server.check_base_model(req.chat.model)
        request_id = self.server.request_id()
        while True:
            run = ResponsesRun(self.engine, req, self.server.metrics.timer(),
                               self.server.answer_options, self.store)
            try:
                await run.submit_all(request_id)
                break
            except PromptTooLongError:
                # truncation "auto": drop the oldest input item and try again.
                shorter = truncated(req) if req.echo["truncation"] == "auto" else None
                if shorter is None:
                    raise
                req = shorter
            except (APIError, InvalidParamError) as exc:
                rename(exc, req)  # a bad image: its input part
                raise
        if req.stream:
            return sse_response(run.write_response_events, run.close)
        return json_response(await run.collect_response(), 200)

    def _stored(self, response_id: str) -> Any:
        try:
            return self.store.get(response_id)
        except MissingResponse:
            raise APIError(404, f"Response with id {response_id!r} not found (stored "
                           "responses live in memory, bounded in size and age, and are lost "
                           "on restart).", param="response_id", code="not_found") from None

    async def get_response(self, response_id: str) -> Response:
        for name in ("stream", "include", "include[]", "starting_after"):
            if request.args.get(name) not in (None, "", "false"):
                raise APIError(400, f"{name} is not supported when retrieving a response",
                               param=name, code="unsupported_parameter")
        return json_response(self._stored(response_id).body, 200)

    async def delete_response(self, response_id: str) -> Response:
        self._stored(response_id)
        self.store.delete(response_id)
        return json_response({"id": response_id, "object": "response.deleted", "deleted": True},
                             200)

    async def cancel_response(self, response_id: str) -> Response:
        """OpenAI's cancel is for a response running in the background; this server runs
        none (``background`` is refused), so a stored response was answered already: a
        400 saying so (a 404 for one it does not hold)."""
        self._stored(response_id)
        raise APIError(400, f"Response {response_id!r} cannot be cancelled: only responses "
                       "created with background: true can be, and this server runs every "
                       "response in the foreground (it is already complete).",
                       param="response_id", code="invalid_value")

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
        return json_response(input_items_page(items, limit=int(limit), order=order,
                                              after=args.get("after")), 200)


class ResponsesRun(Run):
    """A ``/v1/responses`` request: a chat run whose outputs go through a
    :class:`ResponseBuilder` (one JSON response, or typed SSE events), and
    whose finished answer is stored (``store``) before its last event is sent, so the
    client's next turn finds it."""

    def __init__(self, engine: EngineLike, req: ResponsesRequest,
                 timer: RequestTimer, options: AnswerOptions,
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
        events = builder.feed(out.text, len(out.token_ids), self.answer.logprob_entries(out.logprobs))
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

        await self.pump_all(on_output)
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

            await self.pump_all(on_output)
            if self.error is not None:
                for event in builder.fail(self.error):
                    await send.send(sse.typed_event(event))
