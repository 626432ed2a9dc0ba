"""The building blocks the model families are made of (nano-vllm's ``layers/``).

``shard``: the weights a tensor-parallel rank keeps, fetched by Hugging Face name.
"""
