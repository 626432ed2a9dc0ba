"""Function tools: definitions, ``tool_choice``, history messages and forced calls.

What a request's tools become:

* ``tools`` are checked here (:func:`parse_tools`: a name OpenAI accepts, a valid JSON
  schema for the parameters, no duplicates) and ``tool_choice`` against them
  (:func:`parse_tool_choice`). Errors are :class:`InvalidParamError` naming the field.
* The chat template sees them as transformers passes them (``tools=[{"type": "function",
  "function": {...}}]``). A template that never reads ``tools`` (SmolLM2's, the default
  model's) gets the **fallback tool prompt** instead (:func:`fallback_messages`): the
  definitions and the call format go into the system message, assistant calls in the
  history become ``<tool_call>`` text and tool results become user turns in
  ``<tool_response>`` tags, so such a model calls tools in the ``hermes`` format.
* A named function constrains the output to its arguments object
  (:func:`forced_call_schema`). ``required`` writes the calls in the tool-call parser's
  own syntax where a grammar can follow it (:func:`required_structural_tag`: hermes,
  granite4, internlm, llama3_json, the fallback prompt's hermes calls), else as a JSON list of
  ``{"name", "arguments"}`` objects; one call, or one or more when
  ``parallel_tool_calls``. :class:`ForcedCallStreamer` turns the JSON forms into calls.
* ``auto`` with such a parser, or ``mistral``: text is free, but a call the model opens
  is held to the tools' schemas (:func:`auto_structural_tag`). ``pythonic``, ``granite``,
  ``qwen3_coder`` and ``deepseek_v3`` calls are parsed, not constrained.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jsonschema
import jsonschema.exceptions
import jsonschema.validators

from engine.chat.tool_parsers import (
    ParsedOutput,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    random_call_id,
)
from engine.chat.tool_parsers.scan import bracket_end
from engine.errors import InvalidParamError
from engine.models.chat_template import template_reads

# OpenAI's rule for function names.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

ToolChoiceMode = Literal["none", "auto", "required", "function"]


@dataclasses.dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call. ``parameters`` is its arguments' JSON schema."""

    name: str
    parameters: Mapping[str, Any]
    description: str | None = None

    def to_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclasses.dataclass(frozen=True, slots=True)
class ToolChoice:
    """``none``, ``auto``, ``required``, or ``function`` with the function's ``name``."""

    mode: ToolChoiceMode
    name: str | None = None


NO_TOOLS = ToolChoice("none")

# Parameters of a function declared without any: an object with no properties.
_EMPTY_PARAMETERS: Mapping[str, Any] = {"type": "object", "properties": {}}


