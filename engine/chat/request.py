"""The chat-only fields of a request body and the server's chat settings.

:func:`parse_chat_fields` reads ``tools``, ``tool_choice``, ``parallel_tool_calls``,
``chat_template``, ``chat_template_kwargs``, ``add_generation_prompt``,
``continue_final_message`` and ``echo`` into a :class:`ChatFields`: what the chat
template gets (:class:`TemplateOptions`), how the outputs are read
(:class:`engine.chat.output.ChatOutputOptions`) and the constraint of its calls
(:attr:`ChatFields.constraint`). Errors are :class:`InvalidParamError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from engine.chat.output import ChatOutputOptions
from engine.chat.reasoning import ReasoningParser, get_reasoning_parser
from engine.chat.tool_parsers import ToolParser, get_tool_parser
from engine.chat.tools import (
    Tool,
    ToolChoice,
    auto_structural_tag,
    forced_call_schema,
    parse_tool_choice,
    parse_tools,
    required_structural_tag,
    template_reads_tools,
)
from engine.errors import InvalidParamError
from engine.models.chat_template import template_reads
from engine.params import SamplingParams
from engine.structured import StructuredOutputs

# The parser that reads calls written after the fallback tool prompt, which asks for
# hermes-style <tool_call> lines.
FALLBACK_TOOL_PARSER = "hermes"

# OpenAI's own limit on the functions of one request.
DEFAULT_MAX_TOOLS = 128
# The tools of one request as JSON: 128 tools with generous schemas take ~100 KB. Every
# byte is read into the prompt (the template renders it) and the calls' grammar.
DEFAULT_MAX_TOOL_SCHEMA_BYTES = 1 << 20
# A request's own chat template (--trust-request-chat-template): the largest real ones
# (tool-calling templates) are 10-20 KB; compiling jinja costs time and memory in
# proportion to the source, before any render budget applies.
MAX_REQUEST_TEMPLATE_CHARS = 1 << 16


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ChatSettings:
    """The server's chat options (``serve`` flags), checked when built.

    ``tool_call_parser`` with ``enable_auto_tool_choice`` lets ``tool_choice: "auto"`` read
    calls from free text, as vLLM's flags of the same names. ``reasoning_parser`` splits
    thinking from the answer. ``chat_template`` (jinja source) replaces the model's.
    ``trust_request_chat_template`` lets requests send their own template (it runs in
    the jinja sandbox, but can still cost CPU: off by default, as in vLLM).
    ``default_chat_template_kwargs`` go under every request's ``chat_template_kwargs``.
    ``max_tools`` and ``max_tool_schema_bytes`` bound a request's ``tools`` (their count,
    and their size as JSON).
    """

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    max_tools: int = DEFAULT_MAX_TOOLS
    max_tool_schema_bytes: int = DEFAULT_MAX_TOOL_SCHEMA_BYTES
    # vLLM's --default-chat-template-kwargs: under every request's chat_template_kwargs
    # (a key the request sets wins).
    default_chat_template_kwargs: Mapping[str, Any] | None = None
    # vLLM's --response-role: the role a chat answer's message carries.
    response_role: str = "assistant"

    def __post_init__(self) -> None:
        for name in ("max_tools", "max_tool_schema_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a non-negative integer, "
                                 f"got {value!r}")
        if not isinstance(self.response_role, str) or not self.response_role:
            raise ValueError("--response-role must be a non-empty role name")
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")

    @property
    def tool_parser(self) -> ToolParser | None:
        return get_tool_parser(self.tool_call_parser) if self.tool_call_parser else None

    @property
    def reasoning(self) -> ReasoningParser | None:
        return get_reasoning_parser(self.reasoning_parser) if self.reasoning_parser else None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TemplateOptions:
    """What the chat template is rendered with (see
    :func:`engine.chat.template.apply_chat_template`)."""

    tools: tuple[Mapping[str, Any], ...] | None = None
    chat_template: str | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: tuple[Mapping[str, Any], ...] | None = None  # a RAG template's sources

    def to_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`engine.chat.template.apply_chat_template`."""
        return {
            "tools": list(self.tools) if self.tools is not None else None,
            "chat_template": self.chat_template,
            "chat_template_kwargs": dict(self.chat_template_kwargs or {}),
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "documents": list(self.documents) if self.documents is not None else None,
        }

    def to_json(self) -> str:
        """:meth:`to_kwargs` as JSON text (the form :class:`engine.messages.ChatPrompt`
        carries)."""
        return json.dumps(self.to_kwargs())


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ChatFields:
    template: TemplateOptions
    output: ChatOutputOptions
    # What the request's tools constrain the output to (None: nothing):
    # * required: the calls in the parser's syntax (hermes, granite4, internlm, llama3_json,
    #   the fallback prompt's hermes calls), or else a JSON list of {"name", "arguments"}
    #   objects;
    # * a named function: its arguments object;
    # * auto, with a parser a grammar can follow (hermes, granite4, internlm, llama3_json,
    #   mistral): free text, but a call the model opens is held to the tools' schemas.
    constraint: StructuredOutputs | None
    echo: bool
    # The answer message's role (vLLM's): --response-role with a generation prompt, else
    # the role of the message being continued.
    role: str = "assistant"

    @property
    def forced(self) -> bool:
        """Whether the constraint forces a call (``required`` or a named function)."""
        return self.output.forced


