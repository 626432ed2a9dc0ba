"""The chat layer between OpenAI messages and model text: templates, tool calls, reasoning.

Pure code (no I/O, no trio), shared by the HTTP server and the embedded API:

* :mod:`engine.chat.tool_parsers` turns a model's text into tool calls (``hermes``, ``granite4``,
  ``llama3_json``, ``mistral``, ``pythonic``, ``granite``, ``internlm``, ``qwen3_coder``,
  ``deepseek_v3``), complete or streamed.
* :mod:`engine.chat.reasoning` splits ``<think>...</think>`` into reasoning and content
  (``deepseek_r1``, ``qwen3``), complete or streamed.
* :mod:`engine.chat.tools` checks tool definitions and ``tool_choice`` and holds the
  built-in fallback tool template for chat templates that ignore ``tools``.
* :mod:`engine.chat.template` normalizes chat messages and renders them with the model's
  chat template (with the request's tools and template options) into the prompt and its
  token ids.

The embedded API's typed values (:mod:`engine.chat.session`) are re-exported here.
"""

from engine.chat.output import ChatDelta, ChatMessage
from engine.chat.session import ChatChoice, ChatChunk, ChatResult
from engine.chat.tool_parsers import ToolCall, ToolCallDelta
from engine.chat.tools import Tool, ToolChoice

__all__ = ["ChatChoice", "ChatChunk", "ChatDelta", "ChatMessage", "ChatResult", "Tool",
           "ToolCall", "ToolCallDelta", "ToolChoice"]
