"""OpenAI's ``/v1/completions`` and ``/v1/chat/completions``, and vLLM's routes around them
(``/inference/v1/generate``, ``/v1/chat/completions/render``, ``/v1/completions/render``):
request parsing (:mod:`.protocol`, :mod:`.tokens`), answers (:mod:`.answer`) and routes."""
