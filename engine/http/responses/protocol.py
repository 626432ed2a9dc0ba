"""OpenAI's Responses API (``POST /v1/responses``) as a chat request.

Pure (no I/O, no trio). A Responses body becomes a chat body, which
:func:`engine.http.completions.protocol.parse_chat` turns into the same
:class:`CompletionRequest` a ``/v1/chat/completions`` request makes, so tools, structured
output, reasoning and the sampling fields go through the one chat path:

==============================  =======================================================
Responses                        chat
==============================  =======================================================
``instructions``                 a first ``system`` message
``previous_response_id``         the stored conversation's messages (see
                                 :mod:`engine.http.responses.store`)
``input`` (a string)             one ``user`` message
``input`` message items          messages (``input_text`` / ``output_text`` parts)
``input_image`` parts            ``image_url`` parts (``image_url``: a ``data:`` URL, or an
                                 ``http(s)`` one of an allowed host)
``function_call`` items          an assistant message's ``tool_calls`` (consecutive calls
                                 make one message)
``function_call_output`` items   ``tool`` messages
``reasoning`` items              the next assistant message's ``reasoning_content``
``tools`` (flat function tools)  ``tools`` (``{"type": "function", "function": {...}}``)
``tool_choice``                  ``tool_choice``
``text.format``                  ``response_format``
``max_output_tokens``            ``max_tokens``
==============================  =======================================================

An error found by the chat layer names the Responses field (``tools[0].parameters``,
``input[2].arguments``, ``text.format.schema``). What this server cannot honour
(:data:`REFUSED`: built-in tools, ``background``, an ``include`` other than the output
text's logprobs, ...) is a 400 naming it.

The answer is :mod:`engine.http.responses.builder`'s; the store that ``store`` and
``previous_response_id`` use is :mod:`engine.http.responses.store`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from engine.chat.request import ChatSettings
from engine.errors import InvalidParamError
from engine.http.completions.protocol import CompletionRequest, parse_chat
from engine.http.errors import APIError, rename_param
from engine.http.responses.store import MissingResponse

logger = logging.getLogger("engine.http")


def _set(value: Any) -> bool:
    return value is not None


# Fields that would change the answer and are not implemented: a 400 naming the field
# when set to anything but their no-op value (OpenAI's clients send some as null).
REFUSED: dict[str, Callable[[Any], bool]] = {
    "background": lambda v: v not in (None, False),
    "background_options": _set,
    "conversation": _set,  # the Conversations API is not served
    "prompt": _set,  # stored prompt templates
    "context_management": lambda v: v not in (None, []),
    "moderation": _set,
    # Not a Responses field, but vLLM's chat one: one response is one sample.
    "n": lambda v: v not in (None, 1),
}
# The one include value this server produces: the output text's token logprobs (the
# others ask for built-in tool results or encrypted reasoning).
INCLUDE_LOGPROBS = "message.output_text.logprobs"
# OpenAI's bound on top_logprobs.
MAX_TOP_LOGPROBS = 20
# Read here (the others in REFUSED are refused, the vLLM sampling extras passed through).
KNOWN = frozenset({
    "model", "input", "instructions", "previous_response_id", "store", "stream",
    "stream_options", "tools", "tool_choice", "parallel_tool_calls", "text", "reasoning",
    "max_output_tokens", "temperature", "top_p", "metadata", "user", "safety_identifier",
    "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "service_tier",
    "max_tool_calls", "image", "access_programs", "include", "top_logprobs", "truncation",
})
# vLLM's sampling extras a client may add (extra_body), passed to the chat request as is.
SAMPLING_EXTRAS = ("top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                   "priority", "cache_salt", "chat_template_kwargs")
_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})
_TEXT_FORMAT_KEYS = frozenset({"type", "name", "schema", "strict", "description"})
# OpenAI's built-in tools, named in the refusal as such.
_BUILT_IN = ("web_search", "web_search_preview", "file_search", "code_interpreter",
             "computer_use_preview", "computer", "image_generation", "mcp", "local_shell",
             "shell", "apply_patch", "custom", "tool_search", "namespace")
_ROLES = ("user", "system", "developer", "assistant")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _bad(message: str, param: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def _unsupported(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ResponsesRequest:
    """A parsed ``/v1/responses`` body: the chat request it runs as, and what the
    response echoes and the store keeps."""

    chat: CompletionRequest
    stream: bool
    store: bool
    previous_response_id: str | None
    input_items: tuple[dict[str, Any], ...]  # this request's input, with ids
    turn: tuple[dict[str, Any], ...]  # the chat messages this request's input adds
    echo: dict[str, Any]  # request fields the response object repeats
    # Chat paths -> Responses paths, to name the field in an error found after parsing
    # (a bad image, found by the engine at admission): see rename().
    where: Mapping[str, str] = dataclasses.field(default_factory=dict)


def parse_responses(
    body: Any, *, history: Callable[[str], list[dict[str, Any]]],
    settings: ChatSettings | None = None, model_template: str | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> ResponsesRequest:
    """Parse a ``/v1/responses`` body; :class:`APIError` naming the field.

    ``history(id)`` gives the chat messages of a stored conversation (raising
    :class:`MissingResponse`)."""
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object", code="invalid_json")
    for name, is_set in REFUSED.items():
        if is_set(body.get(name)):
            raise _unsupported(f"{name} is not supported by this server", name)
    unknown = sorted(set(body) - KNOWN - set(REFUSED) - set(SAMPLING_EXTRAS))
    if unknown:
        logger.info("ignoring unknown request fields: %s", ", ".join(unknown))
    effort = _reasoning_effort(body.get("reasoning"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("instructions must be a string", "instructions", "invalid_type")
    previous_id = body.get("previous_response_id")
    prior: list[dict[str, Any]] = []
    if previous_id is not None:
        if not isinstance(previous_id, str):
            raise _bad("previous_response_id must be a string", "previous_response_id",
                       "invalid_type")
        try:
            prior = history(previous_id)
        except MissingResponse as exc:
            missing = ("" if exc.response_id == previous_id else
                       f" (its conversation reaches {exc.response_id!r}, which is not)")
            raise APIError(404, f"Previous response with id {previous_id!r} not found{missing}: "
                           "stored responses live in the server's memory, bounded in size "
                           "and age, and are lost on restart", param="previous_response_id",
                           code="previous_response_not_found") from None
    turn, items, origins = _input(body.get("input"))
    messages: list[dict[str, Any]] = []
    where: dict[str, str] = {}
    if instructions is not None:
        where["messages[0]"] = "instructions"
        messages.append({"role": "system", "content": instructions})
    for _ in prior:
        where[f"messages[{len(messages)}]"] = "previous_response_id"
        messages.append(_)
    for k, message in enumerate(turn):
        for key, origin in origins[k].items():
            where[f"messages[{len(messages)}]{key}"] = origin
        messages.append(message)
    _check_outputs_answer_calls(messages, where)
    tools = _tools(body.get("tools"))
    logprobs, top_logprobs = _logprobs(body, tools, settings)
    chat_body: dict[str, Any] = {
        "model": body.get("model"), "messages": messages,
        **({"logprobs": True, "top_logprobs": top_logprobs} if logprobs else {}),
        "max_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "tools": tools or None, "tool_choice": _tool_choice(body.get("tool_choice")),
        "parallel_tool_calls": body.get("parallel_tool_calls"),
        "response_format": _text_format(body.get("text")),
        **{k: body[k] for k in SAMPLING_EXTRAS if body.get(k) is not None},
        # The chat template's reasoning_effort (chat's own field; a template that never
        # reads it refuses it, named reasoning.effort here).
        **({"reasoning_effort": effort} if effort is not None else {}),
    }
    try:
        chat = parse_chat(chat_body, settings, model_template, defaults)
    except (APIError, InvalidParamError) as exc:
        _rename(exc, where)
        raise
    if chat.structured_param is not None:
        chat = dataclasses.replace(chat, structured_param=_renamed(chat.structured_param, where))
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not stream:
        raise _bad("stream_options is only allowed when stream is true", "stream_options")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise _bad("metadata must map keys to strings", "metadata", "invalid_type")
    params = chat.params
    echo = {
        "instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
        "metadata": metadata or {}, "parallel_tool_calls": _bool(body, "parallel_tool_calls", True),
        "previous_response_id": previous_id, "temperature": params.temperature,
        "top_p": params.top_p, "text": {"format": (body.get("text") or {}).get("format")
                                        or {"type": "text"}},
        "tool_choice": body.get("tool_choice") or ("auto" if tools else "none"),
        "tools": body.get("tools") or [], "user": body.get("user"),
        "top_logprobs": top_logprobs, "truncation": _truncation(body.get("truncation")),
        "reasoning": {"effort": effort, "summary": None},
    }
    return ResponsesRequest(chat=chat, stream=stream, store=_bool(body, "store", True),
                            previous_response_id=previous_id, input_items=tuple(items),
                            turn=tuple(turn), echo=echo, where=where)


def _truncation(value: Any) -> str:
    if value is None:
        return "disabled"
    if value not in ("auto", "disabled"):
        raise _bad('truncation must be "auto" or "disabled"', "truncation", "invalid_value")
    return value


def truncated(req: ResponsesRequest) -> ResponsesRequest | None:
    """``truncation: "auto"``: the request with the oldest droppable input item's chat
    turn dropped (None: nothing left to drop). The instructions (system turns) and the
    last turn stay; a dropped assistant turn takes the tool results answering its calls
    with it, and a tool result left first loses its call, so it goes too. The
    conversation stored for later turns is not cut: only this request's prompt is."""
    (messages,) = req.chat.prompts
    droppable = [i for i, m in enumerate(messages[:-1]) if m.get("role") not in ("system", "developer")]
    if not droppable:
        return None
    gone = {droppable[0]}
    calls = {c.get("id") for c in messages[droppable[0]].get("tool_calls") or []}
    for i in range(droppable[0] + 1, len(messages) - 1):
        if messages[i].get("role") == "tool" and (messages[i].get("tool_call_id") in calls
                                                   or i - 1 in gone):
            gone.add(i)
        else:
            break
    kept = [m for i, m in enumerate(messages) if i not in gone]
    where = {}
    for key, origin in req.where.items():
        index = int(key[len("messages["):key.index("]")])
        if index not in gone:
            shift = sum(g < index for g in gone)
            where[f"messages[{index - shift}]{key[key.index(']') + 1:]}"] = origin
    chat = dataclasses.replace(req.chat, prompts=(kept,))
    return dataclasses.replace(req, chat=chat, where=where)


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"{name} must be a boolean", name, "invalid_type")
    return value


