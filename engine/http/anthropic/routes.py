"""The Anthropic Messages routes: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

A Messages body becomes the chat body it means (:mod:`engine.http.anthropic.protocol`),
which runs as any chat request (:class:`engine.http.completions.run.Run`); the answer is
said back in Anthropic's shapes. Errors on these routes take Anthropic's error body (the
app's error handler asks :func:`engine.http.anthropic.protocol.error_body`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import trio
from quart import Response
from quart_trio import QuartTrio

from engine.api import tokenize_prompt
from engine.chat.request import parse_chat_fields, thinking_budget_params
from engine.chat.template import normalize_messages
from engine.core import admission
from engine.errors import InvalidParamError
from engine.http.anthropic.protocol import (
    MessageEvents,
    chat_body,
    message_from_chat,
    new_id,
    rename_param,
)
from engine.http.bodies import json_response, sse_response
from engine.http.completions.protocol import parse_chat
from engine.http.completions.run import Run
from engine.http.errors import APIError, error_from_exception
from engine.http.server import Server
from engine.messages import RequestOutput
from engine.models.chat_template import template_reads
from engine.multimodal import has_images


class AnthropicRoutes:
    """The handlers of the Messages family, bound to one :class:`Server`."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.engine = server.engine
        self._effort_read: bool | None = None  # see _reads_effort

    def register(self, app: QuartTrio) -> None:
        app.add_url_rule("/v1/messages", view_func=self.messages, methods=["POST"])
        app.add_url_rule("/v1/messages/count_tokens", view_func=self.count_tokens,
                         methods=["POST"])

    def _reads_effort(self) -> bool:
        """Whether the chat template reads ``reasoning_effort`` (``output_config.effort``
        reaches it then): the template is parsed once, on the first request that asks."""
        if self._effort_read is None:
            self._effort_read = template_reads(self.engine.tokenizer.chat_template,
                                               "reasoning_effort")
        return self._effort_read

    @property
    def _switch(self) -> str:
        """The ``chat_template_kwargs`` key that ``thinking`` sets: the reasoning format's
        own switch (Granite's ``thinking``), else Qwen3's ``enable_thinking``."""
        parser = self.server.chat_settings.reasoning
        return parser.switch if parser is not None and parser.switch else "enable_thinking"

    async def messages(self) -> Response:
        """``POST /v1/messages``: the chat path, said in Anthropic's shapes."""
        origins: dict[str, str] = {}  # chat paths of image blocks -> their Messages paths
        chat = chat_body(await self.server.read_json(), origins=origins,
                         reasoning=self.server.chat_settings.reasoning_parser is not None,
                         switch=self._switch,
                         reads_effort=self._reads_effort)
        try:
            req = await self.server.off_loop(lambda: parse_chat(
                chat, self.server.chat_settings, self.engine.tokenizer.chat_template,
                defaults=self.server.sampling_defaults))
            if chat.get("thinking_token_budget") is not None:  # thinking.budget_tokens
                tok = self.engine.tokenizer
                req = dataclasses.replace(req, params=thinking_budget_params(
                    chat, req.params, self.server.chat_settings, req.chat_fields,
                    lambda text: tok.encode(text, add_special_tokens=False)))
            self.server.check_base_model(req.model)
            run = Run(self.engine, req, self.server.metrics.timer(),
                      self.server.answer_options, self.server.load_tracker())
            await run.submit_all(self.server.request_id())
        except (APIError, InvalidParamError) as exc:
            raise rename_param(error_from_exception(exc), origins) from None
        msg_id, model = new_id(), self.engine.model_name
        if req.stream:
            events = MessageEvents(
                msg_id, model, sum(len(s.prompt_token_ids) for s in run.streams))
            return sse_response(lambda send: write_events(run, send, events), run.close)
        return json_response(message_from_chat(await run.collect(), msg_id, model), 200)

    async def count_tokens(self) -> Response:
        """``POST /v1/messages/count_tokens``: the prompt's length, as the route would
        template it."""
        origins: dict[str, str] = {}
        chat = chat_body(await self.server.read_json(), count_only=True, origins=origins,
                         reasoning=self.server.chat_settings.reasoning_parser is not None,
                         switch=self._switch,
                         reads_effort=self._reads_effort)
        self.server.check_base_model(chat["model"])
        tok = self.engine.tokenizer

        def parse() -> Any:
            fields = parse_chat_fields(chat, self.server.chat_settings, tok.chat_template)
            messages = normalize_messages(chat["messages"], images=True)
            if has_images(messages):
                return messages, fields.template
            return admission.prompt_message(messages, fields.template.to_json())

        try:
            prompt = await self.server.off_loop(parse)
            if isinstance(prompt, tuple):  # image blocks count as their placeholder tokens
                ids = await self.engine.tokenize_chat(*prompt)
            else:
                ids = await tokenize_prompt(
                    tok, prompt, limiter=self.server.prompt_limiter,
                    template_seconds=self.engine.config.chat_template_timeout,
                    max_model_len=self.engine.max_model_len,
                    content_format=self.engine.config.chat_template_content_format,
                    special_tokens_in_content=self.engine.config.allow_special_tokens_in_content)
        except (APIError, InvalidParamError) as exc:
            raise rename_param(error_from_exception(exc), origins) from None
        return json_response({"input_tokens": len(ids)}, 200)


async def write_events(run: Run, send: trio.MemorySendChannel[bytes],
                       events: MessageEvents) -> None:
    """The SSE body of an Anthropic Messages stream: the same chunks as
    :meth:`Run.write_sse`, said as Messages events; an error ends it with an error event."""
    async with send:
        for frame in events.start():
            await send.send(frame)

        async def say(chunks: list[dict[str, Any]]) -> None:
            for chunk in chunks:
                for frame in events.chunk(chunk):
                    await send.send(frame)

        await say(run.answer.opening_chunks())

        async def on_output(prompt_index: int, out: RequestOutput) -> None:
            await say(run.answer.stream_output(prompt_index, out))

        await run.pump_all(on_output)
        if run.error is not None:
            await send.send(events.error(run.error))
        else:
            await say([run.answer.usage_chunk()])