def parse_tools(value: Any, param: str = "tools") -> tuple[Tool, ...]:
    """OpenAI's ``tools`` list as :class:`Tool` values; ``InvalidParamError`` naming the
    bad element otherwise (``tools[1].function.parameters``, ...)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidParamError(f"{param} must be a list of tools", param=param)
    tools: list[Tool] = []
    for i, item in enumerate(value):
        tools.append(_parse_tool(item, f"{param}[{i}]"))
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise InvalidParamError(f"{param} declares the function {tool.name!r} twice",
                                    param=param)
        seen.add(tool.name)
    return tuple(tools)


def _parse_tool(item: Any, where: str) -> Tool:
    if not isinstance(item, Mapping):
        raise InvalidParamError(f"{where} must be an object", param=where)
    if item.get("type", "function") != "function":
        raise InvalidParamError(f"{where}.type must be \"function\", got {item.get('type')!r}",
                                param=f"{where}.type")
    function = item.get("function")
    if not isinstance(function, Mapping):
        raise InvalidParamError(f"{where}.function must be an object", param=f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidParamError(
            f"{where}.function.name must be 1-64 letters, digits, _ or -, got {name!r}",
            param=f"{where}.function.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidParamError(f"{where}.function.description must be a string",
                                param=f"{where}.function.description")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = _EMPTY_PARAMETERS
    _check_schema(parameters, f"{where}.function.parameters")
    return Tool(name, parameters, description)


def _check_schema(schema: Any, where: str) -> None:
    if not isinstance(schema, Mapping):
        raise InvalidParamError(f"{where} must be a JSON schema object", param=where)
    if schema.get("type", "object") != "object":
        raise InvalidParamError(f"{where} must describe an object (type \"object\"), got "
                                f"type {schema.get('type')!r}", param=where)
    validator = jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        at = "".join(f"[{p!r}]" for p in exc.path)
        raise InvalidParamError(f"{where} is not a valid JSON schema: {exc.message}"
                                + (f" (at {at})" if at else ""), param=where) from None


def parse_tool_choice(value: Any, tools: Sequence[Tool],
                      param: str = "tool_choice") -> ToolChoice:
    """OpenAI's ``tool_choice`` checked against ``tools``. Absent: ``auto`` when there
    are tools, else ``none``."""
    if value is None:
        return ToolChoice("auto") if tools else NO_TOOLS
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise InvalidParamError(f"{param} {value!r} needs a non-empty tools list",
                                    param=param)
        return ToolChoice(value)
    if isinstance(value, Mapping) and value.get("type") == "function":
        function = value.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str):
            raise InvalidParamError(f"{param}.function.name must be a string",
                                    param=f"{param}.function.name")
        if name not in {t.name for t in tools}:
            known = ", ".join(t.name for t in tools) or "none"
            raise InvalidParamError(f"{param} names the function {name!r}, which is not in "
                                    f"tools (declared: {known})", param=param)
        return ToolChoice("function", name)
    raise InvalidParamError(
        f"{param} must be \"none\", \"auto\", \"required\" or "
        '{"type": "function", "function": {"name": ...}}', param=param)


# -- history messages -------------------------------------------------------------------


def check_tool_fields(message: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The tool-related fields of one history message, checked and in the shape chat
    templates read: ``tool_call_id`` of a ``tool`` message, and an assistant's
    ``tool_calls`` with each ``function.arguments`` decoded into a dict (templates write
    it with ``tojson``; a JSON string there would be encoded twice)."""
    out: dict[str, Any] = {}
    role = message.get("role")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidParamError(f"{where}.tool_call_id is required for a tool message "
                                    "(the id of the call it answers)",
                                    param=f"{where}.tool_call_id")
        out["tool_call_id"] = call_id
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise InvalidParamError(f"{where}.tool_calls is only allowed on assistant "
                                    "messages", param=f"{where}.tool_calls")
        if not isinstance(calls, list):
            raise InvalidParamError(f"{where}.tool_calls must be a list",
                                    param=f"{where}.tool_calls")
        out["tool_calls"] = [_history_call(c, f"{where}.tool_calls[{j}]")
                             for j, c in enumerate(calls)]
    return out


def _history_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise InvalidParamError(f"{where} must be {{\"id\", \"type\": \"function\", "
                                '"function": {"name", "arguments"}}', param=where)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise InvalidParamError(f"{where}.function.arguments is not valid JSON",
                                    param=f"{where}.function.arguments") from None
    if not isinstance(arguments, Mapping):
        raise InvalidParamError(f"{where}.function.arguments must be a JSON object",
                                param=f"{where}.function.arguments")
    out: dict[str, Any] = {"type": "function",
                           "function": {"name": function["name"], "arguments": dict(arguments)}}
    if isinstance(call.get("id"), str):
        out = {"id": call["id"], **out}
    return out


def template_reads_tools(source: str | None) -> bool:
    """Whether a chat template's jinja source reads the ``tools`` variable."""
    return template_reads(source, "tools")


# -- the fallback tool prompt -----------------------------------------------------------

FALLBACK_TOOL_PROMPT = """\
You can call functions. Each one is described by a JSON object with its name, what it \
does and the JSON schema of its arguments:
{tools}

To call one or more functions, answer with one line per call and nothing else:
<tool_call>{{"name": "<function name>", "arguments": <the arguments as a JSON object>}}\
</tool_call>
The results come back in <tool_response> tags. When no function is needed, answer \
normally."""