def parse_chat_fields(body: Mapping[str, Any], settings: ChatSettings,
                      model_template: str | None) -> ChatFields:
    """The chat-only fields of ``body``; ``model_template`` is the model's template
    source (to tell whether it reads ``tools``)."""
    template = template_options(body, settings)
    check_tool_limits(body.get("tools"), settings)
    tools = parse_tools(body.get("tools"))
    choice = parse_tool_choice(body.get("tool_choice"), tools)
    parallel = _bool(body, "parallel_tool_calls", True)
    source = template.chat_template or model_template
    # The parser names the model's call syntax: auto reads calls with it, and required
    # writes them in it where a grammar can follow it.
    parser = (settings.tool_parser
              if settings.enable_auto_tool_choice or choice.mode == "required" else None)
    if choice.mode != "none" and parser is None and not template_reads_tools(source):
        # The fallback prompt asks for hermes-style calls.
        parser = get_tool_parser(FALLBACK_TOOL_PARSER)
    if choice.mode == "auto" and parser is None:
        raise InvalidParamError(
            'tool_choice "auto" needs the server started with --enable-auto-tool-choice '
            '--tool-call-parser NAME; send "required", a named function or "none"',
            param="tool_choice")
    template = _reasoning_effort(body, template, source)
    constraint = _tools_constraint(tools, choice, parser, parallel)
    output = ChatOutputOptions(
        tools=tools, tool_choice=choice, tool_parser=parser,
        reasoning_parser=None if _thinking_off(template, source, settings.reasoning)
        else settings.reasoning,
        include_reasoning=_include_reasoning(body, settings),
        forced_in_parser_syntax=choice.mode == "required" and constraint is not None
        and constraint.kind == "structural_tag")
    if choice.mode != "none":
        # tool_choice "none" keeps the tools out of the prompt, so the model is not invited
        # to write calls that would then come back as text.
        template = dataclasses.replace(template, tools=tuple(t.to_openai() for t in tools))
    return ChatFields(template=template, output=output, constraint=constraint,
                      echo=_bool(body, "echo", False), role=_answer_role(body, template, settings))


def _answer_role(body: Mapping[str, Any], template: TemplateOptions,
                 settings: ChatSettings) -> str:
    """vLLM's role of a chat answer: ``--response-role`` when the template opened a reply
    (``add_generation_prompt``), else the last message's role (the turn being continued)."""
    if template.add_generation_prompt:
        return settings.response_role
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages else None
    role = last.get("role") if isinstance(last, Mapping) else None
    return role if isinstance(role, str) and role else settings.response_role


