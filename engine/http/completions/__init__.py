"""OpenAI's ``/v1/completions`` and ``/v1/chat/completions``, and vLLM's routes around them
(``/inference/v1/generate``, ``/v1/chat/completions/render``, ``/v1/completions/render``):
the requests (:mod:`.protocol`, :mod:`.tokens`), the answers (:mod:`.answer`), one request
in flight (:mod:`.run`) and the routes (:mod:`.routes`)."""
