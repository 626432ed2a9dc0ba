"""Chat templates and tools shared by the tool-calling and reasoning tests.

``TOOL_TEMPLATE`` is a ChatML template that knows tools the way Qwen2.5's does (tool
definitions in the system turn, calls as ``<tool_call>`` JSON, results as
``<tool_response>`` user turns), written here for the tests. ``THINK_TEMPLATE`` opens a
``<think>`` block in the generation prompt as DeepSeek-R1's does, unless
``enable_thinking`` is false (then it writes an empty one, as Qwen3's does).
"""

from __future__ import annotations

from typing import Any

TOOL_TEMPLATE = """\
{%- if tools %}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a function as <tool_call>{"name": <name>, "arguments": <arguments>}</tool_call>
<|im_end|>
{% elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' %}
<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{% for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}
<|im_end|>
{% elif message.role != 'system' %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

THINK_TEMPLATE = """\
{%- for message in messages %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""

WEATHER_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone.",
    "parameters": {"type": "object",
                   "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]},
                                  "hour24": {"type": "boolean"}},
                   "required": ["zone", "hour24"], "additionalProperties": False}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]

ROUND_TRIP = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather",
                      "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "9 degrees, rain"},
]

# Markers that Qwen-family tokenizers hold as single added (not special) tokens. The tiny
# model learns none of them from its corpus (each is ~10 byte tokens there), so a random
# model would all but never write one; as single tokens a logit_bias on one makes the
# model open calls and close its reasoning, which the tests need to see.
# A template that reads reasoning_effort (as gpt-oss's does): the Responses and Messages
# routes' effort fields reach it.
EFFORT_TEMPLATE = ("{% if reasoning_effort is defined %}Effort: {{ reasoning_effort }}. "
                   "{% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                   "{% endfor %}assistant:")

MARKER_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")


# Mistral's call markers, special tokens in its tokenizers (the server then keeps special
# tokens in the text for the mistral parser).
MISTRAL_MARKER_TOKENS = ("[TOOL_CALLS]", "[ARGS]")
# Magistral's reasoning markers, special tokens too (the mistral reasoning parser).
MAGISTRAL_MARKER_TOKENS = ("[THINK]", "[/THINK]", "[TOOL_CALLS]")
# gpt-oss's harmony format: its markers (special tokens), and a template of the tests' own
# (a subset of gpt-oss's): each turn a message, the assistant's on the final channel, the
# generation prompt <|start|>assistant.
HARMONY_MARKER_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
                         "<|call|>")
HARMONY_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- else -%}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")


def write_marker_model(path: Any, chat_template: str,
                       markers: tuple[str, ...] = MARKER_TOKENS, special: bool = False) -> Any:
    """A tiny qwen2 whose tokenizer holds ``markers`` as added tokens (special ones with
    ``special``; the model's vocabulary grows to match) and whose chat template is
    ``chat_template``."""
    import json

    from engine.models.testing import TINY_VOCAB_SIZE, write_tiny_model

    size = TINY_VOCAB_SIZE + len(markers)
    # 2048 positions: the fallback tool prompt alone is ~550 tokens (the tiny model's 512
    # would not hold a conversation).
    path = write_tiny_model(path, "qwen2", overrides={"vocab_size": size,
                                                      "max_position_embeddings": 2048})
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    base = len(tokenizer["model"]["vocab"])
    assert base == TINY_VOCAB_SIZE, "the tiny tokenizer's vocabulary changed size"
    tokenizer["added_tokens"] += [
        {"id": base + i, "content": marker, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": special}
        for i, marker in enumerate(markers)]
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def marker_id(tokenizer: Any, marker: str) -> int:
    (token,) = tokenizer.encode(marker, add_special_tokens=False)
    return int(token)
