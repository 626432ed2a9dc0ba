"""OpenAI's deprecated function-calling fields on ``/v1/chat/completions``, read as the
tool fields they became, and answered in their own shape.

======================================  =================================================
legacy request field                    read as
======================================  =================================================
``functions: [{name, parameters}]``     ``tools: [{"type": "function", "function": ...}]``
``function_call: "none" | "auto"``      ``tool_choice`` the same
``function_call: {"name": N}``          ``tool_choice: {"type": "function", ...N}``
an assistant turn's ``function_call``   one ``tool_calls`` entry (id ``call_fn_K``)
a ``{"role": "function", "name"}`` turn a ``tool`` turn answering the latest such call
======================================  =================================================

A request with ``functions`` gets OpenAI's legacy answer: at most one call (parallel calls
off), as ``message.function_call`` (``{"name", "arguments"}``) in place of
``tool_calls``, ``finish_reason: "function_call"``, and the same in a stream's deltas.
``functions`` beside ``tools`` (or ``function_call`` beside ``tool_choice``) is a 400.
"""

from __future__ import annotations

import re
from typing import Any

from engine.errors import InvalidParamError


def legacy_body(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """``body`` with the legacy fields and turns read as tools (a new dict when anything
    changed), and whether its answer takes the legacy shape."""
    functions = body.get("functions")
    choice = body.get("function_call")
    messages = body.get("messages")
    legacy_turns = isinstance(messages, list) and any(
        isinstance(m, dict) and ("function_call" in m or m.get("role") == "function")
        for m in messages)
    if functions is None and choice is None and not legacy_turns:
        return body, False
    out = dict(body)
    out.pop("functions", None)
    out.pop("function_call", None)
    if functions is not None:
        if body.get("tools") is not None:
            raise InvalidParamError("send functions or tools, not both", param="functions")
        if not isinstance(functions, list) or not all(isinstance(f, dict) for f in functions):
            raise InvalidParamError("functions must be a list of objects", param="functions")
        out["tools"] = [{"type": "function", "function": f} for f in functions]
        out["parallel_tool_calls"] = False  # a legacy answer holds one call
    if choice is not None:
        if body.get("tool_choice") is not None:
            raise InvalidParamError("send function_call or tool_choice, not both",
                                    param="function_call")
        if functions is None and choice != "none":
            raise InvalidParamError("function_call needs functions", param="function_call")
        if choice in ("none", "auto"):
            out["tool_choice"] = choice
        elif isinstance(choice, dict) and isinstance(choice.get("name"), str):
            out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            raise InvalidParamError('function_call must be "none", "auto" or {"name": ...}',
                                    param="function_call")
    if legacy_turns:
        out["messages"] = _turns(messages)
    return out, functions is not None


def _turns(messages: list[Any]) -> list[Any]:
    out: list[Any] = []
    calls = 0
    last_id: str | None = None
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            out.append(message)  # the normalizer names what is wrong with it
            continue
        if "function_call" in message:
            call = message["function_call"]
            if message.get("tool_calls"):
                raise InvalidParamError("an assistant turn holds function_call or tool_calls, "
                                        "not both", param=f"messages[{i}].function_call")
            if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                    and isinstance(call.get("arguments", ""), str)):
                raise InvalidParamError("function_call must be {name, arguments} (strings)",
                                        param=f"messages[{i}].function_call")
            calls += 1
            last_id = f"call_fn_{calls}"
            turn = {k: v for k, v in message.items() if k != "function_call"}
            turn["tool_calls"] = [{"id": last_id, "type": "function", "function": {
                "name": call["name"], "arguments": call.get("arguments", "")}}]
            out.append(turn)
        elif message.get("role") == "function":
            if not isinstance(message.get("name"), str):
                raise InvalidParamError("a function turn needs the function's name",
                                        param=f"messages[{i}].name")
            out.append({"role": "tool", "tool_call_id": last_id or f"call_fn_{calls + 1}",
                        "name": message["name"], "content": message.get("content")})
        else:
            out.append(message)
    return out


def legacy_message(message: dict[str, Any], finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole answer's message in the legacy shape: its first call (there is at most one)
    as ``function_call``."""
    out = dict(message)
    calls = out.pop("tool_calls", None) or []
    if calls:
        function = calls[0]["function"]
        out["function_call"] = {"name": function["name"], "arguments": function["arguments"]}
    return out, "function_call" if finish_reason == "tool_calls" else finish_reason


def legacy_delta(fields: dict[str, Any]) -> dict[str, Any]:
    """A stream chunk's delta in the legacy shape: a call's name and arguments as
    ``function_call`` pieces."""
    calls = fields.get("tool_calls")
    if not calls:
        return fields
    out = {k: v for k, v in fields.items() if k != "tool_calls"}
    function = calls[0].get("function") or {}
    out["function_call"] = {k: function[k] for k in ("name", "arguments") if k in function}
    return out


def legacy_param(param: str) -> str:
    """The legacy request's name for a field of the tools it became: ``functions[i]...``
    for ``tools[i].function...``, ``function_call`` for ``tool_choice``."""
    match = re.fullmatch(r"tools\[(\d+)\](?:\.function)?(.*)", param)
    if match:
        return f"functions[{match[1]}]{match[2]}"
    if param == "tools":
        return "functions"
    if param.startswith("tool_choice"):
        return "function_call" + param[len("tool_choice"):]
    return param


def legacy_finish(finish_reason: str | None) -> str | None:
    return "function_call" if finish_reason == "tool_calls" else finish_reason