def fallback_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool],
                      *, describe_tools: bool) -> list[dict[str, Any]]:
    """``messages`` rewritten for a chat template that knows nothing of tools.

    With ``describe_tools`` the tool definitions and the call format
    (:data:`FALLBACK_TOOL_PROMPT`) are added to the first system message (one is
    inserted when there is none). Assistant ``tool_calls`` become ``<tool_call>`` lines in
    the content, and ``tool`` messages become user messages in ``<tool_response>`` tags
    (such a template may not know the role). A content list of text parts gets the call
    lines as more text parts; a system message's, its texts joined with newlines.
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        m = dict(message)
        content = m.get("content")
        if m.get("role") == "assistant" and m.get("tool_calls"):
            lines = [_call_text(c["function"]) for c in m.pop("tool_calls")]
            if isinstance(content, list):
                m["content"] = [*content, *({"type": "text", "text": line} for line in lines)]
            else:
                m["content"] = "\n".join([*([content] if content else []), *lines])
        elif m.get("role") == "tool":
            m = {"role": "user",
                 "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"}
        out.append(m)
    if describe_tools and tools:
        prompt = FALLBACK_TOOL_PROMPT.format(tools="\n".join(
            json.dumps(t.to_openai()["function"], ensure_ascii=False) for t in tools))
        if out and out[0].get("role") == "system":
            system = out[0].get("content", "")
            if isinstance(system, list):
                system = "\n".join(p.get("text", "") for p in system)
            out[0] = {**out[0], "content": f"{system}\n\n{prompt}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _call_text(function: Mapping[str, Any]) -> str:
    body = {"name": function["name"], "arguments": function.get("arguments", {})}
    return f"<tool_call>{json.dumps(body, ensure_ascii=False)}</tool_call>"


# -- forced calls (tool_choice "required" or a named function) --------------------------


def forced_call_schema(tools: Sequence[Tool], choice: ToolChoice,
                       parallel: bool) -> dict[str, Any] | None:
    """The JSON schema the output must match for ``choice``; None unless it forces a call.

    A named function: the output is that function's arguments object. ``required``: a
    list of ``{"name": <a tool>, "arguments": <its arguments>}``, exactly one element
    unless ``parallel``.
    """
    if choice.mode == "function":
        tool = next(t for t in tools if t.name == choice.name)
        return dict(tool.parameters)
    if choice.mode != "required":
        return None
    items = [
        {"type": "object",
         "properties": {"name": {"type": "string", "enum": [t.name]},
                        "arguments": dict(t.parameters)},
         "required": ["name", "arguments"], "additionalProperties": False}
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class ForcedCallStreamer:
    """Calls from an output constrained by :func:`forced_call_schema`.

    A named call streams as it is written: the header (id, name) at once, then each new
    piece of text as an argument fragment. A ``required`` list sends each call once its
    object is complete. Output cut short by ``max_tokens`` leaves a named call's arguments
    a prefix in the stream; the complete message drops such a call
    (:meth:`engine.chat.output.ChatOutputParser.message`).
    """

    def __init__(self, choice: ToolChoice, new_id: Any = random_call_id) -> None:
        if choice.mode not in ("function", "required"):
            raise ValueError(f"tool_choice {choice.mode!r} does not force a call")
        self._choice = choice
        self._new_id = new_id
        self._buf = ""
        self._pos = 0  # required: where the next element may start
        self._calls: list[ToolCall] = []
        self._named_args = ""
        self._named_id = ""

    def feed(self, text: str) -> StreamDelta:
        if self._choice.mode == "function":
            return StreamDelta(tool_calls=tuple(self._named(text)))
        self._buf += text
        return StreamDelta(tool_calls=tuple(self._elements()))

    def finish(self) -> StreamDelta:
        if self._choice.mode == "function" and not self._named_id:
            return StreamDelta(tool_calls=tuple(self._named("")))
        return StreamDelta()

    def result(self) -> ParsedOutput:
        if self._choice.mode == "function":
            assert self._choice.name is not None
            self._calls = [ToolCall(self._named_id or self._new_id(), self._choice.name,
                                    self._named_args)]
        return ParsedOutput(None, tuple(self._calls))

    def _named(self, text: str) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        if not self._named_id:
            self._named_id = self._new_id()
            deltas.append(ToolCallDelta(0, id=self._named_id, name=self._choice.name))
        if not self._named_args:
            # The whitespace a reasoning model may write after </think> is not arguments.
            text = text.lstrip()
        if text:
            self._named_args += text
            deltas.append(ToolCallDelta(0, arguments=text))
        return deltas

    def _elements(self) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        while True:
            start = self._buf.find("{", self._pos)
            if start == -1:
                return deltas
            end = bracket_end(self._buf, start)
            if end is None:
                return deltas
            self._pos = end
            try:
                obj = json.loads(self._buf[start:end])
            except ValueError:  # only a broken constraint gets here; skip, never crash
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                continue
            call = ToolCall(self._new_id(), obj["name"],
                            json.dumps(obj.get("arguments", {}), ensure_ascii=False))
            index = len(self._calls)
            self._calls.append(call)
            deltas += [ToolCallDelta(index, id=call.id, name=call.name),
                       ToolCallDelta(index, arguments=call.arguments)]


# -- calls in the model's own syntax: auto once opened, required from the start ---------


@dataclasses.dataclass(frozen=True, slots=True)
class _CallFrame:
    """How one parser's calls look around the arguments object: ``trigger`` opens a call
    (the grammar's trigger, and the tag's begin); then ``head`` with the function's name;
    the arguments; ``tail``; ``end`` closes the call. ``gap`` is the whitespace allowed
    right after the trigger and before ``end`` (a regex); ``separator`` goes between the
    calls of a forced list. ``lead`` is written right after the trigger, before the gap:
    markers that are special tokens each go as a literal of its own (llguidance matches
    a special token only that way)."""

    trigger: str
    head: str
    tail: str
    end: str
    gap: str
    separator: str
    lead: tuple[str, ...] = ()


# Per tool-call parser. hermes: Qwen's templates write "<tool_call>\n{...}\n</tool_call>",
# the fallback prompt asks for it on one line; both fit the gap. llama3_json: its "name"
# key is the trigger, so the object's remaining keys are the tag's content; calls are
# joined by ";". mistral is not here: "[TOOL_CALLS]" opens one of two shapes
# (_mistral_tags), which one frame cannot write; pythonic is Python syntax, which a JSON tag
# cannot follow: its calls are parsed, not constrained. A forced call of either is a JSON
# list (forced_call_schema).
_CALL_FRAMES: dict[str, _CallFrame] = {
    "hermes": _CallFrame("<tool_call>", '{{"name": "{name}", "arguments": ', "}",
                         "</tool_call>", r"[ \n]{0,2}", "\n"),
    "llama3_json": _CallFrame('{"name":', '"{name}", "parameters": ', "", "}", " ?", "; "),
}
# Granite 4 writes hermes' calls (its markers are special tokens, which the grammar
# backends take as written or as the token).
_CALL_FRAMES["granite4"] = _CALL_FRAMES["hermes"]
# InternLM 2.5: "<|action_start|><|plugin|>\n{...}<|action_end|>", three special tokens.
# The trigger is the first alone: a call then has to be a plugin call (the model's
# <|interpreter|> actions are not tools).
_CALL_FRAMES["internlm"] = _CallFrame("<|action_start|>", '{{"name": "{name}", "parameters": ',
                                      "}", "<|action_end|>", r"[ \n]{0,2}", "\n",
                                      lead=("<|plugin|>",))


def has_call_frame(parser: str) -> bool:
    """Whether calls in ``parser``'s syntax can be held to a grammar (hermes, granite4,
    internlm, llama3_json)."""
    return parser in _CALL_FRAMES


def _call_tag(frame: _CallFrame, tools: Sequence[Tool]) -> dict[str, Any]:
    gap = [{"type": "regex", "pattern": frame.gap}]
    calls = [{"type": "sequence", "elements": [
        {"type": "const_string", "value": frame.head.format(name=t.name)},
        {"type": "json_schema", "json_schema": dict(t.parameters)},
        *([{"type": "const_string", "value": frame.tail}] if frame.tail else [])]}
        for t in tools]
    lead = [{"type": "const_string", "value": marker} for marker in frame.lead]
    content = {"type": "sequence",
               "elements": [*lead, *gap, calls[0] if len(calls) == 1 else
                            {"type": "or", "elements": calls}, *gap]}
    return {"type": "tag", "begin": frame.trigger, "content": content, "end": frame.end}


# Mistral's call marker, and the one between a call's name and its arguments in the
# newer (v11+) tokenizers' syntax. Both are special tokens in Mistral's tokenizers.
_MISTRAL_CALLS = "[TOOL_CALLS]"
_MISTRAL_ARGS = "[ARGS]"


def _mistral_tags(tools: Sequence[Tool], parallel: bool) -> list[dict[str, Any]]:
    """The two shapes the ``mistral`` parser reads after ``[TOOL_CALLS]``, as tags it
    opens:

    * ``[{"name": ..., "arguments": {...}}, ...]`` (Mistral 7B v0.3, Nemo): one element
      unless ``parallel``. The closing ``]`` is the tag's end, not part of its content:
      xgrammar lets a ``tags_with_separator`` run only up to an end string.
    * ``name[ARGS]{...}`` (Mistral Small 3.2, Devstral, Magistral; each call opens with
      its own ``[TOOL_CALLS]``). The name and ``[ARGS]`` are content, not the tag's
      begin: llguidance matches a special token only as a literal of its own.
    """
    def arguments(tool: Tool) -> dict[str, Any]:
        return {"type": "json_schema", "json_schema": dict(tool.parameters)}

    items = [{"type": "tag", "begin": f'{{"name": "{t.name}", "arguments": ',
              "content": arguments(t), "end": "}"} for t in tools]
    listed = {"type": "tag", "begin": _MISTRAL_CALLS, "end": "]", "content": {
        "type": "sequence", "elements": [
            # Mistral 7B v0.3 writes "[TOOL_CALLS] [", the space its own token.
            {"type": "regex", "pattern": r"[ \n]{0,2}"},
            {"type": "const_string", "value": "["},
            {"type": "tags_with_separator", "tags": items, "separator": ", ",
             "at_least_one": True, "stop_after_first": not parallel}]}}
    named = [{"type": "sequence", "elements": [
        {"type": "const_string", "value": t.name},
        {"type": "const_string", "value": _MISTRAL_ARGS}, arguments(t)]} for t in tools]
    return [listed, {"type": "tag", "begin": _MISTRAL_CALLS, "end": "", "content":
                     named[0] if len(named) == 1 else {"type": "or", "elements": named}}]


def auto_structural_tag(tools: Sequence[Tool], parser: str,
                        parallel: bool = True) -> dict[str, Any] | None:
    """An xgrammar structural tag for ``tool_choice: "auto"``: text is free until the
    model writes the parser's call opening; from there the call must name one of
    ``tools`` and its arguments must match that tool's schema, and the call must close.
    Without ``parallel`` the output ends after the first call (for ``mistral``, a list of
    one). None when the parser's syntax cannot be constrained this way (``pythonic``)."""
    if not tools:
        return None
    if parser == "mistral":
        trigger, tags = _MISTRAL_CALLS, _mistral_tags(tools, parallel)
    elif (frame := _CALL_FRAMES.get(parser)) is not None:
        trigger, tags = frame.trigger, [_call_tag(frame, tools)]
    else:
        return None
    return {"type": "structural_tag",
            "format": {"type": "triggered_tags", "triggers": [trigger], "tags": tags,
                       "stop_after_first": not parallel}}


def required_structural_tag(tools: Sequence[Tool], parser: str,
                            parallel: bool = True) -> dict[str, Any] | None:
    """The structural tag of ``tool_choice: "required"`` in the parser's own call syntax:
    one call (or, with ``parallel``, one or more joined by the frame's separator) and
    nothing else. A model told to write calls this way ends the turn after them, where a
    JSON list in a syntax it was never shown tends to run on (SmolLM2 through the
    fallback prompt, 8 seeds at temperature 1 within 200 tokens: 8 ended against 6).
    None without a frame."""
    frame = _CALL_FRAMES.get(parser)
    if frame is None or not tools:
        return None
    return {"type": "structural_tag",
            "format": {"type": "tags_with_separator", "tags": [_call_tag(frame, tools)],
                       "separator": frame.separator, "at_least_one": True,
                       "stop_after_first": not parallel}}
