"""The pooling routes: ``/v1/embeddings``, ``/v1/score`` and ``/v1/rerank`` (with vLLM's
other paths for the last two): their bodies and answers (:mod:`.protocol`)."""
