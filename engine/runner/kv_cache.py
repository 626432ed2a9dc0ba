"""Sizing and allocating the paged KV pool.

Each layer owns one K and one V tensor of ``[num_blocks, block_size, num_kv_heads,
head_dim]`` (see :mod:`engine.ops` for the slot layout); a block therefore costs
``2 * layers * block_size * kv_heads * head_dim * itemsize`` bytes across the model.
"""

from __future__ import annotations

import torch

from engine.errors import InvalidParamError
from engine.models.config import ModelConfig


def bytes_per_block(model_config: ModelConfig, dtype: torch.dtype, block_size: int) -> int:
    """Bytes one block takes across every layer, K and V together."""
    per_token = model_config.num_key_value_heads * model_config.head_dim * dtype.itemsize
    return 2 * model_config.num_hidden_layers * block_size * per_token


def free_memory(device: torch.device | str) -> int:
    """Bytes free on ``device``: CUDA's free memory, or MemAvailable on a CPU host."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file counts kB
    raise OSError("/proc/meminfo has no MemAvailable line")


def num_kv_blocks(
    model_config: ModelConfig,
    dtype: torch.dtype,
    block_size: int,
    kv_cache_memory: int | float,
    device: torch.device | str,
    *,
    max_model_len: int | None = None,
) -> int:
    """How many blocks the budget buys.

    ``kv_cache_memory`` is bytes (int) or a fraction of the device's free memory (float).
    Raises :class:`InvalidParamError` (``param="kv_cache_memory"``) when the pool could not
    hold even one request of ``max_model_len`` tokens (default: the model's maximum).
    """
    if isinstance(kv_cache_memory, float):
        budget = int(free_memory(device) * kv_cache_memory)
    else:
        budget = int(kv_cache_memory)
    per_block = bytes_per_block(model_config, dtype, block_size)
    blocks = budget // per_block
    max_len = max_model_len or model_config.max_position_embeddings
    needed = -(-max_len // block_size)
    if blocks < needed:
        raise InvalidParamError(
            f"kv_cache_memory of {budget} bytes gives {blocks} KV blocks of {per_block} bytes; "
            f"one request of {max_len} tokens needs {needed}. Raise kv_cache_memory or lower "
            f"max_model_len.",
            param="kv_cache_memory",
        )
    return int(blocks)


def allocate_kv_caches(
    model_config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One zeroed ``(k_cache, v_cache)`` pair per layer.

    Zeroed, not empty: attention gathers whole blocks and masks the unused tail, and a
    masked weight of 0 times a NaN left in fresh memory would still be NaN.
    """
    shape = (num_blocks, block_size, model_config.num_key_value_heads, model_config.head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(model_config.num_hidden_layers)
    ]