def _thinking_off(template: TemplateOptions, source: str | None,
                  reasoning: ReasoningParser | None) -> bool:
    """Whether the request turned the model's thinking off through the reasoning
    format's switch in ``chat_template_kwargs`` (:meth:`ReasoningParser.thinking_off`:
    Qwen3's ``enable_thinking: false`` on a template that reads it, Granite's ``thinking``
    left unset). The output then holds no reasoning: it is all content and a constraint
    (a forced call, a response_format) starts at once, where an optional reasoning block
    would let the model open one again and spend the output on it (vLLM's parsers read the
    same switches)."""
    if reasoning is None:
        return False
    return reasoning.thinking_off(template.chat_template_kwargs or {},
                                  lambda name: template_reads(source, name))


def check_tool_limits(tools: Any, settings: ChatSettings) -> None:
    """Refuse ``tools`` past the server's limits (their count, their JSON size) before
    anything reads them: 60,000 tools took a minute to check and render."""
    if not isinstance(tools, list):
        return
    if len(tools) > settings.max_tools:
        raise InvalidParamError(
            f"tools holds {len(tools)} functions; this server accepts at most "
            f"{settings.max_tools} (--max-tools)", param="tools")
    try:
        size = len(json.dumps(tools, ensure_ascii=False).encode())
    except (TypeError, ValueError):
        return  # not JSON: parse_tools names what is wrong
    if size > settings.max_tool_schema_bytes:
        raise InvalidParamError(
            f"tools takes {size} bytes as JSON; this server accepts at most "
            f"{settings.max_tool_schema_bytes} (--max-tool-schema-bytes)", param="tools")


def _tools_constraint(tools: tuple[Tool, ...], choice: ToolChoice, parser: ToolParser | None,
                      parallel: bool) -> StructuredOutputs | None:
    tag = None
    if parser is not None and choice.mode == "auto":
        tag = auto_structural_tag(tools, parser.name, parallel)
    elif parser is not None and choice.mode == "required":
        tag = required_structural_tag(tools, parser.name, parallel)
    if tag is not None:
        return StructuredOutputs(structural_tag=tag)
    schema = forced_call_schema(tools, choice, parallel)
    return StructuredOutputs(json=schema) if schema is not None else None


def chat_sampling_params(params: SamplingParams, fields: ChatFields, *,
                         keep_skip_special_tokens: bool = False) -> SamplingParams:
    """``params`` with what the request's tools and reasoning need: special tokens kept
    in the text for a parser whose call markers are special tokens (unless the caller
    chose ``skip_special_tokens``); the tools' constraint (``fields.constraint``); and,
    with a reasoning parser, any constraint starting only after the reasoning (the model
    thinks freely first)."""
    parser = fields.output.tool_parser
    reads_text = (fields.output.tool_choice.mode == "auto"
                  or fields.output.forced_in_parser_syntax)
    if (reads_text and parser is not None and parser.needs_special_tokens
            and not keep_skip_special_tokens):
        params = params.replace(skip_special_tokens=False)
    if fields.forced:
        if params.structured_outputs is not None:
            raise InvalidParamError(
                'tool_choice "required" or a named function constrains the output already; '
                "it cannot be combined with response_format or structured outputs",
                param="tool_choice")
        # The forced call is generated under its grammar, token by token.
        params = params.replace(structured_outputs=fields.constraint)
    elif (fields.constraint is not None and params.structured_outputs is None
          and not params.ignore_eos and not params.stop):
        # auto: free text, but a call the model opens is generated under the tools'
        # schemas. (A response_format wins over it; ignore_eos asks for text no grammar
        # could end; a stop string could end a call mid-way, so with `stop` calls are
        # read from free text, as vLLM does, and a cut one stays content.)
        params = params.replace(structured_outputs=fields.constraint)
    reasoning = fields.output.reasoning_parser
    spec = params.structured_outputs
    if reasoning is not None and spec is not None:
        params = params.replace(structured_outputs=dataclasses.replace(spec, think=reasoning.think))
    if reasoning is not None and reasoning.special_markers and not keep_skip_special_tokens:
        params = params.replace(skip_special_tokens=False)  # Mistral's [THINK] stays in the text
    return params


