"""Anthropic's Messages API (``POST /v1/messages``) over the chat path.

Coding agents and the ``anthropic`` client speak this protocol to local servers (vLLM and
llama.cpp serve it too). Nothing here runs a model: a Messages body is rewritten as the
OpenAI chat body it means (:func:`chat_body`), which the server parses, templates and runs
as any chat request (tools, the fallback tool prompt, reasoning, constraints); the chat
answer is then said in Anthropic's shapes (:func:`message_from_chat`, and
:class:`MessageEvents` for a stream). Pure: no I/O, no trio.

What maps to what:

===========================  ==============================================================
Messages                     chat
===========================  ==============================================================
``system`` (text or blocks)  a first ``system`` message
``text`` blocks              the message's text parts (one block: a string)
``image`` blocks (user)      ``image_url`` parts: a ``base64`` source as a ``data:`` URL, a
                             ``url`` source as the URL (served as chat serves them)
``tool_use`` (assistant)     ``tool_calls`` (``input`` as the arguments)
``tool_result`` (user)       a ``tool`` message answering ``tool_use_id``, before the text
``thinking`` (assistant)     dropped, as chat templates drop earlier turns' reasoning
a final assistant message    a prefill the model continues (``continue_final_message``)
``tools[].input_schema``     ``tools[].function.parameters``
``tool_choice``              ``auto``, ``any`` -> ``required``, ``tool`` -> the named
                             function, ``none``; ``disable_parallel_tool_use`` ->
                             ``parallel_tool_calls: false``
``max_tokens`` (required)    ``max_tokens``
``stop_sequences``           ``stop``
``temperature``, ``top_p``,  the same
``top_k``, ``ignore_eos``
``output_config.format``     ``response_format`` (``json_schema``)
``output_config.effort``     the chat template's ``reasoning_effort``, where it reads one
                             (else ignored: an effort hint, which such a model has no
                             knob for)
===========================  ==============================================================

Refused with a 400 naming the field (each would change the answer): document and other
non-text blocks but images (and images to a text-only model), server tools (``web_search_...``, ``bash_...``), ``mcp_servers``,
``container``, and ``thinking`` on a server without a reasoning parser.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from engine.chat.request import lax_bool
from engine.http.errors import APIError
from engine.http.sse import dumps

logger = logging.getLogger("engine.http")

# The request fields this route reads or knows to change nothing about the answer
# (metadata, service_tier, speed, prompt-cache hints, ...); others are logged and ignored.
KNOWN_FIELDS = frozenset({
    "model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p",
    "top_k", "stream", "tools", "tool_choice", "thinking", "output_config", "metadata",
    "service_tier", "cache_control", "speed", "inference_geo", "diagnostics",
    "user_profile_id", "workspace_id",
    # vLLM's sampling extra, honoured as on the chat route: generate past the end of text.
    "ignore_eos",
})
# Fields that ask for something this server does not do; each is a 400.
REFUSED_FIELDS = {
    "mcp_servers": "MCP connectors are not supported by this server",
    "container": "code-execution containers are not supported by this server",
    "context_management": "context management (clearing old tool results) is not supported "
                          "by this server",
}

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                529: "overloaded_error"}


def error_body(err: APIError) -> dict[str, Any]:
    """An error as Anthropic sends it: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = _ERROR_TYPES.get(err.status)
    if kind is None:
        kind = "invalid_request_error" if 400 <= err.status < 500 else "api_error"
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


# -- the request -----------------------------------------------------------------------------


