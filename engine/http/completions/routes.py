"""The routes of OpenAI's completions and chat, and vLLM's around them: ``/v1/completions``,
``/v1/chat/completions``, the two ``/render`` routes and ``/inference/v1/generate``.

A non-streamed request waits for its answer in the handler; a streamed one is submitted
here (so bad input is a 4xx) and pumped while quart sends the body (:class:`Run`,
:func:`engine.http.bodies.sse_response`).
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio
from quart import Response
from quart_trio import QuartTrio

from engine.chat.request import thinking_budget_params
from engine.chat.template import ChatTokenizer
from engine.core import admission
from engine.http import sse
from engine.http.bodies import json_response, sse_response
from engine.http.completions import protocol, tokens
from engine.http.completions.protocol import CompletionRequest
from engine.http.completions.run import Run
from engine.http.errors import LOGGED_ELSEWHERE, APIError, error_from_exception
from engine.http.server import Server

if TYPE_CHECKING:
    from engine.api import StreamLike

logger = logging.getLogger("engine.http")


class CompletionsRoutes:
    """The handlers of the completions family, bound to one :class:`Server`."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.engine = server.engine

    def register(self, app: QuartTrio) -> None:
        app.add_url_rule("/v1/completions", view_func=self.completions, methods=["POST"])
        app.add_url_rule("/v1/chat/completions", view_func=self.chat, methods=["POST"])
        app.add_url_rule("/inference/v1/generate", view_func=self.generate_tokens,
                         methods=["POST"])
        app.add_url_rule("/v1/chat/completions/render", view_func=self.render_chat,
                         methods=["POST"])
        app.add_url_rule("/v1/completions/render", view_func=self.render_completions,
                         methods=["POST"])

    async def completions(self) -> Response:
        return await self.completions_body(await self.server.read_checked("completion"))

    async def chat(self) -> Response:
        return await self.chat_body(await self.server.read_checked("chat"))

    async def completions_body(self, body: Any) -> Response:
        def parse() -> CompletionRequest:
            req = protocol.parse_completion(body, defaults=self.server.sampling_defaults)
            req = _fill_in_the_middle(req, self.engine.tokenizer)
            _check_token_prompts(req, self.engine.max_model_len)
            return req

        return await self._generate(await self.server.off_loop(parse))

    async def chat_body(self, body: Any) -> Response:
        def parse() -> CompletionRequest:
            req = protocol.parse_chat(body, self.server.chat_settings,
                                      self.engine.tokenizer.chat_template,
                                      defaults=self.server.sampling_defaults)
            if body.get("thinking_token_budget") is not None:
                tok = self.engine.tokenizer
                req = dataclasses.replace(req, params=thinking_budget_params(
                    body, req.params, self.server.chat_settings, req.chat_fields,
                    lambda text: tok.encode(text, add_special_tokens=False)))
            return req

        return await self._generate(await self.server.off_loop(parse))

    async def _generate(self, req: CompletionRequest) -> Response:
        lora = self.server.check_model(req.model)
        run = Run(self.engine, req, self.server.metrics.timer(), self.server.answer_options,
                  self.server.load_tracker(), lora=lora)
        await run.submit_all(self.server.request_id(req.request_id))
        if req.stream:
            return sse_response(run.write_sse, run.close)
        response = json_response(await run.collect(), 200)
        self.server.add_load_report(response)
        return response

    # -- render: what a request would run ------------------------------------------------

    async def render_chat(self) -> Response:
        """vLLM's ``/v1/chat/completions/render``: the ``/inference/v1/generate`` request a
        chat body would run (its prompt through the chat template), without running it."""
        body = await self.server.read_checked("chat")
        req = protocol.parse_chat(body, self.server.chat_settings,
                                  self.engine.tokenizer.chat_template,
                                  defaults=self.server.sampling_defaults)
        self.server.check_base_model(req.model)
        if body.get("thinking_token_budget") is not None:
            raise APIError(400, "render does not support thinking_token_budget (the "
                           "generate request cannot carry it)", param="thinking_token_budget",
                           code="unsupported_parameter")
        assert req.chat_fields is not None  # a chat request has them
        (messages,) = req.prompts
        prompt = admission.prompt_message(messages, req.chat_fields.template.to_json())
        config = self.engine.config
        tokenizer = ChatTokenizer(self.engine.tokenizer,
                                  content_format=config.chat_template_content_format)
        truncate = req.params.truncate_prompt_tokens
        return json_response(self._rendered(req, 0, list(admission.prompt_token_ids(
            tokenizer, prompt,
            special_tokens_in_content=config.allow_special_tokens_in_content,
            truncate=None if truncate is None
            else admission.truncation_limit(truncate, self.engine.max_model_len),
            truncation_side=req.params.truncation_side))), 200)

    async def render_completions(self) -> Response:
        """vLLM's ``/v1/completions/render``: one ``/inference/v1/generate`` request per
        prompt of a completions body, without running them."""
        req = protocol.parse_completion(await self.server.read_checked("completion"),
                                        defaults=self.server.sampling_defaults)
        self.server.check_base_model(req.model)
        tok = self.engine.tokenizer
        req = _fill_in_the_middle(req, tok)
        truncate = req.params.truncate_prompt_tokens
        limit = None if truncate is None else admission.truncation_limit(
            truncate, self.engine.max_model_len)
        rendered = []
        for i, prompt in enumerate(req.prompts):
            ids = list(admission.prompt_token_ids(tok, admission.prompt_message(prompt),
                                                  truncate=limit,
                                                  truncation_side=req.params.truncation_side))
            rendered.append(self._rendered(req, i, ids))
        return json_response(rendered, 200)

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
        if req.returned_n is not None:
            # /inference/v1/generate returns every sample; none is chosen among them.
            raise APIError(400, "render does not support best_of", param="best_of",
                           code="unsupported_parameter")
        if len(ids) >= self.engine.max_model_len:
            raise APIError(400, f"The prompt is {len(ids)} tokens; the context is "
                           f"{self.engine.max_model_len}.", param="messages" if req.chat
                           else "prompt", code="context_length_exceeded")
        # The id the chat or completions answer would carry (chatcmpl-/cmpl-, as vLLM's
        # render writes it), one per prompt.
        base = ("chatcmpl-" if req.chat else "cmpl-") + (
            self.server.request_id(req.request_id) or uuid.uuid4().hex)
        request_id = base if len(req.prompts) == 1 else f"{base}-{index}"
        options = ({"include_usage": req.include_usage,
                    "continuous_usage_stats": req.continuous_usage}
                   if req.include_usage or req.continuous_usage else None)
        return tokens.render_body(ids, req.params, max_model_len=self.engine.max_model_len,
                                  model=self.engine.model_name, request_id=request_id,
                                  priority=req.priority, cache_salt=req.cache_salt,
                                  stream=req.stream, stream_options=options)

    # -- tokens in, tokens out ----------------------------------------------------------

    async def generate_tokens(self) -> Response:
        """vLLM's ``POST /inference/v1/generate``: token ids and sampling params in, token
        ids out (no text, no chat template); one JSON body, or SSE chunks with
        ``stream``."""
        req = tokens.parse_generate(await self.server.read_json(),
                                    defaults=self.server.sampling_defaults)
        lora = self.server.check_model(req.model)
        base_id = self.server.request_id() if req.request_id is None else req.request_id
        finish = self.server.load_tracker()
        try:
            stream = await self.engine.submit(list(req.token_ids), req.params,
                                              request_id=base_id, priority=req.priority,
                                              cache_salt=req.cache_salt, lora=lora)
        except BaseException:
            finish()
            raise
        answer = tokens.GenerateAnswer(stream.request_id, req.params.n,
                                       len(stream.prompt_token_ids), req.params.logprobs,
                                       continuous_usage=req.continuous_usage)
        if req.stream:
            async def unsent() -> None:
                try:
                    await stream.aclose()
                finally:
                    finish()

            return sse_response(lambda send: _write_generate(
                stream, answer, req.include_usage, finish, send), unsent)
        try:
            async with stream:
                async for out in stream:
                    answer.record(out)
        finally:
            finish()
        response = json_response(answer.response(), 200)
        self.server.add_load_report(response)
        return response


