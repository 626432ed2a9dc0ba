"""The building blocks the model families are made of (nano-vllm's ``layers/``).

``linear`` (the dense :class:`~engine.models.layers.linear.Linear`, the block-quantized
``QuantLinear``, ``make_linear`` and the token embedding), ``rope`` (rotary tables),
``norm`` (Gemma's RMSNorm, the per-head q/k norm), ``moe`` (the sparse MLP block) and
``shard`` (the weights a tensor-parallel rank keeps, fetched by Hugging Face name).
"""