def chat_body(body: Any, *, reasoning: bool, count_only: bool = False,
              origins: dict[str, str] | None = None, switch: str = "enable_thinking",
              reads_effort: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    """The OpenAI chat body a Messages body means; :class:`APIError` naming the field
    otherwise. ``reasoning``: the server has a reasoning parser (``thinking`` is then
    allowed; ``switch``, its ``chat_template_kwargs`` key that turns thinking on and off).
    ``count_only``: for ``count_tokens``, which takes no ``max_tokens``.
    ``reads_effort``: whether the chat template reads ``reasoning_effort``
    (``output_config.effort`` then becomes it), asked only of a body that sends one.
    ``origins`` is filled with the chat path of each image part and its block's path, for
    :func:`rename_param` (a bad image is found later, by the engine)."""
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object", code="invalid_json")
    for name, why in REFUSED_FIELDS.items():
        if body.get(name) is not None:
            raise APIError(400, f"{name}: {why}", param=name, code="unsupported_parameter")
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        logger.info("ignoring unknown Messages fields: %s", ", ".join(unknown))
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model is required (a string)", "model")
    system = _system(body.get("system"))
    out: dict[str, Any] = {"model": model,
                           "messages": system + _messages(body, len(system), origins)}
    if not count_only:
        max_tokens = body.get("max_tokens")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise _bad("max_tokens is required (an integer of at least 1)", "max_tokens")
        out["max_tokens"] = max_tokens
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise _bad("stop_sequences must be a list of non-empty strings", "stop_sequences")
        out["stop"] = stop
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            out[name] = body[name]
    if body.get("ignore_eos") is not None:
        out["ignore_eos"] = lax_bool(body["ignore_eos"], "ignore_eos")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream must be a boolean", "stream")
    if stream and not count_only:
        # The usage that ends the stream (message_delta's output_tokens).
        out |= {"stream": True, "stream_options": {"include_usage": True}}
    out |= _tools(body.get("tools"), body.get("tool_choice"))
    out |= _thinking(body.get("thinking"), reasoning, switch)
    out |= _output_config(body.get("output_config"), reads_effort)
    last = out["messages"][-1] if out["messages"] else None
    if last is not None and last["role"] == "assistant" and not last.get("tool_calls"):
        # A prefill: the answer continues the assistant's text.
        out |= {"add_generation_prompt": False, "continue_final_message": True}
    return out


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    if isinstance(system, list):
        text = "".join(_text_block(b, f"system[{i}]") for i, b in enumerate(system))
        return [{"role": "system", "content": text}] if text else []
    raise _bad("system must be a string or a list of text blocks", "system")


def _text_block(block: Any, where: str) -> str:
    if not isinstance(block, Mapping):
        raise _bad(f"{where} must be a content block object", where)
    kind = block.get("type")
    if kind != "text":
        raise _bad(f"{where}.type {kind!r} is not supported here: only text blocks",
                   f"{where}.type")
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad(f"{where}.text must be a string", f"{where}.text")
    return text


def _messages(body: Mapping[str, Any], first: int,
              origins: dict[str, str] | None) -> list[dict[str, Any]]:
    """The chat messages of a Messages body. Consecutive turns of one role are combined
    into one turn, as Anthropic's API combines them: their tool results first, then their
    content blocks in order (an assistant's tool calls after its text)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    run = 0  # where the messages of the current run of one role start in ``out``
    last_role = None
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise _bad(f"{where} must be an object", where)
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise _bad(f"{where}.role must be \"user\" or \"assistant\", got {role!r}",
                       f"{where}.role")
        content = message.get("content")
        if not isinstance(content, (str, list)):
            raise _bad(f"{where}.content must be a string or a list of content blocks",
                       f"{where}.content")
        if role != last_role:
            run, last_role = len(out), role
        if role == "user":
            # The tool_use ids of the assistant turn before this run: what its results answer.
            previous = out[run - 1] if run and out[run - 1]["role"] == "assistant" else {}
            asked = {c["id"] for c in previous.get("tool_calls") or ()}
            turn = ([{"role": "user", "content": content}] if isinstance(content, str)
                    else _user(content, where, asked))
            out[run:] = _combined_user(out[run:], turn)
        else:
            turn_message = ({"role": "assistant", "content": content} if isinstance(content, str)
                            else _assistant(content, where))
            out[run:] = [_combined_assistant(out[run], turn_message) if len(out) > run
                         else turn_message]
    for k, message in enumerate(out):
        for j, part in enumerate(message["content"] if isinstance(message["content"], list) else ()):
            origin = part.pop("origin", None)
            if origin is not None and origins is not None:
                origins[f"messages[{first + k}].content[{j}]"] = origin
    return out


def _parts(content: Any) -> list[dict[str, Any]]:
    """A chat message's content as a list of parts (a string is one text part)."""
    if content is None or content == "":
        return []
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def _joined(parts: list[dict[str, Any]]) -> Any:
    """Content parts as a message's content: one text part as a string, as vLLM gives it."""
    if len(parts) == 1 and parts[0]["type"] == "text":
        return parts[0]["text"]
    return parts or None


def _combined_user(run: list[dict[str, Any]], turn: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Two user turns as one: every tool result, then every content part."""
    messages = run + turn
    tools = [m for m in messages if m["role"] == "tool"]
    parts = [p for m in messages if m["role"] == "user" for p in _parts(m["content"])]
    has_user = any(m["role"] == "user" for m in messages)
    return tools + ([{"role": "user", "content": _joined(parts) or ""}] if has_user else [])


def _combined_assistant(before: dict[str, Any], turn: dict[str, Any]) -> dict[str, Any]:
    """Two assistant turns as one: the text of both, then the tool calls of both."""
    message: dict[str, Any] = {
        "role": "assistant", "content": _joined(_parts(before["content"]) + _parts(turn["content"]))}
    calls = [*before.get("tool_calls", ()), *turn.get("tool_calls", ())]
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[Any], where: str, asked: set[str]) -> list[dict[str, Any]]:
    """A user turn's blocks: its tool results as ``tool`` messages, then its text. Each
    tool result answers a tool_use of the message before (``asked``), as Anthropic's API
    requires: one that answers none is refused, not read as some other call's result."""
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "tool_result":
            result = _tool_result(block, at)
            if result["tool_call_id"] not in asked:
                raise _bad(f"{at}.tool_use_id {result['tool_call_id']!r} answers no tool_use "
                           "block of the previous message: each tool_result must answer one",
                           f"{at}.tool_use_id")
            results.append(result)
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block, at)},
                          "origin": at})
        else:
            parts.append({"type": "text", "text": _text_block(block, at)})
    if not parts:
        return results
    # The blocks as chat content parts (one text block as a string, as vLLM converts them):
    # the chat template gets them as /v1/chat/completions gives a content list.
    if len(parts) == 1 and parts[0]["type"] == "text":
        return [*results, {"role": "user", "content": parts[0]["text"]}]
    return [*results, {"role": "user", "content": parts}]


