"""The embedded chat API: messages and tools in, typed assistant messages out.

::

    async with engine.open_engine() as eng:
        result = await eng.chat(messages, tools=tools, tool_choice="required")
        call = result.choices[0].message.tool_calls[0]      # ToolCall(id, name, arguments)

        async for chunk in eng.chat_stream(messages, tools=tools):
            chunk.delta.content, chunk.delta.reasoning, chunk.delta.tool_calls

Tools go in as :class:`Tool` values or OpenAI dicts, ``tool_choice`` as a
:class:`ToolChoice` or OpenAI's form; a reply's :class:`ChatMessage` can go straight back
into the history (its calls as the template expects them)::

    weather = Tool("get_weather", {"type": "object", "properties": {"city": {...}}})
    result = await eng.chat(messages, tools=[weather], tool_choice=ToolChoice("required"))
    message = result.choices[0].message
    call = message.tool_calls[0]; call.name, call.args()                 # a dict
    messages += [message, {"role": "tool", "tool_call_id": call.id, "content": "9C"}]

The same checks and parsers as the HTTP server (:mod:`engine.chat.request`,
:mod:`engine.chat.output`): bad tools, ``tool_choice`` or history raise
:class:`InvalidParamError` naming the field, before anything is queued.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from engine.chat.output import ChatDelta, ChatMessage, ChatOutputParser
from engine.chat.request import (
    ChatFields,
    ChatSettings,
    calls_constrained,
    chat_sampling_params,
    parse_chat_fields,
)
from engine.chat.tools import Tool, ToolChoice
from engine.params import SamplingParams

# What tools, tool_choice and history messages may be given as.
ToolLike = Tool | Mapping[str, Any]
MessageLike = ChatMessage | Mapping[str, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class ChatChoice:
    index: int
    message: ChatMessage
    finish_reason: str | None  # "tool_calls" when calls ended the turn


@dataclasses.dataclass(frozen=True, slots=True)
class ChatResult:
    choices: tuple[ChatChoice, ...]
    prompt_tokens: int
    completion_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class ChatChunk:
    """One streamed piece of choice ``index``; ``finish_reason`` is set on its last."""

    index: int
    delta: ChatDelta
    finish_reason: str | None = None


def prepare_chat(
    engine: Any, params: SamplingParams | None, *, tools: Sequence[ToolLike] | None,
    tool_choice: Any, parallel_tool_calls: bool, settings: ChatSettings | None,
    template_fields: Mapping[str, Any],
) -> tuple[ChatFields, SamplingParams]:
    """Check the chat arguments (as the HTTP body's fields) and adjust ``params``."""
    body: dict[str, Any] = {"tools": [_openai_tool(t) for t in tools] if tools is not None
                            else None,
                            "tool_choice": _openai_choice(tool_choice),
                            "parallel_tool_calls": parallel_tool_calls,
                            **template_fields}
    settings = settings or ChatSettings(trust_request_chat_template=True)
    fields = parse_chat_fields(body, settings, engine.tokenizer.chat_template)
    if params is None:
        params = SamplingParams(max_tokens=engine.default_max_tokens, **engine.sampling_defaults)
    return fields, chat_sampling_params(params, fields)


def _openai_tool(tool: ToolLike) -> Any:
    return tool.to_openai() if isinstance(tool, Tool) else tool


def _openai_choice(choice: Any) -> Any:
    if not isinstance(choice, ToolChoice):
        return choice
    if choice.mode == "function":
        return {"type": "function", "function": {"name": choice.name}}
    return choice.mode


def _openai_messages(messages: Sequence[MessageLike]) -> list[Any]:
    """The history as OpenAI message dicts (a :class:`ChatMessage` from an earlier reply
    becomes its assistant message, calls included; its reasoning is left out, as chat
    templates drop earlier turns' thinking)."""
    out: list[Any] = []
    for m in messages:
        if isinstance(m, ChatMessage):
            m = {k: v for k, v in m.to_openai().items()
                 if k not in ("reasoning", "reasoning_content")}
        out.append(m)
    return out


async def chat_stream(
    engine: Any, messages: Sequence[MessageLike], params: SamplingParams | None = None,
    *, tools: Sequence[ToolLike] | None = None, tool_choice: Any = None,
    parallel_tool_calls: bool = True, settings: ChatSettings | None = None,
    lora: str | None = None, **template_fields: Any,
) -> AsyncIterator[ChatChunk]:
    """Stream the assistant's reply as :class:`ChatChunk` values (see :func:`chat`)."""
    fields, params = prepare_chat(
        engine, params, tools=tools, tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls, settings=settings,
        template_fields=template_fields)
    parsers: dict[int, ChatOutputParser] = {}
    constrained = calls_constrained(fields, params)
    stream = await engine.submit(_openai_messages(messages), params,
                                 chat_options=fields.template, lora=lora)
    async with stream:
        async for out in stream:
            parser = parsers.get(out.index)
            if parser is None:  # the choice's first output
                parser = parsers[out.index] = ChatOutputParser(
                    fields.output, constrained=constrained)
            delta = parser.feed(out.text)
            if out.finished:
                end = parser.finish(cut_short=out.finish_reason == "length")
                delta = ChatDelta(delta.reasoning + end.reasoning, delta.content + end.content,
                                  delta.tool_calls + end.tool_calls)
                yield ChatChunk(out.index, delta, parser.finish_reason(out.finish_reason))
            elif delta:
                yield ChatChunk(out.index, delta)


async def chat(
    engine: Any, messages: Sequence[MessageLike], params: SamplingParams | None = None,
    *, tools: Sequence[ToolLike] | None = None, tool_choice: Any = None,
    parallel_tool_calls: bool = True, settings: ChatSettings | None = None,
    lora: str | None = None, **template_fields: Any,
) -> ChatResult:
    """Run one chat request to the end and return its messages.

    ``tools`` are :class:`Tool` values or OpenAI function tools; ``tool_choice`` a
    :class:`ToolChoice`, ``"none"``, ``"auto"``, ``"required"`` or ``{"type":
    "function", "function": {"name": ...}}``; ``messages`` OpenAI message dicts or the
    :class:`ChatMessage` of an earlier reply.
    ``settings`` names the tool-call and reasoning parsers (as the server's flags);
    ``template_fields`` are the chat-template fields of the HTTP API
    (``chat_template_kwargs``, ``add_generation_prompt``, ``continue_final_message``,
    ``chat_template``). ``lora`` names a served LoRA adapter to reply with. With ``params``
    None, the model's sampling defaults apply and the
    reply may run to the end of the context.
    """
    fields, params = prepare_chat(
        engine, params, tools=tools, tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls, settings=settings,
        template_fields=template_fields)
    parsers: dict[int, ChatOutputParser] = {}
    constrained = calls_constrained(fields, params)
    reasons: dict[int, str | None] = {}
    tokens = 0
    stream = await engine.submit(_openai_messages(messages), params,
                                 chat_options=fields.template, lora=lora)
    async with stream:
        async for out in stream:
            parser = parsers.get(out.index)
            if parser is None:  # the choice's first output
                parser = parsers[out.index] = ChatOutputParser(
                    fields.output, constrained=constrained)
            parser.feed(out.text)
            tokens += len(out.token_ids)
            if out.finished:
                parser.finish()
                reasons[out.index] = parser.finish_reason(out.finish_reason)
    choices = tuple(ChatChoice(i, parsers[i].message(cut_short=reasons.get(i) == "length"),
                               reasons.get(i)) for i in sorted(parsers))
    return ChatResult(choices, len(stream.prompt_token_ids), tokens)