def calls_constrained(fields: ChatFields, params: SamplingParams) -> bool:
    """Whether ``params`` (from :func:`chat_sampling_params`) generate the output under
    the tools' grammar in the parser's call syntax: ``auto`` without a
    ``response_format``, and ``required`` where the parser has a frame. Its calls are then
    well formed by construction, and may stream as they are written."""
    tag = fields.constraint.structural_tag if fields.constraint is not None else None
    spec = params.structured_outputs
    return tag is not None and spec is not None and spec.structural_tag == tag


def constraint_param(fields: ChatFields, params: SamplingParams) -> str | None:
    """The request field to name when the constraint ``chat_sampling_params`` added fails
    to compile: ``tool_choice`` for a forced call, ``tools`` for an ``auto`` call's tag."""
    spec = params.structured_outputs
    if spec is None or fields.constraint is None:
        return None
    if fields.forced:
        return "tool_choice"
    return "tools" if spec.structural_tag == fields.constraint.structural_tag else None


def template_options(body: Mapping[str, Any], settings: ChatSettings, *,
                     generation_prompt: bool = True) -> TemplateOptions:
    """The chat template's options a body asks for (``chat_template``,
    ``chat_template_kwargs``, ``add_generation_prompt``, whose default is
    ``generation_prompt``, and ``continue_final_message``), checked."""
    source = body.get("chat_template")
    if source is not None:
        if not settings.trust_request_chat_template:
            raise InvalidParamError(
                "chat_template in a request needs the server started with "
                "--trust-request-chat-template", param="chat_template")
        if not isinstance(source, str) or not source:
            raise InvalidParamError("chat_template must be a non-empty string",
                                    param="chat_template")
        if len(source) > MAX_REQUEST_TEMPLATE_CHARS:
            raise InvalidParamError(
                f"chat_template is {len(source)} characters; at most "
                f"{MAX_REQUEST_TEMPLATE_CHARS} are accepted", param="chat_template")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, Mapping):
            raise InvalidParamError("chat_template_kwargs must be an object",
                                    param="chat_template_kwargs")
        try:
            json.dumps(kwargs)
        except (TypeError, ValueError):
            raise InvalidParamError("chat_template_kwargs must be JSON",
                                    param="chat_template_kwargs") from None
    if settings.default_chat_template_kwargs:
        kwargs = {**settings.default_chat_template_kwargs, **(kwargs or {})}
    add_generation_prompt = _bool(body, "add_generation_prompt", generation_prompt)
    continue_final = _bool(body, "continue_final_message", False)
    if continue_final and add_generation_prompt:
        raise InvalidParamError(
            "continue_final_message needs add_generation_prompt set to false",
            param="continue_final_message")
    return TemplateOptions(
        chat_template=source if source is not None else settings.chat_template,
        chat_template_kwargs=kwargs, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final, documents=_documents(body.get("documents")))