def _logprobs(body: Mapping[str, Any], tools: list[Any],
              settings: ChatSettings | None) -> tuple[bool, int]:
    """``include`` and ``top_logprobs``: whether the output text carries its tokens'
    logprobs (``include`` holds :data:`INCLUDE_LOGPROBS`), with how many alternatives
    each. Any other include value is refused, and so are logprobs on an answer that is
    not text alone (tools, or a server that splits reasoning out): its tokens would not
    line up with the output text."""
    top = body.get("top_logprobs")
    if top is not None and (type(top) is not int or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise _bad(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
    include = body.get("include")
    if include is None:
        return False, top or 0
    if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
        raise _bad("include must be a list of strings", "include", "invalid_type")
    for k, value in enumerate(include):
        if value != INCLUDE_LOGPROBS:
            raise _unsupported(f"include[{k}] {value!r} is not supported by this server (only "
                               f"{INCLUDE_LOGPROBS!r})", f"include[{k}]")
    if not include:
        return False, top or 0
    choice = body.get("tool_choice")
    if (tools and choice != "none") or (settings is not None and settings.reasoning_parser):
        raise _unsupported("message.output_text.logprobs is supported for text answers only: "
                           "not with tools, nor on a server with a reasoning parser",
                           "include")
    return True, top or 0


def _reasoning_effort(value: Any) -> str | None:
    """``reasoning``: its ``effort`` goes to the chat template as ``reasoning_effort`` (as
    chat's field of that name, and as vLLM's Responses route passes it; a template that
    never reads it refuses it); summaries cannot be honoured (the model's thinking comes
    back as reasoning items, whole). Null values are the no-op."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad("reasoning must be an object", "reasoning", "invalid_type")
    for key, item in value.items():
        if item is not None and key != "effort":
            raise _unsupported(f"reasoning.{key} is not supported by this server (reasoning "
                               "models' thinking comes back as reasoning items, whole)",
                               f"reasoning.{key}")
    effort = value.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise _bad("reasoning.effort must be a string", "reasoning.effort", "invalid_type")
    return effort


# -- input ------------------------------------------------------------------------------


def _input(value: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                list[dict[str, str]]]:
    """The chat messages of ``input``, its items as stored (with ids), and for each
    message where its parts came from (``""`` for the message, ``.tool_calls[m]`` for a
    call), as ``input[j]`` paths."""
    if isinstance(value, str):
        item = {"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": value}], "id": new_id("msg")}
        return [{"role": "user", "content": value}], [item], [{"": "input"}]
    if not isinstance(value, list):
        raise _bad("input must be a string or a list of input items", "input",
                   "missing_required_parameter" if value is None else "invalid_type")
    messages: list[dict[str, Any]] = []
    origins: list[dict[str, str]] = []
    items: list[dict[str, Any]] = []
    # The assistant message that function_call (and reasoning) items are gathered into.
    open_assistant: dict[str, Any] | None = None

    def flush() -> None:
        nonlocal open_assistant
        if open_assistant is not None:
            if open_assistant.get("content") is not None or open_assistant.get("tool_calls"):
                messages.append(open_assistant)
            else:
                origins.pop()  # thinking with no answer: nothing for the template
            open_assistant = None

    def assistant(origin: str) -> dict[str, Any]:
        nonlocal open_assistant
        if open_assistant is None:
            open_assistant = {"role": "assistant", "content": None}
            origins.append({"": origin})
        return open_assistant

    for j, item in enumerate(value):
        where = f"input[{j}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object", where, "invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            role, text = _message(item, where)
            items.append(_stored(item, "message", "msg"))
            if role == "assistant":
                if open_assistant is not None and (open_assistant.get("content") is not None
                                                   or open_assistant.get("tool_calls")):
                    flush()
                target = assistant(where)
                target["content"] = text
                continue
            flush()
            messages.append({"role": role, "content": text})
            origins.append({"": where})
        elif kind == "function_call":
            call = _function_call(item, where)
            items.append(_stored(item, "function_call", "fc"))
            target = assistant(where)
            calls = target.setdefault("tool_calls", [])
            origins[-1][f".tool_calls[{len(calls)}]"] = where
            calls.append(call)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            output = _output_text(item.get("output"), f"{where}.output")
            items.append(_stored(item, "function_call_output", "fco"))
            flush()
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
            origins.append({"": where})
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            items.append(_stored(item, "reasoning", "rs"))
            flush()
            assistant(where)["reasoning_content"] = text
        elif kind == "item_reference":
            raise _unsupported(f"{where}: item_reference is not supported; send the item "
                               "itself or use previous_response_id", f"{where}.type")
        else:
            raise _unsupported(f"{where}: input items of type {kind!r} are not supported "
                               "(only message, function_call, function_call_output and "
                               "reasoning)", f"{where}.type")
    flush()
    return messages, items, origins


def _check_outputs_answer_calls(messages: list[dict[str, Any]], where: dict[str, str]) -> None:
    """Every function_call_output answers a function_call before it (of this input or of
    the previous responses), as OpenAI requires: one that answers none is a 400 naming
    its call_id, not a tool result the model reads as the answer to some other call."""
    calls: set[str] = set()
    for i, message in enumerate(messages):
        if message.get("role") == "assistant":
            calls.update(c.get("id") for c in message.get("tool_calls") or ())
        elif message.get("role") == "tool" and message.get("tool_call_id") not in calls:
            origin = where.get(f"messages[{i}]", "input")
            raise _bad(f"No tool call found for function call output with call_id "
                       f"{message.get('tool_call_id')!r}", f"{origin}.call_id")


def _message(item: dict[str, Any], where: str) -> tuple[str, str | list[dict[str, Any]]]:
    role = item.get("role")
    if role not in _ROLES:
        raise _bad(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}",
                   f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return role, content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content parts",
                   f"{where}.content", "invalid_type")
    allowed = ("output_text", "refusal") if role == "assistant" else ("input_text", "input_image")
    parts: list[dict[str, Any]] = []
    for k, part in enumerate(content):
        at = f"{where}.content[{k}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            raise _unsupported(f"{at}: content of type {kind!r} is not supported in a "
                               f"{role} message (only {' and '.join(allowed)})", f"{at}.type")
        if kind == "input_image":
            parts.append(_input_image(part, at))
            continue
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise _bad(f"{at} needs its text as a string", at, "invalid_type")
        parts.append({"type": "text", "text": text})
    # One chat part per input part (input[j].content[k] keeps k): the chat template gets
    # them as /v1/chat/completions gives a content list (engine.chat.template).
    return role, parts


def _input_image(part: dict[str, Any], where: str) -> dict[str, Any]:
    """An ``input_image`` part as the chat ``image_url`` part it means. ``detail`` asks
    OpenAI's models for a resolution; here the model's own image processor sets it, so
    only ``auto`` (the default) is honoured."""
    if part.get("file_id") is not None:
        raise _unsupported(f"{where}.file_id: this server has no Files API; send the image "
                           "as image_url (a base64 data: URL)", f"{where}.file_id")
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise _bad(f"{where}.image_url must be the image as a URL (data:image/png;base64,...)",
                   f"{where}.image_url", "invalid_type")
    if part.get("detail") not in (None, "auto"):
        raise _unsupported(f"{where}.detail {part.get('detail')!r} is not supported: the "
                           "model's own image processor sets the resolution (auto)",
                           f"{where}.detail")
    return {"type": "image_url", "image_url": {"url": url}}


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise _bad(f"{where}.{key} must be a non-empty string", f"{where}.{key}",
                   "invalid_type")
    return value


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = _string(item, "call_id", where)
    name = _string(item, "name", where)
    arguments = item.get("arguments")
    if not isinstance(arguments, str):
        raise _bad(f"{where}.arguments must be a string (a JSON object)",
                   f"{where}.arguments", "invalid_type")
    try:
        decoded = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        raise _bad(f"{where}.arguments is not valid JSON", f"{where}.arguments") from None
    if not isinstance(decoded, dict):
        raise _bad(f"{where}.arguments must be a JSON object", f"{where}.arguments")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _output_text(output: Any, where: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        texts = []
        for k, part in enumerate(output):
            if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text")
                    and isinstance(part.get("text"), str)):
                raise _unsupported(f"{where}[{k}]: only text parts are supported",
                                   f"{where}[{k}]")
            texts.append(part["text"])
        return "\n".join(texts)
    raise _bad(f"{where} must be a string or a list of text parts", where, "invalid_type")


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    if item.get("encrypted_content") is not None:
        raise _unsupported(f"{where}.encrypted_content: this server does not encrypt "
                           "reasoning; send its content", f"{where}.encrypted_content")
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(
            isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise _bad(f"{where}.content must be a list of reasoning_text parts",
                   f"{where}.content", "invalid_type")
    return "".join(p["text"] for p in parts)


def _stored(item: dict[str, Any], kind: str, prefix: str) -> dict[str, Any]:
    """The item as ``GET /v1/responses/{id}/input_items`` lists it: typed, with an id,
    message content as parts."""
    out = {"type": kind, **item}
    if not isinstance(out.get("id"), str):
        out["id"] = new_id(prefix)
    if kind == "message" and isinstance(out.get("content"), str):
        part = "output_text" if out.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": out["content"]}]
    return out


# -- tools, tool_choice, text.format ------------------------------------------------------


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad("tools must be a list of tools", "tools", "invalid_type")
    out = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(f"{where} must be an object", where, "invalid_type")
        kind = tool.get("type")
        if kind != "function":
            what = "the built-in tool" if kind in _BUILT_IN or (
                isinstance(kind, str) and kind.startswith(_BUILT_IN)) else "the tool type"
            raise _unsupported(f"{where}: {what} {kind!r} is not supported by this server; "
                               "only function tools", f"{where}.type")
        extra = sorted(k for k, v in tool.items() if k not in _TOOL_KEYS and v is not None)
        if extra:
            raise _unsupported(f"{where}.{extra[0]} is not supported by this server",
                               f"{where}.{extra[0]}")
        function = {k: tool[k] for k in ("name", "description", "parameters")
                    if tool.get(k) is not None}
        # strict or not, a call generated under the tools' grammar matches its schema.
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, dict):
        raise _bad('tool_choice must be "none", "auto", "required" or '
                   '{"type": "function", "name": ...}', "tool_choice", "invalid_type")
    kind = value.get("type")
    if kind == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    raise _unsupported(f"tool_choice of type {kind!r} is not supported by this server (only "
                       '"none", "auto", "required" and {"type": "function", "name": ...})',
                       "tool_choice.type")


def _text_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("text must be an object", "text", "invalid_type")
    if text.get("verbosity") not in (None, "medium"):
        raise _unsupported("text.verbosity is not supported by this server", "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("text.format must be an object", "text.format", "invalid_type")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise _bad(f"text.format.type {kind!r} is not supported; use text, json_object or "
                   "json_schema", "text.format.type")
    extra = sorted(set(fmt) - _TEXT_FORMAT_KEYS)
    if extra:
        raise _bad(f"text.format has unknown key {extra[0]!r}", f"text.format.{extra[0]}")
    return {"type": "json_schema", "json_schema": {
        k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}


# -- error names ------------------------------------------------------------------------

# Chat names -> Responses names, applied after the messages' own prefixes.
_SUFFIXES = ((".function.arguments", ".arguments"), (".function.name", ".name"),
             (".tool_call_id", ".call_id"), (".function.parameters", ".parameters"),
             (".function.description", ".description"), (".function", ""))
_FIELDS = (("response_format.json_schema.", "text.format."), ("response_format", "text.format"),
           ("max_tokens", "max_output_tokens"), ("messages", "input"),
           ("reasoning_effort", "reasoning.effort"))


def _renamed(param: str, where: Mapping[str, str]) -> str:
    best = max((k for k in where if param == k or param.startswith((k + ".", k + "["))),
               key=len, default=None)
    if best is not None:
        param = where[best] + param[len(best):]
    elif param.startswith("tools[") or param.startswith("tool_choice"):
        pass
    else:
        for old, new in _FIELDS:
            if param.startswith(old):
                param = new + param[len(old):]
                break
    for old, new in _SUFFIXES:
        param = param.replace(old, new)
    return param


def rename(exc: APIError | InvalidParamError, req: ResponsesRequest) -> None:
    """Name the Responses field in an error found after parsing (the engine's refusal of
    an image part names the chat path)."""
    _rename(exc, req.where)


def _rename(exc: APIError | InvalidParamError, where: Mapping[str, str]) -> None:
    """Name the Responses field in a chat-layer error (its param and its message)."""
    if exc.param is not None:
        rename_param(exc, _renamed(exc.param, where))
