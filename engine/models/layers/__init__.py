"""The building blocks the model families are made of (nano-vllm's ``layers/``).

``linear`` (the dense :class:`~engine.models.layers.linear.Linear`, the block-quantized
``QuantLinear``, ``make_linear`` and the token embedding), ``rope`` (rotary tables),
``norm`` (Gemma's RMSNorm, the per-head q/k norm), ``moe`` (the sparse MLP block),
``shard`` (the weights a tensor-parallel rank keeps, fetched by Hugging Face name) and
``decoder`` (the attention, MLP, layer and stack that Llama, Mistral, Qwen2/3, Phi-3,
Mixtral and Qwen-MoE share, and Gemma, LLaVA and Qwen-VL build on).

A family module (``engine.models.llama``, ``gemma``, ``bert``, ``llava``, ``qwen_vl``)
imports from here, from ``engine.models.config`` and from the floors below, never from
another family; ``engine.models.registry`` is the one place that knows them all.
"""