# The image types Anthropic's API takes; the engine decodes PNG, JPEG and WebP (a GIF is its
# 400, naming the block).
_IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def _image_url(block: Mapping[str, Any], where: str) -> str:
    """An image block's ``source`` as the chat ``image_url`` it means."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, Mapping) else None
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if media not in _IMAGE_TYPES:
            raise _bad(f"{where}.source.media_type must be one of {', '.join(_IMAGE_TYPES)}, "
                       f"got {media!r}", f"{where}.source.media_type")
        if not isinstance(data, str) or not data:
            raise _bad(f"{where}.source.data must be the image as a base64 string",
                       f"{where}.source.data")
        return f"data:{media};base64,{data}"
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise _bad(f"{where}.source.url must be a string", f"{where}.source.url")
        return url
    raise _bad(f"{where}.source.type must be \"base64\" or \"url\", got {kind!r}",
               f"{where}.source.type")


def _tool_result(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"{where}.tool_use_id is required (the id of the tool_use it answers)",
                   f"{where}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, list):  # joined as every tool result's text parts are
        content = "\n".join(_text_block(b, f"{where}.content[{k}]")
                            for k, b in enumerate(content))
    elif not isinstance(content, str):
        raise _bad(f"{where}.content must be a string or a list of text blocks",
                   f"{where}.content")
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _assistant(blocks: list[Any], where: str) -> dict[str, Any]:
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "tool_use":
            calls.append(_tool_use(block, at))
        elif kind in ("thinking", "redacted_thinking"):
            continue  # earlier turns' reasoning does not go back into the prompt
        else:
            text.append(_text_block(block, at))
    # Text blocks as content parts (one as a string), as a user turn's.
    content: Any = ([{"type": "text", "text": t} for t in text] if len(text) > 1
                    else text[0] if text and text[0] else None)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_use(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise _bad(f"{where} must have a string id and name", where)
    if not isinstance(arguments, Mapping):
        raise _bad(f"{where}.input must be an object", f"{where}.input")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _tools(tools: Any, choice: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools must be a list", "tools")
        out["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
    if choice is None:
        return out
    if not isinstance(choice, Mapping):
        raise _bad('tool_choice must be an object like {"type": "auto"}', "tool_choice")
    kind = choice.get("type")
    if kind == "auto":
        out["tool_choice"] = "auto"
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "none":
        out["tool_choice"] = "none"
    elif kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise _bad("tool_choice.name must be a string", "tool_choice.name")
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        raise _bad('tool_choice.type must be "auto", "any", "tool" or "none"',
                   "tool_choice.type")
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise _bad("tool_choice.disable_parallel_tool_use must be a boolean",
                       "tool_choice.disable_parallel_tool_use")
        out["parallel_tool_calls"] = not parallel
    return out


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, Mapping):
        raise _bad(f"{where} must be an object", where)
    if tool.get("type") not in (None, "custom"):
        raise _bad(f"{where}.type {tool.get('type')!r}: server tools are not supported by "
                   "this server; declare a custom tool with name and input_schema",
                   f"{where}.type")
    schema = tool.get("input_schema")
    if not isinstance(schema, Mapping):
        raise _bad(f"{where}.input_schema is required (a JSON schema object)",
                   f"{where}.input_schema")
    if not isinstance(tool.get("name"), str):
        raise _bad(f"{where}.name is required (a string)", f"{where}.name")
    function: dict[str, Any] = {"name": tool["name"], "parameters": dict(schema)}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _thinking(thinking: Any, reasoning: bool, switch: str) -> dict[str, Any]:
    if thinking is None:
        return {}
    kind = thinking.get("type") if isinstance(thinking, Mapping) else None
    if kind not in ("enabled", "disabled", "adaptive", "between_tools"):
        raise _bad('thinking.type must be "enabled", "disabled", "adaptive" or '
                   '"between_tools"', "thinking.type")
    if kind == "disabled":
        # Templates with a thinking switch (Qwen3's, Granite's) read it; others ignore it.
        return {"chat_template_kwargs": {switch: False}} if reasoning else {}
    if not reasoning:
        raise APIError(400, "thinking needs the server started with --reasoning-parser "
                       "(this model's reasoning cannot be told apart from its answer)",
                       param="thinking", code="unsupported_parameter")
    out: dict[str, Any] = {"chat_template_kwargs": {switch: True}}
    budget = thinking.get("budget_tokens")
    if budget is not None:
        # vLLM's thinking_token_budget: the reasoning's end marker is forced once the
        # reasoning holds that many tokens (Anthropic's budget is the same bound).
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise _bad("thinking.budget_tokens must be a positive integer",
                       "thinking.budget_tokens")
        out["thinking_token_budget"] = budget
    return out


def _output_config(config: Any, reads_effort: Callable[[], bool]) -> dict[str, Any]:
    """``output_config.format`` (a JSON schema) is a ``response_format``; ``effort`` is
    the template's ``reasoning_effort`` where it reads one (as chat's and the Responses
    route's efforts are), else ignored: a hint about how hard to think, which a model
    whose template takes no effort has no knob for."""
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        raise _bad("output_config must be an object", "output_config")
    out: dict[str, Any] = {}
    effort = config.get("effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise _bad("output_config.effort must be a string", "output_config.effort")
        if reads_effort():
            out["reasoning_effort"] = effort
    fmt = config.get("format")
    if fmt is None:
        return out
    if not isinstance(fmt, Mapping) or fmt.get("type") != "json_schema" or not isinstance(
            fmt.get("schema"), Mapping):
        raise _bad('output_config.format must be {"type": "json_schema", "schema": {...}}',
                   "output_config.format")
    return out | {"response_format": {"type": "json_schema", "json_schema": {
        "name": "output", "schema": dict(fmt["schema"])}}}


# The chat fields a Messages field became, for errors the chat path finds (the rest keep
# their names: model, max_tokens, temperature, tools, tool_choice, ...).
_MESSAGES_NAMES = (("stop", "stop_sequences"), ("response_format", "output_config.format"),
                   ("parallel_tool_calls", "tool_choice.disable_parallel_tool_use"),
                   ("thinking_token_budget", "thinking.budget_tokens"),
                   ("reasoning_effort", "output_config.effort"))


def rename_param(err: APIError, origins: Mapping[str, str] | None = None) -> APIError:
    """A chat-path error about a field this route renamed, said with the Messages name
    (``stop`` -> ``stop_sequences``, an image part -> its block: ``origins``, ...)."""
    for chat, block in (origins or {}).items():
        if err.param == chat:  # the engine's message names the part: name the block
            return APIError(err.status, err.message.replace(chat, block), type=err.type,
                            param=block, code=err.code)
    for chat, messages in _MESSAGES_NAMES:
        if err.param == chat or (err.param or "").startswith(chat + "."):
            param = messages + (err.param or "")[len(chat):]
            return APIError(err.status, f"{param}: {err.message}", type=err.type,
                            param=param, code=err.code)
    return err


# -- the answer ------------------------------------------------------------------------------


def new_id() -> str:
    return "msg_" + uuid.uuid4().hex


def stop_reason(finish_reason: str | None, stop: Any,
                called: bool = False) -> tuple[str | None, str | None]:
    """``(stop_reason, stop_sequence)`` for a chat choice's finish: ``tool_use`` when calls
    ended the turn (``called``: the answer holds calls; a named call's chat finish is
    ``stop``, Anthropic's ``tool_use`` all the same), ``max_tokens`` at the limit,
    ``stop_sequence`` with the string matched, else ``end_turn``."""
    if finish_reason == "tool_calls" or (finish_reason == "stop" and called):
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return ("end_turn", None) if finish_reason is not None else (None, None)


def _reasoning(fields: Mapping[str, Any]) -> str:
    # vLLM's current name, or the older one: one text either way.
    return fields.get("reasoning") or fields.get("reasoning_content") or ""


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as ``input``; ``{}`` when they do not parse (cut short by
    ``max_tokens``, whose stop_reason says so)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message_from_chat(chat: Mapping[str, Any], msg_id: str, model: str) -> dict[str, Any]:
    """A non-streamed chat response as a Messages response."""
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if reasoning := _reasoning(message):
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": _input(call["function"]["arguments"])})
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"),
                                   bool(message.get("tool_calls")))
    usage = chat["usage"]
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": usage["prompt_tokens"],
                      "output_tokens": usage["completion_tokens"]}}


def event(name: str, data: Mapping[str, Any]) -> bytes:
    """One SSE event as Anthropic frames them: ``event: NAME`` and its JSON."""
    return b"event: " + name.encode() + b"\ndata: " + dumps(data) + b"\n\n"


class MessageEvents:
    """A chat stream's chunks as Messages stream events, in Anthropic's order::

        message_start, (content_block_start, ping once, content_block_delta...,
        content_block_stop)..., message_delta (stop_reason, usage), message_stop

    Blocks open as the chat deltas change kind: reasoning is a ``thinking`` block, text a
    ``text`` block, each call a ``tool_use`` block whose ``input`` streams as
    ``input_json_delta`` fragments.
    """

    def __init__(self, msg_id: str, model: str, input_tokens: int) -> None:
        self._id, self._model, self._input_tokens = msg_id, model, input_tokens
        self._block = -1  # index of the open block, or of the last one closed
        self._kind: str | None = None  # kind of the open block; None: none is open
        self._call: int | None = None  # the open tool_use block's chat call index
        self._pinged = False
        self._finish: tuple[str | None, Any] = (None, None)
        self._called = False  # a tool_use block was opened

    def start(self) -> list[bytes]:
        return [event("message_start", {"type": "message_start", "message": {
            "id": self._id, "type": "message", "role": "assistant", "model": self._model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self._input_tokens, "output_tokens": 0}}})]

    def chunk(self, chunk: Mapping[str, Any]) -> list[bytes]:
        """The events for one chat chunk (the usage chunk ends the message)."""
        out: list[bytes] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if reasoning := _reasoning(delta):
                out += self._open("thinking")
                out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
            if delta.get("content"):
                out += self._open("text")
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if call.get("id") is not None:
                    out += self._open("tool_use", call)
                if function.get("arguments") and self._call == call.get("index"):
                    out.append(self._delta({"type": "input_json_delta",
                                            "partial_json": function["arguments"]}))
            if choice.get("finish_reason") is not None:
                self._finish = (choice["finish_reason"], choice.get("stop_reason"))
        if chunk.get("usage") and not chunk.get("choices"):
            out += self._end(chunk["usage"]["completion_tokens"])
        return out

    def _open(self, kind: str, call: Mapping[str, Any] | None = None) -> list[bytes]:
        if self._kind == kind and kind != "tool_use":
            return []
        out = self._close()
        self._block += 1
        self._kind = kind
        block: dict[str, Any]
        if kind == "thinking":
            block = {"type": "thinking", "thinking": "", "signature": ""}
        elif kind == "text":
            block = {"type": "text", "text": ""}
        else:
            assert call is not None
            self._call = call.get("index")
            self._called = True
            block = {"type": "tool_use", "id": call["id"],
                     "name": (call.get("function") or {}).get("name"), "input": {}}
        out.append(event("content_block_start", {"type": "content_block_start",
                                                 "index": self._block, "content_block": block}))
        if not self._pinged:
            self._pinged = True
            out.append(event("ping", {"type": "ping"}))
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"type": "content_block_delta",
                                             "index": self._block, "delta": delta})

    def _close(self) -> list[bytes]:
        if self._kind is None:
            return []
        self._kind, self._call = None, None
        return [event("content_block_stop", {"type": "content_block_stop",
                                             "index": self._block})]

    def _end(self, output_tokens: int) -> list[bytes]:
        out = self._close()
        if not self._pinged:
            self._pinged = True
            out.append(event("ping", {"type": "ping"}))
        reason, sequence = stop_reason(*self._finish, self._called)
        out.append(event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": {"output_tokens": output_tokens}}))
        out.append(event("message_stop", {"type": "message_stop"}))
        return out

    @staticmethod
    def error(err: APIError) -> bytes:
        return event("error", error_body(err))