async def _write_generate(stream: StreamLike, answer: tokens.GenerateAnswer,
                          include_usage: bool, finish: Callable[[], None],
                          send: trio.MemorySendChannel[bytes]) -> None:
    """A streamed ``/inference/v1/generate``: a chunk per output, then the usage chunk
    (when asked) or the error, then ``[DONE]``."""
    async with send:
        error: APIError | None = None
        try:
            async with stream:
                async for out in stream:
                    for chunk in answer.stream_output(out):
                        await send.send(sse.event(chunk))
        except Exception as exc:
            error = error_from_exception(exc)
            if error.status >= 500 and error.code not in LOGGED_ELSEWHERE:
                logger.error("request %s failed", stream.request_id, exc_info=exc)
        finally:
            finish()
        if error is not None:
            await send.send(sse.event(error.body()))
        elif include_usage:
            await send.send(sse.event(answer.usage_chunk()))
        await send.send(sse.DONE)


def _fill_in_the_middle(req: CompletionRequest, tokenizer: Any) -> CompletionRequest:
    """A ``suffix`` request with each prompt laid out in the model's FIM tokens (token
    ids; the texts are tokenized as any completions prompt is)."""
    if req.suffix is None:
        return req
    suffix = req.suffix
    return dataclasses.replace(req, prompts=tuple(
        list(admission.fim_prompt_ids(tokenizer, prompt, suffix)) for prompt in req.prompts))


def _check_token_prompts(req: CompletionRequest, max_model_len: int) -> None:
    """Refuse a token-id prompt that cannot fit the context here, in the parse thread:
    admission would too, but only after walking its ids on the event loop."""
    if req.params.truncate_prompt_tokens is not None:
        return  # cut to fit by admission
    for prompt in req.prompts:
        if isinstance(prompt, list) and len(prompt) >= max_model_len:
            raise APIError(
                400, f"This model's maximum context length is {max_model_len} tokens. "
                f"However, the prompt holds {len(prompt)} token ids, which leaves no room "
                "for the completion. Please reduce the prompt.", param="prompt",
                code="context_length_exceeded")