def _documents(value: Any) -> tuple[Mapping[str, Any], ...] | None:
    """vLLM's ``documents`` (the sources a retrieval-augmented chat template cites, as
    transformers' ``apply_chat_template(documents=...)`` takes them): objects of JSON
    values, typically ``{"title", "text"}``."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidParamError("documents must be a list of objects", param="documents")
    for i, doc in enumerate(value):
        if not isinstance(doc, Mapping):
            raise InvalidParamError("each document must be an object (e.g. {\"title\", "
                                    "\"text\"})", param=f"documents[{i}]")
        try:
            json.dumps(doc)
        except (TypeError, ValueError):
            raise InvalidParamError("a document must be JSON", param=f"documents[{i}]") from None
    return tuple(value)


def _reasoning_effort(body: Mapping[str, Any], template: TemplateOptions,
                      source: str | None) -> TemplateOptions:
    """OpenAI's ``reasoning_effort``, given to the chat template as the variable of that
    name (as vLLM does; gpt-oss's template reads it). A template that never reads it would
    drop it silently, so that is a 400 instead."""
    effort = body.get("reasoning_effort")
    if effort is None:
        return template
    if not isinstance(effort, str):
        raise InvalidParamError("reasoning_effort must be a string", param="reasoning_effort")
    if not template_reads(source, "reasoning_effort"):
        raise InvalidParamError(
            "reasoning_effort is not supported by this model: its chat template does not "
            "read a reasoning_effort variable (chat_template_kwargs passes model-specific "
            "switches such as enable_thinking)", param="reasoning_effort")
    kwargs = {"reasoning_effort": effort, **(template.chat_template_kwargs or {})}
    return dataclasses.replace(template, chat_template_kwargs=kwargs)


def _include_reasoning(body: Mapping[str, Any], settings: ChatSettings) -> bool:
    """vLLM's ``include_reasoning``: false drops the reasoning the parser splits off.
    Without a reasoning parser nothing tells reasoning from the answer (it would stay in
    ``content``): a 400 rather than an answer that still holds it."""
    include = _bool(body, "include_reasoning", True)
    if not include and settings.reasoning is None:
        raise InvalidParamError("include_reasoning: false needs the server started with "
                                "--reasoning-parser (without one the reasoning cannot be told "
                                "from the answer)", param="include_reasoning")
    return include


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    return lax_bool(body.get(name), name, default)


# The spellings pydantic's lax mode reads as booleans (vLLM's request models are pydantic
# models, so a client written against vLLM may send "true" or 1): strings whatever their
# case, the integers 0 and 1, the floats 0.0 and 1.0. Anything else stays a 400.
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def lax_bool(value: Any, name: str, default: bool = False) -> bool:
    """A boolean request field as vLLM's pydantic models coerce it; ``default`` when it is
    absent or null; :class:`InvalidParamError` naming ``name`` otherwise."""
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise InvalidParamError(f"{name} must be a boolean", param=name)


def load_chat_template(value: str) -> str:
    """``--chat-template``: a file's contents when ``value`` names a file, else the
    template itself (as vLLM's flag)."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:
        pass
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a jinja template")
    return value


def thinking_budget_params(body: Mapping[str, Any], params: SamplingParams,
                           settings: ChatSettings, fields: ChatFields | None,
                           encode: Callable[[str], list[int]]) -> SamplingParams:
    """vLLM's ``thinking_token_budget``: with a reasoning parser, the reasoning's end marker
    is forced once the reasoning holds that many tokens (``encode`` tokenizes the markers).
    Without a reasoning parser there is no reasoning to bound: a 400. A request whose
    thinking is off (``fields``' parser is None) has none either: the budget bounds
    nothing. A format whose reasoning ends in more than one spelling (Granite's "Here
    is" and "Here's") cannot be watched by token: a 400."""
    budget = body.get("thinking_token_budget")
    if budget is None:
        return params
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise InvalidParamError("thinking_token_budget must be a non-negative integer",
                                param="thinking_token_budget")
    reasoning = settings.reasoning
    if reasoning is None:
        raise InvalidParamError("thinking_token_budget needs the server started with "
                                "--reasoning-parser", param="thinking_token_budget")
    if len(reasoning.starts) > 1 or len(reasoning.ends) > 1:
        raise InvalidParamError(
            f"thinking_token_budget is not supported with the {reasoning.name} reasoning "
            f"parser: its reasoning ends with any of {', '.join(map(repr, reasoning.ends))}, "
            "which a token budget cannot watch for", param="thinking_token_budget")
    if fields is not None and fields.output.reasoning_parser is None:
        return params  # thinking is off for this request
    start = () if reasoning.starts_in_reasoning else tuple(encode(reasoning.starts[0]))
    return params.replace(thinking_token_budget=budget, think_start_token_ids=start,
                          think_end_token_ids=tuple(encode(reasoning.ends[0])))
