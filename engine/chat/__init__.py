"""The chat layer between OpenAI messages and model text: tool calls and reasoning.

Pure code (no I/O, no trio), shared by the HTTP server and the embedded API:

* :mod:`engine.chat.tool_parsers` turns a model's text into tool calls (``hermes``,
  ``llama3_json``, ``mistral``, ``pythonic``), complete or streamed.
* :mod:`engine.chat.reasoning` splits ``<think>...</think>`` into reasoning and content
  (``deepseek_r1``, ``qwen3``), complete or streamed.
* :mod:`engine.chat.tools` checks tool definitions and ``tool_choice`` and holds the
  built-in fallback tool template for chat templates that ignore ``tools``.
"""
