"""Tool-call parsers: a model's text in, OpenAI tool calls and the remaining content out.

Each parser knows one model family's way of writing calls:

===============  ==========================================================  ===============
name             what the model writes                                       model families
===============  ==========================================================  ===============
``hermes``       ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``  Qwen2.5, Qwen3,
                 (one block per call)                                        Hermes 2/3
``granite4``     the same as ``hermes`` (its markers special tokens)         Granite 4
``llama3_json``  ``{"name": ..., "parameters": {...}}``, calls joined by      Llama 3.1-3.3
                 ``;``, optionally after ``<|python_tag|>``
``mistral``      ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` or   Mistral 7B v0.3,
                 ``[TOOL_CALLS]name[ARGS]{...}``                             Mistral Small/Nemo
``pythonic``     ``[get_weather(city="Paris"), ...]`` (optionally inside      Llama 3.2/4,
                 ``<|python_start|>...<|python_end|>``)                      ToolACE
``granite``      ``<|tool_call|>`` or ``<tool_call>``, then a JSON list of     Granite 3.0-3.3
                 ``{"name", "arguments"}`` (the whole output)
``phi4_mini_``   ``functools[{"name", "arguments"}, ...]`` (the whole output)  Phi-4-mini
``json``
``internlm``     ``<|action_start|><|plugin|>{"name", "parameters"}``         InternLM 2/2.5
                 ``<|action_end|>``
``qwen3_coder``  ``<tool_call><function=NAME><parameter=P>value</parameter>``  Qwen3-Coder
                 ``</function></tool_call>``, values typed by the schema
``olmo3``        ``<function_calls>`` + one ``name(key=value)`` a line +         OLMo 3
                 ``</function_calls>``
``glm45``        ``<tool_call>NAME`` + per argument ``<arg_key>K</arg_key>``       GLM-4.5, 4.6
                 ``<arg_value>V</arg_value>`` + ``</tool_call>``, values
                 typed by the schema
``kimi_k2``      ``<|tool_calls_section_begin|>``, per call                    Kimi K2
                 ``<|tool_call_begin|>functions.NAME:I<|tool_call_argument_``
                 ``begin|>{...}<|tool_call_end|>`` (its id kept), then
                 ``<|tool_calls_section_end|>``
``deepseek_v31`` the same section, per call ``<｜tool▁call▁begin｜>NAME``         DeepSeek V3.1
                 ``<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``
``openai``       harmony: ``<|channel|>commentary to=functions.NAME``          gpt-oss
                 ``<|constrain|>json<|message|>{...}`` (the recipient
                 before or after the channel), ended by ``<|call|>``
``deepseek_v3``  ``<｜tool▁calls▁begin｜>``, per call ``<｜tool▁call▁begin｜>``       DeepSeek V3
                 ``function<｜tool▁sep｜>NAME`` + a ```json block +
                 ``<｜tool▁call▁end｜>``, then ``<｜tool▁calls▁end｜>``
===============  ==========================================================  ===============

Streaming (:meth:`ToolParser.streamer`) gives OpenAI-shaped deltas: text before a call
streams as content as it arrives (holding back only what could be the start of a call
marker); a call is sent once its text is complete and parses, as one delta with ``index``,
``id``, ``type`` and ``name`` and then its ``arguments``. Holding a call until it is
complete is deliberate: text that opens a call and then turns out malformed comes back as
content, never as a half-sent broken call, and a streamed response assembles to exactly
what the complete parse returns (the tests check this at every split point).
``arguments`` is then the JSON text of the call's arguments object, written by
``json.dumps`` (so it always parses).

A call generated under the tools' grammar (``streamer(constrained=True)``: ``auto`` once
the call opens, ``required`` in the parser's syntax) cannot turn out malformed, so where
the parser knows the grammar's frame (``hermes``, ``granite4``) it streams the call as it is written:
the header once the name is complete, then each new piece of the arguments object as an
argument fragment, the model's own JSON text. Only ``max_tokens`` can cut such a call
short; its arguments are then the prefix that was written, as with a named forced call.
The other parsers send constrained calls whole, as above.

Whitespace right before or after a call is not content (models put newlines between
calls); other text around calls is.

The package: :mod:`~engine.chat.tool_parsers.base` holds what every parser shares (the
results, the scanner interface, the streaming driver, the registry),
:mod:`~engine.chat.tool_parsers.scan` the scanning helpers, and each family's module its
syntax, registering its parsers by name in :data:`TOOL_PARSERS`. Adding a parser is one
new module, imported below.
"""

from __future__ import annotations

# Each family's module registers its parsers on import.
from engine.chat.tool_parsers import (  # noqa: F401
    deepseek_v3,
    glm45,
    granite,
    hermes,
    internlm,
    kimi_k2,
    llama3_json,
    mistral,
    olmo3,
    openai,
    phi4_mini,
    pythonic,
    qwen3_coder,
)
from engine.chat.tool_parsers.base import (
    TOOL_PARSERS,
    ParsedOutput,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStreamer,
    ToolParser,
    get_tool_parser,
    random_call_id,
    register_tool_parser,
)
from engine.chat.tool_parsers.mistral import mistral_call_id

__all__ = [
    "TOOL_PARSERS",
    "ParsedOutput",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStreamer",
    "ToolParser",
    "get_tool_parser",
    "mistral_call_id",
    "random_call_id",
    "register_tool_parser",
]
